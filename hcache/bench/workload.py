"""End-to-end workload: replay a chat or long-context trace; TTFT and TBT of ideal, recompute, KV offload and hcache auto.

The replay is event-driven on a simulated clock, with one engine serving requests first come, first served
(the reference engine serves one request at a time). Sessions arrive by the trace; each later turn arrives
its think time after the previous reply finished. Every request really runs on the runtime, and its
measured times advance the clock, so TTFT = queueing wait + measured time to the first token (restore,
prefill) and TBT is the measured time between consecutive tokens. Each (method, rate) replays the same
trace, with the same token ids, in a store of its own, so no method reuses another's chunks:
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
Replies are forced to the trace's lengths (no stop token). ``bytes_per_token`` is the store's bytes over
the tokens it holds, chunk headers included. Throughput is output tokens over the replay's span (first
arrival to last reply). ``restore_share`` is the share of the engine's busy time spent restoring.
Absolute CPU times mean little; compare the methods within one run.

``--through mii`` replays the same loop through DeepSpeed-MII's own ``mii.pipeline`` (``hcache.mii.pipeline``,
``--engine``: the reference engine on a CPU, FastGen on a GPU), one call per request, for ``recompute``
(hcache off), ``kv``, ``auto``, ``auto_gpu_cache`` and, on FastGen, ``mii``: plain ``mii.pipeline`` without
hcache. MII returns whole replies, so the pipeline's batching steps are timed: with one sequence running,
each of the reply's steps made one token, the first of them ending the prefill (TTFT) and the rest the
TBTs. Restores come from the request log; prefetch is the engine's. MII takes text, so prompts are words
that tokenize back to the same ids: a ``random:`` model is saved with ``hcache bench mii``'s word-level
tokenizer (exact, replies included); an HF model's prompts are drawn from its whole-word tokens and its
replies are tokenized again from their text, so a reply's ids may differ slightly from the model's.
``ideal`` is runtime-only.

``--eviction cost,lru`` replays each method under each eviction policy of the GPU prefix cache and the host
pool (:mod:`hcache.storage.eviction`), side by side in one run (``method:policy``), and prints TTFT and the
tokens restored from each tier by policy, with cost's ratios to LRU. Eviction needs memory pressure:
``--kv-blocks`` small for the GPU cache, ``--host-mib`` for the host pool.
"""
from __future__ import annotations

import argparse
import heapq
import json
import tempfile
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..model.loader import DEFAULT_MODEL, LoadedModel, load_model, model_dir, model_dtype
from ..planning.profile import Profile
from ..planning.profiler import measure_profile
from ..restore.records import GPU_CACHE, RestoreStep, SequenceRecord
from ..serving.runtime import HCacheRuntime, RequestResult
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.host_tier import DEFAULT_READERS
from ._workload_options import kv_blocks, memory_settings, parse_policies, parse_rates, profile_tokens
from ._workload_report import METRICS, plot, print_eviction, print_table, write_csv
from .traces import LEVAL, PRESETS, Trace, load_sharegpt, make_trace

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
    parser.add_argument("--max-tokens", type=int, default=1024, help="cap on a session's whole history (at most the model's context)")
    parser.add_argument("--max-turns", type=int, default=4, help="turns kept per session")
    parser.add_argument("--think-scale", type=float, default=0.05, help="think times times this (1 = the published means)")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="the engine's KV blocks of 64 tokens (FastGen's own blocks, as many tokens), for every method but ideal (default: 4 histories of --max-tokens)")
    parser.add_argument("--through", default="runtime", choices=["runtime", "mii"], help="replay through hcache's runtime or mii.pipeline")
    parser.add_argument("--engine", default="auto", choices=["auto", "fastgen", "reference"], help="--through mii: auto is FastGen on a GPU")
    parser.add_argument("--methods", default=None,
                        help=f"runtime: a subset of {','.join(METHODS)}; mii: of {','.join(MII_METHODS)} (mii on FastGen only)")
    parser.add_argument("--eviction", default=None,
                        help="comma-separated eviction policies (cost, lru): every method replayed under each, side by side (default: the runtime's)")
    parser.add_argument("--host-mib", type=int, default=None, help="the host pool in MiB, for memory pressure (default: the runtime's)")
    parser.add_argument("--profile", default=None, help="profile for the auto plan (default: measure one at start)")
    parser.add_argument("--readers", type=int, default=DEFAULT_READERS)
    parser.add_argument("--csv", dest="csv_path", default=None, help="write one row per method and rate here (default: next to --json)")
    parser.add_argument("--plot", default=None, help="write the TTFT-against-rate plot here (default: next to --json, as .png)")


def run(args: argparse.Namespace) -> dict:
    rates = parse_rates(args.rates)
    engine = _mii_engine(args) if args.through == "mii" else None
    offered = METHODS if engine is None else [m for m in MII_METHODS if m != "mii" or engine == "fastgen"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods is not None else list(offered)
    if not methods or set(methods) - set(offered):
        raise ValueError(f"--methods must name some of {', '.join(offered)} with --through {args.through}"
                         f"{f' on {engine}' if engine else ''}, not {args.methods!r}")
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
        raise ValueError(f"--max-tokens must lie in [{CHUNK_TOKENS}, {spec.max_positions}] for {loaded.name}, not {args.max_tokens}")
    traces = [_trace(args, loaded, rate) for rate in rates]
    profile = None
    if {"auto", "auto_gpu_cache"} & set(methods):
        profile = (
            Profile.load(args.profile, spec) if args.profile
            else measure_profile(loaded, profile_tokens(args.max_tokens), repeats=2, readers=args.readers)
        )
    requests = sum(len(s.turns) for s in traces[0].sessions)
    by_rate: dict[str, list[dict]] = {name: [] for *_, name in runs}
    with tempfile.TemporaryDirectory(prefix="hcache-workload-") as tmp, \
            tqdm(total=requests * len(rates) * len(runs), desc="replay", unit="req") as bar:
        if engine is None:
            serve, words = _runtime(loaded, profile, args, traces[0]), np.arange(spec.vocab_size)
        else:
            serve, words = _through_mii(loaded, engine, profile, args, Path(tmp))
        for rate, trace in zip(rates, traces):
            for method, policy, name in runs:
                bar.set_postfix(rate=rate, method=name)
                by_rate[name].append(_replay(lambda d, m=method, p=policy: serve(m, d, p), words, trace, rate, method, args, bar))
    sessions = traces[0].sessions
    turns = [t for s in sessions for t in s.turns]
    result = {
        "model": loaded.name,
        "through": args.through if engine is None else f"mii ({engine})",
        "trace": {
            "name": traces[0].name, "sessions": len(sessions), "requests": requests, "seed": args.seed,
            "scale": args.scale, "max_output": args.max_output, "max_tokens": args.max_tokens,
            "max_turns": args.max_turns, "think_scale": args.think_scale, "zipf": args.zipf,
            "kv_blocks": kv_blocks(args), "host_mib": args.host_mib,
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


def _ids(seed: int, key: tuple[int, ...], n: int, words: np.ndarray) -> list[int]:
    """Token ids drawn from ``words`` that depend only on ``key``: every method and rate sends the same prompts."""
    return words[np.random.default_rng([seed, *key]).integers(0, len(words), n)].tolist()


def _runtime(loaded: LoadedModel, profile: Profile | None, args, trace: Trace):
    """``serve(method, store_dir)``: an :class:`HCacheRuntime` set up for ``method``; ideal's engine has blocks
    for every session's history too, so its GPU prefix cache never evicts."""
    every_history = sum(-(-s.total_tokens // CHUNK_TOKENS) for s in trace.sessions)

    def serve(method: str, store_dir: str, eviction: str | None) -> _Runtime:
        plan, save, restore, gpu_cache = _RUNTIME[method]
        return _Runtime(HCacheRuntime(
            loaded, store_dir, plan=plan, save=save, profile=profile if plan == "auto" else None,
            readers=args.readers, num_blocks=kv_blocks(args) + (every_history if method == "ideal" else 0),
            gpu_cache=gpu_cache, **memory_settings(args, eviction),
        ), restore)

    return serve


class _Runtime:
    """The replay's view of a server: ``generate``, ``prefetch``, and its ``store`` and ``gpu_cache``."""

    def __init__(self, runtime: HCacheRuntime, restore: bool):
        self.runtime, self.restore = runtime, restore
        self.prefetch, self.store, self.gpu_cache = runtime.prefetch, runtime.store, runtime.gpu_cache

    def generate(self, prompt: list[int], max_new_tokens: int) -> RequestResult:
        return self.runtime.generate(prompt, max_new_tokens, restore=self.restore, stop_token_ids=())

    def __enter__(self) -> "_Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.runtime.close()


def _mii_engine(args: argparse.Namespace) -> str:
    from ..config import HCacheConfig, engine_and_device

    return engine_and_device(HCacheConfig(engine=args.engine))[0]


def _through_mii(loaded: LoadedModel, engine: str, profile: Profile | None, args, tmp: Path):
    """``serve(method, store_dir)``: a pipeline through MII for ``method``, and the token ids prompts are drawn
    from (those that tokenize back to themselves: see the module docstring)."""
    from transformers import AutoTokenizer

    from .mii import save_random_model

    random = args.model.startswith("random:")
    path = save_random_model(args.model, loaded.model.dtype, tmp / "model") if random else model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    words = np.arange(loaded.spec.vocab_size) if random else _whole_words(tokenizer)
    if profile is not None:
        profile.save(tmp / "profile.json")

    # FastGen takes its cache's size from MII's engine config, in blocks of its own size; the reference
    # engine from hcache's config, with its device
    mii_options = {"inference_engine_config": _fastgen_memory(args, loaded.spec.head_size)} if engine == "fastgen" else {}
    placed = {"device": args.device} if engine == "reference" else {}

    def serve(method: str, store_dir: str, eviction: str | None) -> _Mii:
        options = _MII[method]
        config = None if options is None else {
            "engine": engine, "store_dirs": [store_dir], "request_log": f"{store_dir}/requests.jsonl",
            "num_blocks": kv_blocks(args), "readers": args.readers, "dtype": args.dtype, **placed, **options,
            **memory_settings(args, eviction),
            **({"profile": str(tmp / "profile.json")} if options.get("plan") == "auto" else {}),
        }
        return _Mii(str(path), tokenizer, config, mii_options)

    return serve, words


def _fastgen_memory(args: argparse.Namespace, head_size: int) -> dict:
    """MII's engine config that gives FastGen the KV cache of ``--kv-blocks`` (blocks of 64 tokens), in
    blocks of FastGen's own size for this head size (DeepSpeed's rule; it reads the GPU's capability)."""
    from deepspeed.inference.v2.kernels.ragged_ops.blocked_flash.blocked_flash import get_kv_block_size

    blocks = -(-kv_blocks(args) * CHUNK_TOKENS // get_kv_block_size(head_size))
    return {"state_manager": {"memory_config": {"mode": "allocate", "size": blocks}}}


def _whole_words(tokenizer) -> np.ndarray:
    """Ids of the tokens that are one space-led alphabetic word and tokenize back to themselves alone: a text
    of such words tokenizes to exactly its ids."""
    texts = tokenizer.batch_decode([[t] for t in range(len(tokenizer))])
    ids = [t for t, w in enumerate(texts) if len(w) > 1 and w[0] == " " and w[1:].isascii() and w[1:].isalpha()]
    encoded = tokenizer([texts[t] for t in ids], add_special_tokens=False)["input_ids"]
    return np.array([t for t, e in zip(ids, encoded) if e == [t]])


class _Mii:
    """``hcache.mii.pipeline`` (plain ``mii.pipeline`` for ``config=None``) answering one prompt per call,
    with the same view as :class:`_Runtime`. Its batching steps are timed: with one sequence running, each of
    the reply's steps made one of its tokens."""

    def __init__(self, path: str, tokenizer, config: dict | None, mii_options: dict):
        from .mii import pipeline_on_free_port

        self.tokenizer, self.config = tokenizer, config
        self.pipe = pipeline_on_free_port(path, config, **mii_options)
        served = self.pipe.inference_engine if config is not None else None
        self.store = served.stack.store if served is not None else None
        self.gpu_cache = served.stack.gpu_cache if served is not None else None
        self.prefetch = served.prefetch if served is not None else (lambda prompt: 0)
        self.steps: list[float] = []
        step = self.pipe.generate

        def timed_step(*a, **kw):
            step(*a, **kw)
            self.steps.append(time.perf_counter())

        self.pipe.generate = timed_step

    def generate(self, prompt: list[int], max_new_tokens: int) -> RequestResult:
        self.steps.clear()
        start = time.perf_counter()
        reply = self.pipe([self.tokenizer.decode(prompt)], max_new_tokens=max_new_tokens, ignore_eos=True, do_sample=False)[0]
        if reply.generated_length != max_new_tokens or len(self.steps) < max_new_tokens:
            raise RuntimeError(f"MII answered {reply.generated_length} tokens in {len(self.steps)} steps, not {max_new_tokens}")
        times = self.steps[-max_new_tokens:]  # the first ended the prefill
        record = json.loads(Path(self.config["request_log"]).read_text().splitlines()[-1]) if self.config else {}
        cost = {f.name: record[f.name] for f in fields(SequenceRecord) if f.name in record}
        cost["restores"] = [RestoreStep(**step) for step in cost.get("restores", [])]
        return RequestResult(
            output_ids=self.tokenizer.encode(reply.generated_text, add_special_tokens=False),
            prompt_tokens=reply.prompt_length, ttft_s=times[0] - start, tbt_s=np.diff(times).tolist(), **cost,
        )

    def __enter__(self) -> "_Mii":
        return self

    def __exit__(self, *exc) -> None:
        if self.config is not None:
            self.pipe.inference_engine.close()
        self.pipe.destroy()


def _replay(serve, words: np.ndarray, trace: Trace, rate: float, method: str, args, bar: tqdm) -> dict:
    """One method's replay at one rate, through ``serve(store_dir)`` (the runtime's or MII's)."""
    sessions = trace.sessions
    ttft, tbt, restore_s, busy, restored, outputs, plans = [], [], 0.0, 0.0, 0, 0, set()
    gpu_tokens, hidden_s, replies, tiers = 0, 0.0, {}, Counter()
    with tempfile.TemporaryDirectory(prefix=f"hcache-workload-{method}-") as store_dir:
        with serve(store_dir) as runtime:
            history = {
                i: _ids(args.seed, (1, s.document), s.context_tokens, words) if s.context_tokens else []
                for i, s in enumerate(sessions)
            }

            def prompt_of(i: int, k: int) -> list[int]:
                return history[i] + _ids(args.seed, (2, i, k), sessions[i].turns[k].input_tokens, words)

            queue = [(s.arrival_s, i, 0) for i, s in enumerate(sessions)]
            heapq.heapify(queue)
            clock = first = queue[0][0]
            while queue:
                arrival, i, k = heapq.heappop(queue)
                turn = sessions[i].turns[k]
                prompt = prompt_of(i, k)
                begin = max(clock, arrival)
                if method not in ("ideal", "recompute"):  # look-ahead: the requests waiting behind this one
                    for waiting in sorted(queue):
                        if waiting[0] <= begin:
                            runtime.prefetch(prompt_of(*waiting[1:]))
                start = time.perf_counter()
                r = runtime.generate(prompt, turn.output_tokens)
                service = time.perf_counter() - start
                free = r.restore_s if method == "ideal" else 0.0  # ideal: the history is already on the device
                clock = begin + service - free
                ttft.append(begin - arrival + r.ttft_s - free)
                tbt += r.tbt_s
                busy += service - free
                restore_s += r.restore_s - free
                restored += r.restored_tokens
                gpu_tokens += r.gpu_tokens
                tiers.update(r.tier_tokens)
                hidden_s += r.prefetch_hidden_s
                outputs += len(r.output_ids)
                plans.update(step.plan for step in r.restores)
                history[i] = prompt + r.output_ids
                replies[f"{i}.{k}"] = r.output_ids
                if k + 1 < len(sessions[i].turns):
                    heapq.heappush(queue, (clock + sessions[i].turns[k + 1].think_s, i, k + 1))
                bar.update()
        stats = runtime.store.stats() if runtime.store else None  # after close: every chunk saved is on disk
        cache = runtime.gpu_cache
    held = stats["stores"][0]["chunks"] * CHUNK_TOKENS if stats else 0
    return {
        "rate": rate,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tbt_mean_s": float(np.mean(tbt)) if tbt else None,
        "tbt_p99_s": float(np.percentile(tbt, 99)) if tbt else None,
        "throughput_tok_s": outputs / (clock - first),
        "restore_tokens_per_s": restored / restore_s if restored and restore_s > 0 else None,
        "bytes_per_token": 0.0 if method == "ideal" or not held else stats["stores"][0]["used_bytes"] / held,
        "restore_share": restore_s / busy,
        "requests": len(ttft),
        "restored_tokens": restored,
        "gpu_tokens": gpu_tokens,
        "tier_tokens": {GPU_CACHE: gpu_tokens, **tiers} if gpu_tokens else dict(tiers),  # restored, by where from
        "gpu_cache_hit_rate": cache.hit_tokens / max(cache.hit_tokens + cache.miss_tokens, 1) if cache else None,
        "prefetch_hidden_s": hidden_s,
        "plans": sorted(plans),
        "replies": replies,  # by "session.turn"
    }
