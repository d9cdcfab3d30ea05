"""TTFT of returning conversations through ``vllm.LLM``: vLLM recomputing, vLLM's prefix cache, and hcache's
connector restoring from the host pool, the disk and Redis, side by side in one run.

``--conversations`` histories of ``--history`` random tokens are each first prefilled with a first question
(``prefill_s``: where hcache saves, the saving is in it). Then each history returns with a new question
and one token is generated: the time of that ``generate`` call is its TTFT. Every configuration is a vLLM
engine of its own, all alive at once, over the same histories and questions, and the first and the returning
questions are **interleaved**: each history returns to every engine in turn, a second or so apart, the engines'
order rotating from one history to the next, so that the machine's drift over minutes falls on every
configuration alike:

- ``recompute``: vLLM with its prefix cache off, which prefills every returning history;
- ``prefix_cache``: vLLM's own prefix cache (its KV blocks in the engine's memory);
- ``hcache_host``: hcache's connector (prefix cache off, a store of its own), the histories saved by the
  first questions and restored from the host pool;
- ``hcache_disk``: an engine over a store directory that another engine, closed before it started, saved
  the histories into (with Redis): it meets each history for the first time, restored from the disk;
- ``hcache_redis``: likewise with Redis as its only tier: restored from Redis;
- ``hcache_miss``: the connector loaded over an empty store, which it misses: vLLM recomputing with
  hcache's connector in the engine (looking up, saving), the like-for-like baseline (``speedup_vs_miss``).

Each engine's KV cache holds every history twice over, no more (``kv_cache_memory_bytes``), so that they
fit in memory at once; ``--plans`` and ``--sliding-layers`` multiply the hcache engines.

With ``--plans`` of more than one plan (``KV,H``), the three hcache configurations run once per plan, each
named with its plan (``hcache_host_H``), and every plan saves both formats (``save="all"``). ``--mha``
benchmarks the model made MHA (as many K/V heads as query heads, random weights, its tokenizer), where
hidden states are half the bytes of K/V: H's case. ``--tp N`` runs every engine with vLLM's tensor
parallelism of N ranks (on a CPU, each rank bound to CPUs of its own: :func:`ranks_bound`); each rank
stores and loads its own K/V heads, and ``stored_bytes_per_token`` counts every rank's. ``--heads Q,KV``
reshapes the model to Q query and KV key/value heads of its head size (random weights, its tokenizer): a
shape whose heads divide by ``--tp``, where the model's do not (SmolLM2's 9 and 3). ``--window W`` gives
the model (random weights) sliding-window layers of W tokens, 1 in ``--full-every`` layers keeping full
attention (2: Gemma 2's layout, 6: Gemma 3's), which vLLM runs with two KV cache groups; with
``--sliding-layers window,all`` the hcache configurations run once per value, each over a store of its own
(``_all``: every token stored and restored, as full attention), and ``stored_file_bytes_per_token`` is
what that store's chunk files hold per stored token.

``--family qwen3`` or ``qwen3_next`` remakes the model as that family (random weights, its size, its
tokenizer): Qwen3, or Qwen3-Next, a hybrid of gated delta nets and attention as vLLM's CPU build takes it
(bfloat16). A hybrid's state is checkpointed by vLLM at its block boundaries only with its prefix cache on
(align mode): for one, every engine has it on, ``recompute`` is an engine that never met the histories, and
``hcache_host``'s prefix cache is reset after the first questions, so that the histories return from hcache;
a history restores to its last checkpoint (``block_size``, in the results: make ``--history`` a multiple).

``speedup`` is recompute's median TTFT over each configuration's (``speedup_vs_miss``: ``hcache_miss``'s
over it, ``speedup_vs_prefix_cache``: ``prefix_cache``'s); ``restored`` and ``stored_bytes_per_token`` (bytes
read, over the tokens restored) come from the connector's request log, ``read_bytes_by_layer_type`` too;
``stored_bytes_by_layer_type``: the tensors of the chunk files in a configuration's store directories, over
the histories' tokens. ``first_token_match`` counts returning questions whose first token equals
recompute's (a K/V computed in a smaller prefill may round apart from a full prefill's, so a near tie may
break the other way, as with vLLM's own prefix cache).

vLLM's CPU worker binds its compute threads to all cores but those it reserves for its other processes:
one, and one more when a KV connector is loaded (on a 2-core machine, then none). So that every engine
computes on the same cores, the benchmark sets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` unless it is set, and
records it.

``--decode`` measures decode steps instead: with and without the connector, saving or not, and while
other requests load (:mod:`hcache.bench._vllm_decode`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import HCacheConfig
from ..defaults import DEFAULT_LOAD_IN_STEP_TOKENS, DEFAULT_MODEL
from ..errors import InvalidRequestError
from ..storage.chunk_key import CHUNK_TOKENS
from . import _vllm_decode as decode
from ._vllm_model import shaped, stored_bytes_by_type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default) or a HF model directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--history", type=int, default=1024, help="tokens in each returning history")
    parser.add_argument("--conversations", type=int, default=5, help="histories, each returning once per configuration")
    parser.add_argument("--question", type=int, default=16, help="tokens in each question")
    parser.add_argument("--redis", default=None, help="a Redis server's URL (default: start one on loopback)")
    parser.add_argument(
        "--plans", default="KV", help="hcache's plans, comma-separated (e.g. KV,H): each restores from every tier"
    )
    parser.add_argument(
        "--mha", action="store_true", help="the model made MHA with random weights (as many K/V heads as query heads)"
    )
    parser.add_argument(
        "--family",
        choices=("qwen3", "qwen3_next"),
        default=None,
        help="the model remade as this family (random weights, its size and tokenizer); qwen3_next: a hybrid",
    )
    parser.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size for every engine")
    parser.add_argument(
        "--heads",
        default=None,
        help="Q,KV: the model reshaped to Q query and KV key/value heads of its head size, random weights",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help="give the model (random weights) sliding-window layers of this many tokens",
    )
    parser.add_argument(
        "--full-every", type=int, default=2, help="with --window: 1 in this many layers keeps full attention"
    )
    parser.add_argument(
        "--sliding-layers", default="window", help="hcache's sliding_layers settings, comma-separated (window,all)"
    )
    parser.add_argument(
        "--in-step",
        default=str(DEFAULT_LOAD_IN_STEP_TOKENS),
        help="hcache's load_in_step_tokens settings, comma-separated (0: every load asynchronous): each restores "
        "from every tier",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="time decode steps with and without the connector instead (the options below)",
    )
    decode.add_arguments(parser.add_argument_group("--decode"))


def _engine(args, model: str, prefix_cache: bool, connector: dict | None, memory: int):
    """A vLLM engine over ``model`` with ``memory`` bytes of KV cache (every engine of a run is alive at once)."""
    from vllm import LLM

    from ..vllm.settings import kv_transfer_config

    kv = kv_transfer_config(connector) if connector is not None else None
    parallel = {"tensor_parallel_size": args.tp, "distributed_executor_backend": "mp"} if args.tp > 1 else {}
    with ranks_bound(args.tp):
        return LLM(
            model=model,
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=args.history + 4 * args.question,
            kv_cache_memory_bytes=memory,
            enable_prefix_caching=prefix_cache,
            kv_transfer_config=kv,
            disable_log_stats=True,
            **parallel,
        )


def _timed(llm, prompt: list[int], params) -> tuple[float, int]:
    """One ``generate`` of ``prompt``: its time and its first token."""
    begin = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - begin, out[0].outputs[0].token_ids[0]


def _rotated(names: list[str], i: int) -> list[str]:
    """``names`` in the order of the ``i``-th history: rotated by one from the last, so that each engine
    runs first, second and last alike."""
    return names[i % len(names) :] + names[: i % len(names)]


def reserve_cpus_alike() -> dict:
    """vLLM's CPU worker keeps one core for its other processes, and one more when any KV connector is loaded
    (none at all on a 2-core machine, where both would leave nothing): engines with and without the
    connector would compute on different cores. The same number for every engine (this process's and those
    it starts) compares like with like; the number, for the results."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return {"vllm_cpu_reserved_cpus": int(os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"])}


@contextmanager
def ranks_bound(tp: int):
    """While vLLM engines of ``tp`` ranks start: each rank's OpenMP threads bound to CPUs of its own. With
    tensor parallelism on a CPU, vLLM binds each rank to a NUMA node of its own and refuses more ranks than
    nodes (one, on most machines) unless ``VLLM_CPU_OMP_THREADS_BIND`` says where: this process's CPUs,
    split evenly, unless it is set."""
    if tp == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise SystemExit(f"tensor_parallel_size={tp} needs a CPU a rank; this process may use {len(cpus)}")
    share = len(cpus) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cpus[r * share : (r + 1) * share])) for r in range(tp)
    )
    try:
        yield
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def run(args: argparse.Namespace) -> dict:
    reserved = reserve_cpus_alike()
    if args.decode:
        if args.tp > 1 or args.heads or args.family:
            raise SystemExit(
                "hcache bench vllm: --decode runs one rank of the model as it is; --tp, --heads and --family are for "
                "the TTFT runs"
            )
        return {**decode.run(args), **reserved}
    from transformers import AutoConfig
    from vllm import SamplingParams

    from ..model.spec import ModelSpec
    from ..storage.redis_server import RedisServer

    if args.conversations < 1 or args.history < 64:
        raise SystemExit("hcache bench vllm: --conversations must be at least 1 and --history at least 64")
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    rules = [r.strip() for r in args.sliding_layers.split(",") if r.strip()]
    try:
        in_steps = [int(n) for n in args.in_step.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(f"hcache bench vllm: --in-step takes whole numbers of tokens, not {args.in_step!r}") from None
    if not plans or not rules or not in_steps or min(in_steps) < 0:
        raise SystemExit(
            "hcache bench vllm: --plans, --sliding-layers and --in-step name at least one value each (--in-step: 0 or more)"
        )
    for rule in rules:  # before any engine starts
        try:
            HCacheConfig.of(sliding_layers=rule)
        except InvalidRequestError as exc:
            raise SystemExit(f"hcache bench vllm: --sliding-layers: {exc}") from None
    if args.window is not None and (args.window < 64 or args.full_every < 1):
        raise SystemExit("hcache bench vllm: --window must be at least 64 tokens and --full-every at least 1")
    if args.family == "qwen3_next" and (args.window or args.dtype != "bfloat16"):
        raise SystemExit(
            "hcache bench vllm: --family qwen3_next is bfloat16 (vLLM's CPU gated delta net) and has no --window"
        )
    one = SamplingParams(max_tokens=1, temperature=0)
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    histories = [tokens(args.history) for _ in range(args.conversations)]
    first, returning = ([tokens(args.question) for _ in histories] for _ in range(2))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hcache-bench-vllm-") as tmp:
        model, heads = shaped(args, Path(tmp) / "shaped")  # before Redis starts: it may refuse the shape
        redis = RedisServer().start() if args.redis is None else None
        url = args.redis or redis.url
        configs: dict[str, tuple[bool, dict | None, bool]] = {
            "recompute": (False, None, True),
            "prefix_cache": (True, None, True),
        }
        savers: dict[str, dict] = {}  # by rule: what saves the histories that the disk and Redis engines restore
        copies: dict[str, list[str]] = {}  # a saved store -> the disk engines' copies of it
        for plan, rule, in_step in itertools.product(plans, rules, in_steps):
            suffix = (
                (f"_{plan}" if len(plans) > 1 else "")
                + (f"_{rule}" if len(rules) > 1 else "")
                + (f"_in_step{in_step}" if len(in_steps) > 1 else "")
            )
            common = {
                "plan": plan,
                "save": "all" if len(plans) > 1 else "plan",
                "sliding_layers": rule,
                "namespace": rule if len(rules) > 1 else None,
                "load_in_step_tokens": in_step,
            }  # each rule stores apart (Redis: by namespace)
            saved = str(Path(tmp) / f"store-{rule}")
            store = [saved + (f"-in-step{in_step}" if len(in_steps) > 1 else "")]  # a copy each: a disk engine's own
            copies.setdefault(saved, []).append(store[0])
            savers.setdefault(rule, {**common, "store_dirs": [saved], "store": {"shared": [url]}})
            configs["hcache_host" + suffix] = (
                False,
                {**common, "store_dirs": [str(Path(tmp) / f"host{suffix}")]},
                True,
            )
            configs["hcache_disk" + suffix] = (
                False,
                {**common, "store_dirs": store, "store": {"shared": []}},
                False,
            )
            configs["hcache_redis" + suffix] = (
                False,
                {**common, "store_dirs": None, "store": {"shared": [url]}},
                False,
            )
        configs["hcache_miss"] = (False, {"store_dirs": [str(Path(tmp) / "empty")]}, False)
        spec = ModelSpec.from_config(AutoConfig.from_pretrained(model), args.dtype)
        hybrid = bool(spec.recurrent_layers)
        if hybrid:  # vLLM checkpoints a hybrid's state (align mode) only with its prefix cache on: on in every
            # engine, and recompute's an engine that never met the histories
            configs = {name: (True, c, prefill and name != "recompute") for name, (_, c, prefill) in configs.items()}
        logs = {name: Path(tmp) / f"{name}.jsonl" for name in configs}
        memory = 2 * args.conversations * (args.history + 4 * args.question) * spec.kv_bytes_per_token  # twice over
        engines: dict = {}
        try:
            for settings in tqdm(
                savers.values(), desc="saving the histories", unit="store"
            ):  # closed before the disk engines open the store
                llm = _engine(args, str(model), hybrid, settings, memory)
                llm.generate([{"prompt_token_ids": h + q} for h, q in zip(histories, first)], one, use_tqdm=False)
                llm.llm_engine.engine_core.shutdown()
                del llm
            for saved, stores in copies.items():
                for store in stores:
                    if store != saved:
                        shutil.copytree(saved, store)
            for name, (prefix_cache, connector, _) in tqdm(configs.items(), desc="vLLM engines", unit="engine"):
                engines[name] = _engine(
                    args, str(model), prefix_cache, connector and {**connector, "request_log": str(logs[name])}, memory
                )
            prefill_s: dict[str, list[float]] = {name: [] for name in configs}
            prefilling = [name for name, (_, _, prefill) in configs.items() if prefill]
            for i, (history, question) in enumerate(zip(histories, first)):
                for name in _rotated(prefilling, i):
                    prefill_s[name].append(_timed(engines[name], history + question, one)[0])
            # a first request's warm-up kept out of the timed ones: a prompt that shares no prefix with a history,
            # shorter than a chunk, so that no store or prefix cache keeps any of it
            warm = tokens(CHUNK_TOKENS - 1)
            for name in set(configs) - set(prefilling):
                _timed(engines[name], warm, one)
            for name, (prefix_cache, connector, _) in configs.items():
                if prefix_cache and connector:  # a hybrid's hcache_host: the histories returning from hcache alone
                    engines[name].reset_prefix_cache()
            block = engines["recompute"].llm_engine.vllm_config.cache_config.block_size
            for log in logs.values():
                log.unlink(missing_ok=True)  # the records of the returning questions only
            ttft: dict[str, list[float]] = {name: [] for name in configs}
            first_tokens: dict[str, list[int]] = {name: [] for name in configs}
            for i, (history, question) in enumerate(
                tqdm(list(zip(histories, returning)), desc="returning histories", unit="history")
            ):
                for name in _rotated(list(configs), i):
                    took, token = _timed(engines[name], history + question, one)
                    ttft[name].append(took)
                    first_tokens[name].append(token)
        finally:
            for llm in engines.values():
                llm.llm_engine.engine_core.shutdown()
            if redis is not None:
                redis.close()
        for name, (_, connector, _) in configs.items():
            records = [json.loads(line) for line in logs[name].read_text().splitlines()] if logs[name].exists() else []
            first_rank = [r for r in records if not r.get("tp_rank")]  # with tensor parallelism each rank logs its own
            tiers: dict[str, int] = {}
            for r in first_rank:
                for tier, n in r["tier_tokens"].items():
                    tiers[tier] = tiers.get(tier, 0) + n
            restored = sum(r["restored_tokens"] for r in first_rank)
            stored_dirs = (connector or {}).get("store_dirs") or []
            files = [p for d in stored_dirs for p in Path(d).glob("**/chunks/*/*.safetensors")]
            stored_tokens = args.conversations * (args.history // 64 * 64)
            results[name] = {
                "stored_file_bytes_per_token": sum(p.stat().st_size for p in files) / stored_tokens,
                "stored_bytes_by_layer_type": {
                    kind: n / stored_tokens for kind, n in sorted(stored_bytes_by_type(files, spec).items())
                },
                "read_bytes_by_layer_type": {
                    kind: sum(r.get("type_bytes", {}).get(kind, 0) for r in records) / max(1, restored)
                    for kind in {k for r in records for k in r.get("type_bytes", {})}
                },
                "ttft_s": ttft[name],
                "median_ttft_s": statistics.median(ttft[name]),
                "prefill_s": prefill_s[name],
                "restored_tokens": restored,
                "restored_by_tier": tiers,
                "first_tokens": first_tokens[name],
                "stored_bytes_per_token": sum(r["bytes_read"] for r in records) / restored
                if restored
                else 0,  # every rank's
            }
    reference, miss = results["recompute"], results["hcache_miss"]
    for name, r in results.items():
        r["speedup"] = reference["median_ttft_s"] / r["median_ttft_s"]
        r["speedup_vs_miss"] = miss["median_ttft_s"] / r["median_ttft_s"]
        r["speedup_vs_prefix_cache"] = results["prefix_cache"]["median_ttft_s"] / r["median_ttft_s"]
        r["first_token_match"] = sum(a == b for a, b in zip(r["first_tokens"], reference["first_tokens"]))
    shape = (
        f" reshaped to {heads['num_attention_heads']}/{heads['num_key_value_heads']} heads"
        if args.heads or args.mha
        else ""
    )
    if args.family:
        shape += f" remade as {args.family} (random weights)"
    if args.window:
        shape += f" with {args.window}-token sliding windows (1 in {args.full_every} layers full attention)"
    print(
        f"{args.model}{shape}, TP={args.tp}, {args.conversations} returning histories of {args.history} tokens (+{args.question}-token questions), {args.dtype}:"
    )
    if hybrid:
        print(
            f"a hybrid: vLLM's prefix cache on in every engine (its state checkpoints, every {block} tokens, need it); "
            "recompute: an engine that never met the histories; hcache_host: its prefix cache reset after the first turns"
        )
        if args.history % block:
            print(
                f"--history {args.history} is not a multiple of {block}: hcache restores to the last checkpoint in it"
            )
    print(
        f"{'configuration':20} {'TTFT ms':>9} {'min-max ms':>13} {'speedup':>8} {'vs miss':>8} {'vs prefix':>9} {'restored':>9}  {'by tier':24} {'B/token':>8} "
        f"{'files B/token':>13} {'1st token same':>15}"
    )
    for name, r in results.items():
        tiers = ",".join(f"{t}:{n}" for t, n in r["restored_by_tier"].items()) or "-"
        print(
            f"{name:20} {1000 * r['median_ttft_s']:9.1f} {1000 * min(r['ttft_s']):6.0f}-{1000 * max(r['ttft_s']):<6.0f} "
            f"{r['speedup']:7.2f}x {r['speedup_vs_miss']:7.2f}x {r['speedup_vs_prefix_cache']:8.2f}x {r['restored_tokens']:9d}  {tiers:24} {r['stored_bytes_per_token']:8.0f} "
            f"{r['stored_file_bytes_per_token']:13.0f} "
            f"{r['first_token_match']:>8d}/{args.conversations}"
        )
    print(f"{'configuration':20} {'stored B/token by layer type':40} {'read B/token by layer type':40}")
    for name, r in results.items():
        if r["stored_bytes_by_layer_type"] or r["read_bytes_by_layer_type"]:
            stored, read = (
                ", ".join(f"{kind} {n:.0f}" for kind, n in sorted(r[field].items())) or "-"
                for field in ("stored_bytes_by_layer_type", "read_bytes_by_layer_type")
            )
            print(f"{name:20} {stored:40} {read:40}")
    return {
        "model": args.model,
        "family": args.family,
        "hybrid": hybrid,
        "vllm_prefix_cache_in_every_engine": hybrid,
        "block_size": block,
        "mha": args.mha,
        "heads": heads,
        "tensor_parallel": args.tp,
        "plans": plans,
        "dtype": args.dtype,
        "history": args.history,
        "question": args.question,
        "window": args.window,
        "full_every": args.full_every if args.window else None,
        "sliding_layers": rules,
        "load_in_step_tokens": in_steps,
        "conversations": args.conversations,
        "configurations": results,
        **reserved,
    }
