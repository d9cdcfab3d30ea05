"""Cold restore of a long history stored lossless and in 8 bits (``stored_dtype``), from the disk store and from a Redis tier.

For each plan (KV, H), a history of ``--history`` tokens is saved twice, each time into a store of its
own holding only the plan's format (``save="plan"``), on the disk and in the Redis tier alike: once
lossless, once in ``--stored-dtype``.
Each restore starts cold: nothing in the host pool (``drop_resident``), so every chunk is read again, from
the disk with one O_DIRECT request per chunk, or with one GET per chunk from Redis (a server of its own on
loopback, or ``--redis``). Restores of the two encodings alternate over the repeats so that drift in the
machine hits both alike; the figure is the median restore time, and ``ratio`` is 8-bit over lossless.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from ..model.loader import DEFAULT_MODEL, load_model, model_dtype
from ..planning.plan import Method, RestorePlan
from ..serving.runtime import HCacheRuntime
from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from ..storage.redis_server import RedisServer
from .restore import timed_restore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", default=None, help="float32 (default on a CPU), bfloat16 or float16 (default on a GPU)"
    )
    parser.add_argument("--history", type=int, default=4096, help="history tokens restored")
    parser.add_argument(
        "--stored-dtype",
        default="8bit",
        help="the 8-bit encoding compared with lossless (default 8bit: fp8 H, int8 KV)",
    )
    parser.add_argument("--plans", default="KV,H")
    parser.add_argument("--tiers", default="disk,redis", help="disk, redis or both")
    parser.add_argument("--redis", default=None, help="a Redis server's URL (default: start one on loopback)")
    parser.add_argument("--dir", default=None, help="directory for the disk stores (default: a temporary one)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: torch's own)")


def run(args: argparse.Namespace) -> dict:
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    loaded = load_model(args.model, dtype=model_dtype(args.dtype, args.device), device=args.device)
    spec = loaded.spec
    n = args.history // CHUNK_TOKENS * CHUNK_TOKENS
    prompt = torch.randint(0, spec.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    encodings = {"lossless": "auto", "8bit": args.stored_dtype}
    tiers = args.tiers.split(",")
    result = {
        "model": loaded.name,
        "dtype": spec.dtype,
        "history": n,
        "stored_dtype": args.stored_dtype,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "tiers": {tier: {} for tier in tiers},
    }
    server = RedisServer().start() if "redis" in tiers and args.redis is None else None
    url = server.url if server else args.redis
    try:
        with tempfile.TemporaryDirectory(prefix="hcache-bench-cold-", dir=args.dir) as root:
            for plan_name in args.plans.split(","):
                plan = RestorePlan.uniform(spec.num_layers, Method(plan_name))
                stores = {name: _where(root, f"{plan_name}-{name}", tiers, url) for name in encodings}
                for name, stored_dtype in encodings.items():  # saved once, to the disk and the Redis tier alike
                    with HCacheRuntime(
                        loaded,
                        **stores[name],
                        device=args.device,
                        plan=plan,
                        stored_dtype=stored_dtype,
                        num_blocks=2 * n // CHUNK_TOKENS + 4,
                    ) as rt:
                        rt.generate(prompt, 1, restore=False)
                for tier in tiers:
                    readers = {name: _where(root, f"{plan_name}-{name}", [tier], url) for name in encodings}
                    result["tiers"][tier][plan_name] = _compare(
                        loaded, prompt, plan, encodings, readers, f"{tier} {plan_name}", args.repeats, args.device
                    )
    finally:
        if server:
            server.close()
    _print(result)
    return result


def _where(root: str, name: str, tiers: list[str], url: str | None) -> dict:
    """A runtime's store settings: the disk directory and the Redis tier of ``tiers``, in one namespace."""
    return {
        "store_dir": Path(root) / name if "disk" in tiers else None,
        "store": {"shared": [url] if "redis" in tiers else []},
        "namespace": name,
    }


def _compare(
    loaded, prompt: list[int], plan: RestorePlan, encodings: dict, stores: dict, label: str, repeats: int, device: str
) -> dict:
    n = len(prompt) - 1
    seconds: dict[str, list[float]] = {name: [] for name in encodings}
    read: dict[str, int] = {}
    runtimes = {}
    try:
        for name, stored_dtype in encodings.items():
            runtimes[name] = HCacheRuntime(
                loaded,
                **stores[name],
                device=device,
                plan=plan,
                stored_dtype=stored_dtype,
                num_blocks=2 * n // CHUNK_TOKENS + 4,
            )
        for _ in tqdm(range(repeats + 1), desc=label, leave=False):  # the first round warms up
            for name, rt in runtimes.items():
                elapsed, read[name] = _cold_restore(rt, prompt, n)
                seconds[name].append(elapsed)
    finally:
        for rt in runtimes.values():
            rt.close()
    median = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    return {
        "seconds": median,
        "all_seconds": {name: s[1:] for name, s in seconds.items()},
        "bytes_read": read,
        "ratio": median["8bit"] / median["lossless"],
        "bytes_ratio": read["8bit"] / read["lossless"],
    }


def _cold_restore(rt: HCacheRuntime, prompt: list[int], n: int) -> tuple[float, int]:
    rt.store.drop_resident()  # nothing in the host pool: every chunk comes from the tier
    keys = chunk_keys(prompt[:-1], root_key(rt.fingerprint, rt.serving.namespace))
    return timed_restore(rt, prompt, keys, rt.plan, n)


def _print(result: dict) -> None:
    print(
        f"cold restore of {result['history']} tokens ({result['model']}, {result['dtype']}), median of {result['repeats']}"
    )
    print(f"{'tier':<7}{'plan':<5}{'lossless ms':>13}{'8-bit ms':>10}{'time ratio':>12}{'bytes ratio':>13}")
    for tier, plans in result["tiers"].items():
        for plan, r in plans.items():
            print(
                f"{tier:<7}{plan:<5}{r['seconds']['lossless'] * 1e3:>13.1f}{r['seconds']['8bit'] * 1e3:>10.1f}{r['ratio']:>12.3f}{r['bytes_ratio']:>13.3f}"
            )
