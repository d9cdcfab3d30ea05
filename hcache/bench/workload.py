"""End-to-end workload: replay a chat or long-context trace; TTFT and TBT of ideal, recompute, KV offload and hcache auto.

Each (method, rate) replays the same trace (:mod:`hcache.workload.traces`), with the same token ids, in a store
of its own, so no method reuses another's chunks, by :func:`hcache.workload.replay.replay` (requests served
first come, first served on a simulated clock advanced by their measured times):
- ``ideal``: no eviction, as if every history stayed in device memory (prefix sharing included): the GPU
  prefix cache with blocks for every session's history, and the time of every restore (adoption or read)
  counted as zero, so TTFT is the prefill of the new tokens over the history already on the device. It
  stores nothing off the device: ``bytes_per_token`` 0.
- ``recompute``: ignores stored state and prefills the whole history (``restore=False``, nothing saved).
- ``kv``: KV offload: every layer's K/V saved, and restored from the store.
- ``auto``: hcache's bubble-free plan per history length, from a profile (``--profile``, or measured at
  start over the trace's history range). On a GQA model such as SmolLM2 on this CPU the plan is all-KV,
  so auto is KV there; hidden states pay off on MHA models (Llama-2-7B).
- ``auto_gpu_cache``: ``auto`` with the GPU prefix cache (:mod:`hcache.serving.gpu_prefix_cache`): finished
  requests' KV stays in the engine's blocks (``--kv-blocks`` in all, as for every method but ideal), and
  a returning history is copied from there, partial last chunk included; only what was evicted is restored.
Every method but ``ideal`` and ``recompute`` prefetches (look-ahead): before a request runs, each request
already waiting in the queue starts reading its stored chunks into the host pool; ``prefetch_hidden_s`` is
the read time that ran ahead of the restores. ``gpu_cache_hit_rate``: the share of the tokens looked up
that the GPU cache had.
Absolute CPU times mean little; compare the methods within one run.

``--through mii`` replays the same loop through DeepSpeed-MII's own ``mii.pipeline`` (``hcache.mii.pipeline``,
``--engine``: the reference engine on a CPU, FastGen on a GPU; :class:`hcache.workload.servers.MiiServer`),
one call per request, for ``recompute`` (hcache off), ``kv``, ``auto``, ``auto_gpu_cache`` and, on FastGen,
``mii``: plain ``mii.pipeline`` without hcache. Prefetch is the engine's. MII takes text, so prompts are
words that tokenize back to the same ids: a ``random:`` model is saved with a word-level tokenizer
(:func:`hcache.model.random_weights.save_random_model`: exact, replies included); an HF model's prompts are
drawn from its whole-word tokens and its replies are tokenized again from their text, so a reply's ids may
differ slightly from the model's.
``ideal`` is runtime-only.

``--eviction cost,lru`` replays each method under each eviction policy of the GPU prefix cache and the host
pool (:mod:`hcache.storage.eviction`), side by side in one run (``method:policy``), and prints TTFT and the
tokens restored from each tier by policy, with cost's ratios to LRU. Eviction needs memory pressure:
``--kv-blocks`` small for the GPU cache, ``--host-mib`` for the host pool.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..model.loader import DEFAULT_MODEL, LoadedModel, load_model, model_dir, model_dtype
from ..planning.profile import Profile
from ..planning.profiler import measure_profile
from ..serving.runtime import HCacheRuntime
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.host_tier import DEFAULT_READERS
from ..workload.replay import replay
from ..workload.servers import MiiServer, RuntimeServer, whole_word_ids
from ..workload.traces import LEVAL, PRESETS, Trace, load_sharegpt, make_trace
from ._workload_options import kv_blocks, memory_settings, parse_policies, parse_rates, profile_tokens
from ._workload_report import METRICS, plot, print_eviction, print_table, write_csv

METHODS = ("ideal", "recompute", "kv", "auto", "auto_gpu_cache")
_RUNTIME = {  # method -> (plan, save policy, restore, GPU prefix cache)
    "ideal": ("KV", "plan", True, True),
    "recompute": ("KV", "none", False, False),
    "kv": ("KV", "plan", True, False),
    "auto": ("auto", "plan", True, False),
    "auto_gpu_cache": ("auto", "plan", True, True),
}
MII_METHODS = ("recompute", "kv", "auto", "auto_gpu_cache", "mii")
_MII = {  # method -> hcache.mii config (None: plain mii.pipeline)
    "recompute": {"enabled": False},
    "kv": {"plan": "KV"},
    "auto": {"plan": "auto"},
    "auto_gpu_cache": {"plan": "auto", "gpu_cache": True},
    "mii": None,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="e.g. random:llama-2-7b on a GPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: float16 on a GPU)")
    parser.add_argument("--trace", default="sharegpt", choices=PRESETS, help="synthetic trace preset")
    parser.add_argument("--sharegpt", default=None, help="replay this ShareGPT JSON file instead of a synthetic trace")
    parser.add_argument("--sessions", type=int, default=6, help="sessions in the trace (the first ones of a file)")
    parser.add_argument("--rates", default="0.25,1,4", help="session arrival rates to sweep, per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf", type=float, default=None, help="L-Eval presets: Zipf exponent of document reuse")
    parser.add_argument("--scale", type=float, default=0.25, help="token lengths times this (1 = the published means)")
    parser.add_argument("--max-output", type=int, default=24, help="cap on reply lengths (decode is slow on a CPU)")
    parser.add_argument(
        "--max-tokens", type=int, default=1024, help="cap on a session's whole history (at most the model's context)"
    )
    parser.add_argument("--max-turns", type=int, default=4, help="turns kept per session")
    parser.add_argument(
        "--think-scale", type=float, default=0.05, help="think times times this (1 = the published means)"
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="the engine's KV blocks of 64 tokens (FastGen's own blocks, as many tokens), for every method but ideal (default: 4 histories of --max-tokens)",
    )
    parser.add_argument(
        "--through",
        default="runtime",
        choices=["runtime", "mii"],
        help="replay through hcache's runtime or mii.pipeline",
    )
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "fastgen", "reference"],
        help="--through mii: auto is FastGen on a GPU",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help=f"runtime: a subset of {','.join(METHODS)}; mii: of {','.join(MII_METHODS)} (mii on FastGen only)",
    )
    parser.add_argument(
        "--eviction",
        default=None,
        help="comma-separated eviction policies (cost, lru): every method replayed under each, side by side (default: the runtime's)",
    )
    parser.add_argument(
        "--host-mib", type=int, default=None, help="the host pool in MiB, for memory pressure (default: the runtime's)"
    )
    parser.add_argument("--profile", default=None, help="profile for the auto plan (default: measure one at start)")
    parser.add_argument("--readers", type=int, default=DEFAULT_READERS)
    parser.add_argument(
        "--csv", dest="csv_path", default=None, help="write one row per method and rate here (default: next to --json)"
    )
    parser.add_argument(
        "--plot", default=None, help="write the TTFT-against-rate plot here (default: next to --json, as .png)"
    )


def run(args: argparse.Namespace) -> dict:
    rates = parse_rates(args.rates)
    engine = _mii_engine(args) if args.through == "mii" else None
    offered = METHODS if engine is None else [m for m in MII_METHODS if m != "mii" or engine == "fastgen"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods is not None else list(offered)
    if not methods or set(methods) - set(offered):
        raise ValueError(
            f"--methods must name some of {', '.join(offered)} with --through {args.through}"
            f"{f' on {engine}' if engine else ''}, not {args.methods!r}"
        )
    if args.kv_blocks is not None and args.kv_blocks * CHUNK_TOKENS < args.max_tokens:
        least = -(-args.max_tokens // CHUNK_TOKENS)
        raise ValueError(f"--kv-blocks must hold a whole history of --max-tokens {args.max_tokens}: at least {least}")
    if args.zipf is not None and (args.sharegpt or args.trace not in LEVAL):
        raise ValueError("--zipf applies to the L-Eval presets only")
    policies = parse_policies(args.eviction)
    if args.host_mib is not None and args.host_mib < 1:
        raise ValueError(f"--host-mib must be at least 1, not {args.host_mib}")
    runs = [(m, p, m if p is None else f"{m}:{p}") for m in methods for p in policies]
    loaded = load_model(args.model, dtype=model_dtype(args.dtype, args.device), device=args.device)
    spec = loaded.spec
    if not CHUNK_TOKENS <= args.max_tokens <= spec.max_positions:
        raise ValueError(
            f"--max-tokens must lie in [{CHUNK_TOKENS}, {spec.max_positions}] for {loaded.name}, not {args.max_tokens}"
        )
    traces = [_trace(args, loaded, rate) for rate in rates]
    profile = None
    if {"auto", "auto_gpu_cache"} & set(methods):
        profile = (
            Profile.load(args.profile, spec)
            if args.profile
            else measure_profile(loaded, profile_tokens(args.max_tokens), repeats=2, readers=args.readers)
        )
    requests = sum(len(s.turns) for s in traces[0].sessions)
    by_rate: dict[str, list[dict]] = {name: [] for *_, name in runs}
    with (
        tempfile.TemporaryDirectory(prefix="hcache-workload-") as tmp,
        tqdm(total=requests * len(rates) * len(runs), desc="replay", unit="req") as bar,
    ):
        if engine is None:
            serve, words = _runtime(loaded, profile, args, traces[0]), np.arange(spec.vocab_size)
        else:
            serve, words = _through_mii(loaded, engine, profile, args, Path(tmp))
        for rate, trace in zip(rates, traces):
            for method, policy, name in runs:
                bar.set_postfix(rate=rate, method=name)
                by_rate[name].append(
                    {
                        "rate": rate,
                        **replay(
                            lambda d, m=method, p=policy: serve(m, d, p),
                            words,
                            trace,
                            args.seed,
                            prefetch=method not in ("ideal", "recompute"),
                            on_device=method == "ideal",
                            done=bar.update,
                        ),
                    }
                )
    sessions = traces[0].sessions
    turns = [t for s in sessions for t in s.turns]
    result = {
        "model": loaded.name,
        "through": args.through if engine is None else f"mii ({engine})",
        "trace": {
            "name": traces[0].name,
            "sessions": len(sessions),
            "requests": requests,
            "seed": args.seed,
            "scale": args.scale,
            "max_output": args.max_output,
            "max_tokens": args.max_tokens,
            "max_turns": args.max_turns,
            "think_scale": args.think_scale,
            "zipf": args.zipf,
            "kv_blocks": kv_blocks(args),
            "host_mib": args.host_mib,
            "mean_input_tokens": float(np.mean([t.input_tokens for t in turns])),
            "mean_output_tokens": float(np.mean([t.output_tokens for t in turns])),
            "mean_session_tokens": float(np.mean([s.total_tokens for s in sessions])),
        },
        "rates": rates,
        "reference_rate": rates[0],
        "eviction": [p for p in policies if p is not None],
        # the headline figures are at the lowest rate, where queueing least hides the method's own cost
        "methods": {m: {**{k: runs[0][k] for k in METRICS}, "by_rate": runs} for m, runs in by_rate.items()},
    }
    print_table(result)
    if len(policies) > 1:
        print_eviction(result)
    stem = Path(args.json_path).with_suffix("") if args.json_path else None
    csv_path = args.csv_path or (f"{stem}.csv" if stem else None)
    if csv_path:
        write_csv(result, csv_path)
    plot_path = args.plot or (f"{stem}.png" if stem else None)
    if plot_path:
        plot(result, plot_path)
    return result


def _trace(args: argparse.Namespace, loaded: LoadedModel, rate: float) -> Trace:
    if args.sharegpt:
        count = (lambda text: len(loaded.tokenizer.encode(text))) if loaded.tokenizer is not None else None
        trace = load_sharegpt(args.sharegpt, count, rate=rate, seed=args.seed, limit=args.sessions)
    else:
        trace = make_trace(args.trace, args.sessions, rate, args.seed, args.zipf)
    trace = trace.scaled(args.scale, args.max_output, args.max_tokens, args.max_turns, args.think_scale)
    if not trace.sessions:
        raise ValueError(f"no session of the trace fits --max-tokens {args.max_tokens}")
    return trace


def _runtime(loaded: LoadedModel, profile: Profile | None, args, trace: Trace):
    """``serve(method, store_dir)``: an :class:`HCacheRuntime` set up for ``method``; ideal's engine has blocks
    for every session's history too, so its GPU prefix cache never evicts."""
    every_history = sum(-(-s.total_tokens // CHUNK_TOKENS) for s in trace.sessions)

    def serve(method: str, store_dir: str, eviction: str | None) -> RuntimeServer:
        plan, save, restore, gpu_cache = _RUNTIME[method]
        return RuntimeServer(
            HCacheRuntime(
                loaded,
                store_dir,
                plan=plan,
                save=save,
                profile=profile if plan == "auto" else None,
                readers=args.readers,
                num_blocks=kv_blocks(args) + (every_history if method == "ideal" else 0),
                gpu_cache=gpu_cache,
                **memory_settings(args, eviction),
            ),
            restore,
        )

    return serve


def _mii_engine(args: argparse.Namespace) -> str:
    from ..config import HCacheConfig, engine_and_device

    return engine_and_device(HCacheConfig(engine=args.engine))[0]


def _through_mii(loaded: LoadedModel, engine: str, profile: Profile | None, args, tmp: Path):
    """``serve(method, store_dir)``: a pipeline through MII for ``method``, and the token ids prompts are drawn
    from (those that tokenize back to themselves: see the module docstring)."""
    from transformers import AutoTokenizer

    from ..model.random_weights import save_random_model

    random = args.model.startswith("random:")
    path = save_random_model(args.model, loaded.model.dtype, tmp / "model") if random else model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    words = np.arange(loaded.spec.vocab_size) if random else whole_word_ids(tokenizer)
    if profile is not None:
        profile.save(tmp / "profile.json")

    # FastGen takes its cache's size from MII's engine config, in blocks of its own size; the reference
    # engine from hcache's config, with its device
    mii_options = (
        {"inference_engine_config": _fastgen_memory(args, loaded.spec.head_size)} if engine == "fastgen" else {}
    )
    placed = {"device": args.device} if engine == "reference" else {}

    def serve(method: str, store_dir: str, eviction: str | None) -> MiiServer:
        options = _MII[method]
        config = (
            None
            if options is None
            else {
                "engine": engine,
                "store_dirs": [store_dir],
                "request_log": f"{store_dir}/requests.jsonl",
                "num_blocks": kv_blocks(args),
                "readers": args.readers,
                "dtype": args.dtype,
                **placed,
                **options,
                **memory_settings(args, eviction),
                **({"profile": str(tmp / "profile.json")} if options.get("plan") == "auto" else {}),
            }
        )
        return MiiServer(str(path), tokenizer, config, mii_options)

    return serve, words


def _fastgen_memory(args: argparse.Namespace, head_size: int) -> dict:
    """MII's engine config that gives FastGen the KV cache of ``--kv-blocks`` (blocks of 64 tokens), in
    blocks of FastGen's own size for this head size (DeepSpeed's rule; it reads the GPU's capability)."""
    from deepspeed.inference.v2.kernels.ragged_ops.blocked_flash.blocked_flash import get_kv_block_size

    blocks = -(-kv_blocks(args) * CHUNK_TOKENS // get_kv_block_size(head_size))
    return {"state_manager": {"memory_config": {"mode": "allocate", "size": blocks}}}
