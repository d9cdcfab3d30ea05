"""How ``bench workload`` shows its result: a table on the terminal, a CSV of every method and rate, and a
plot of TTFT against the arrival rate."""

from __future__ import annotations

import csv
from pathlib import Path

METRICS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_mean_s",
    "tbt_p99_s",
    "throughput_tok_s",
    "restore_tokens_per_s",
    "bytes_per_token",
    "restore_share",
    "requests",
    "gpu_cache_hit_rate",
    "prefetch_hidden_s",
)


def print_table(result: dict) -> None:
    """Every method at every rate, then the headline ratios at the reference (lowest) rate."""
    t = result["trace"]
    print(
        f"workload {t['name']} on {result['model']}: {t['sessions']} sessions, {t['requests']} requests, "
        f"mean input {t['mean_input_tokens']:.0f}, output {t['mean_output_tokens']:.0f}, session {t['mean_session_tokens']:.0f} tokens"
    )
    print(
        f"{'method':>14} {'rate/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TBT mean':>9} {'TBT p99':>9} "
        f"{'tok/s':>7} {'restore tok/s':>13} {'B/token':>8} {'restoring':>9} {'GPU hits':>8}"
    )
    for name, m in result["methods"].items():
        for r in m["by_rate"]:
            print(
                f"{name:>14} {r['rate']:>7.2f} {r['ttft_p50_s']:>9.3f} {r['ttft_p99_s']:>9.3f} {_f(r['tbt_mean_s'], 9, 4)} "
                f"{_f(r['tbt_p99_s'], 9, 4)} {r['throughput_tok_s']:>7.1f} {_f(r['restore_tokens_per_s'], 13, 0)} "
                f"{r['bytes_per_token']:>8.0f} {r['restore_share']:>9.1%} {_f(r['gpu_cache_hit_rate'], 8, 3)}"
            )
    ref = result["methods"]
    if "recompute" in ref:
        ratios = ", ".join(
            f"{n} {ref['recompute']['ttft_p50_s'] / m['ttft_p50_s']:.2f}" for n, m in ref.items() if n != "recompute"
        )
        print(f"TTFT p50 speedup over recompute at {result['reference_rate']}/s: {ratios}")
    if "auto" in ref and "auto_gpu_cache" in ref:
        print(
            f"auto + GPU cache TTFT p50 at {result['reference_rate']}/s: "
            f"{ref['auto_gpu_cache']['ttft_p50_s'] / ref['auto']['ttft_p50_s']:.2f}x auto alone's"
        )


def print_eviction(result: dict) -> None:
    """Each method's replays under each eviction policy side by side, at every rate: TTFT, the tokens
    restored from each tier, and cost's TTFT over LRU's."""
    policies, runs = result["eviction"], result["methods"]
    tiers = sorted({tier for m in runs.values() for r in m["by_rate"] for tier in r["tier_tokens"]})
    print(f"eviction: {' vs '.join(policies)} (tokens restored by tier: {', '.join(tiers)})")
    for method in dict.fromkeys(name.rsplit(":", 1)[0] for name in runs):
        for i, rate in enumerate(result["rates"]):
            by = {p: runs[f"{method}:{p}"]["by_rate"][i] for p in policies}
            for p, r in by.items():
                tokens = " ".join(f"{r['tier_tokens'].get(t, 0):>7}" for t in tiers)
                print(
                    f"{method:>14} {rate:>6.2f}/s {p:>4}: TTFT p50 {r['ttft_p50_s']:.3f} s, p99 {r['ttft_p99_s']:.3f} s; tokens {tokens}"
                )
            if {"cost", "lru"} <= by.keys():
                cost, lru = by["cost"], by["lru"]
                print(
                    f"{'':>14} cost/lru: TTFT p50 {cost['ttft_p50_s'] / lru['ttft_p50_s']:.2f}x, p99 {cost['ttft_p99_s'] / lru['ttft_p99_s']:.2f}x"
                )


def _f(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def write_csv(result: dict, path: str) -> None:
    """One row per method and rate."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "rate", *METRICS])
        for name, m in result["methods"].items():
            for r in m["by_rate"]:
                writer.writerow([name, r["rate"], *(r[k] for k in METRICS)])
    print(f"wrote {path}")


def plot(result: dict, path: str) -> None:
    """TTFT p50 and p99 against the session arrival rate, one colour per method (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in result["methods"].items():
        rates = [r["rate"] for r in m["by_rate"]]
        (line,) = ax.plot(rates, [r["ttft_p50_s"] for r in m["by_rate"]], marker="o", label=f"{name} p50")
        ax.plot(
            rates,
            [r["ttft_p99_s"] for r in m["by_rate"]],
            marker="x",
            linestyle="--",
            color=line.get_color(),
            label=f"{name} p99",
        )
    t = result["trace"]
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="session arrival rate (per s)",
        ylabel="TTFT (s)",
        title=f"{t['name']} (scaled ×{t['scale']}) on {result['model']}",
    )
    ax.set_xticks(result["rates"], [f"{r:g}" for r in result["rates"]])
    ax.minorticks_off()
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"wrote {path}")
