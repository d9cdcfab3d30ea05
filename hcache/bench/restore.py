"""Restore speed of RE, H, KV, the RE+KV hybrid and the auto plan, side by side, with the profile's bound.

For each history length, one stored history (every format on every layer) is restored into an empty
device cache by each distinct plan in turn, interleaved over the repeats so that drift in the machine's
speed hits every plan alike. The figure is restored tokens per second of the restore phase alone (lookup,
reads, compute), median over the repeats. ``auto_regret`` is the auto plan's time over the best fixed
plan's time, minus one, at the worst history length. The bound is what the profile predicts for the
best plan: ``max(compute, io)`` with perfect overlap.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..model.loader import DEFAULT_MODEL, load_model, model_dtype
from ..planning.plan import Method, RestorePlan
from ..planning.profile import Profile
from ..planning.profiler import measure_profile
from ..serving.restore import restore_prefix
from ..serving.runtime import HCacheRuntime
from ..storage.chunk_key import chunk_keys, root_key
from ..storage.host_tier import DEFAULT_READERS

FIXED = ("RE", "H", "KV", "RE+KV")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="e.g. random:llama-2-7b or random:llama-3-8b on a GPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: float16 on a GPU)")
    parser.add_argument("--histories", default="1024,2048,4096", help="history lengths in tokens (1K–16K on a GPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--readers", type=int, default=DEFAULT_READERS)
    parser.add_argument(
        "--profile", default=None, help="a profile to plan with (default: measure one now, over the histories)"
    )
    parser.add_argument(
        "--stored-dtype",
        default="auto",
        help="how the history is stored: auto (lossless), int8, fp8, 8bit or H=fp8,KV=int8",
    )
    parser.add_argument("--plot", default=None, help="write a plot here (default: next to --json, as .png)")


def run(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model, dtype=model_dtype(args.dtype, args.device), device=args.device)
    spec = loaded.spec
    histories = sorted({int(h) // 64 * 64 for h in args.histories.split(",")})
    if not histories or histories[0] < 64 or histories[-1] >= spec.max_positions:
        raise ValueError(f"histories must lie in [64, {spec.max_positions}), got {args.histories}")
    profile = (
        Profile.load(args.profile, spec) if args.profile else measure_profile(loaded, histories, readers=args.readers)
    )
    names = (*FIXED, "auto")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    plans: dict[str, list[str]] = {name: [] for name in names}
    gen = torch.Generator().manual_seed(0)
    with (
        tempfile.TemporaryDirectory(prefix="hcache-bench-") as store_dir,
        HCacheRuntime(
            loaded,
            store_dir,
            save="all",
            readers=args.readers,
            num_blocks=2 * histories[-1] // 64 + 4,
            stored_dtype=args.stored_dtype,
        ) as runtime,
    ):
        encodings = runtime.config.encodings
        for n in tqdm(histories, desc="histories"):
            prompt = torch.randint(0, spec.vocab_size, (n + 1,), generator=gen).tolist()
            runtime.generate(prompt, 1, restore=False)  # stores the n-token history in every format
            candidates = {
                "RE": RestorePlan.uniform(spec.num_layers, Method.RE),
                "H": RestorePlan.uniform(spec.num_layers, Method.H),
                "KV": RestorePlan.uniform(spec.num_layers, Method.KV),
                "RE+KV": profile.plan(spec, n, encodings, allow_h=False),
                "auto": profile.plan(spec, n, encodings),
            }
            keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
            # Each distinct plan is timed once per round: when auto picks a fixed plan it gets that plan's time,
            # so its regret measures the choice, not the noise between two runs of the same plan.
            times: dict[RestorePlan, list[float]] = {plan: [] for plan in candidates.values()}
            for _ in range(args.repeats + 1):  # the first round warms up
                for plan, record in times.items():
                    record.append(timed_restore(runtime, prompt, keys, plan, n)[0])
            for name, plan in candidates.items():
                seconds[name].append(statistics.median(times[plan][1:]))
                plans[name].append(str(plan))
    best = [min(seconds[name][i] for name in FIXED) for i in range(len(histories))]
    regret = [seconds["auto"][i] / best[i] - 1 for i in range(len(histories))]
    bound = [n / profile.bound_seconds(spec, n, encodings) for n in histories]
    result = {
        "model": loaded.name,
        "stored_dtype": args.stored_dtype,
        "histories": histories,
        "methods": {
            name: {"tokens_per_s": [n / s for n, s in zip(histories, seconds[name])], "plans": plans[name]}
            for name in names
        },
        "bound_tokens_per_s": bound,
        "profile": {"tokens": profile.tokens, "seconds_per_layer": profile.seconds},
        "auto_regret": max(regret),
        "auto_regret_by_history": regret,
    }
    _print(result)
    plot = args.plot or (str(Path(args.json_path).with_suffix(".png")) if args.json_path else None)
    if plot:
        _plot(result, plot)
    return result


def timed_restore(
    runtime: HCacheRuntime, prompt: list[int], keys: list[str], plan: RestorePlan, n: int
) -> tuple[float, int]:
    """One restore of ``n`` stored tokens into an empty engine: its seconds (device work included) and the
    bytes it read; refuses a restore that fell short, which would time less work."""
    engine = runtime.engine
    engine.flush_all()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    outcome = restore_prefix(engine, runtime.store, 0, prompt, keys, runtime.fingerprint, plan, runtime.stack.copier)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    elapsed = time.perf_counter() - start
    if outcome.tokens != n or outcome.fallback:
        raise RuntimeError(f"plan {plan} restored {outcome.tokens} of {n} tokens ({outcome.fallback})")
    engine.flush_all()
    return elapsed, outcome.bytes_read


def _print(result: dict) -> None:
    names = list(result["methods"])
    print(f"restore speed, tokens/s ({result['model']}); bound = profile's prediction for the best plan")
    print(f"{'history':>8} " + " ".join(f"{n:>10}" for n in names) + f" {'bound':>10} {'auto plan':>14} {'regret':>7}")
    for i, n in enumerate(result["histories"]):
        row = " ".join(f"{result['methods'][m]['tokens_per_s'][i]:>10.0f}" for m in names)
        auto_plan = result["methods"]["auto"]["plans"][i]
        print(
            f"{n:>8} {row} {result['bound_tokens_per_s'][i]:>10.0f} {auto_plan:>14} {result['auto_regret_by_history'][i]:>7.3f}"
        )
    h_over_kv = [h / k for h, k in zip(result["methods"]["H"]["tokens_per_s"], result["methods"]["KV"]["tokens_per_s"])]
    auto_over_re = [
        a / r for a, r in zip(result["methods"]["auto"]["tokens_per_s"], result["methods"]["RE"]["tokens_per_s"])
    ]
    print("H/KV " + " ".join(f"{x:.2f}" for x in h_over_kv) + "; auto/RE " + " ".join(f"{x:.2f}" for x in auto_over_re))
    print(f"auto_regret {result['auto_regret']:.3f}")


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in result["methods"].items():
        ax.plot(result["histories"], m["tokens_per_s"], marker="o", label=name)
    ax.plot(result["histories"], result["bound_tokens_per_s"], linestyle="--", color="gray", label="bound")
    ax.set(
        xscale="log", yscale="log", xlabel="history (tokens)", ylabel="restore speed (tokens/s)", title=result["model"]
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")
