"""Restore speed against its bounds, on a GPU: the existing benchmarks, run at the sizes the targets name.

Each figure is a ratio measured side by side in one run (see each benchmark's docstring): KV restore over a
pinned copy of the same bytes, H over its bound, over KV and over recompute, at 1K, 4K and 16K tokens of a
Llama-2-7B-shaped model from the host pool; the vLLM connector's paged loader (KV over the same copy, H
over its bound, into a FlashAttention-layout cache) at the same sizes; the Triton RoPE-and-scatter kernel over the device copy peak;
the chunk store's disk read over raw O_DIRECT and the saver's decode overhead; and ``bench mii``'s TTFT at
2K and 4K. Absolute times mean something only on a GPU, so on a CPU this step is skipped.

Each benchmark runs as the command a user would type, ``hcache bench <name> ... --json``, in a process of
its own: the check depends on that command and its JSON, not on the benchmarks' code (nothing outside
``hcache.bench`` imports it), and one benchmark's failure or device memory does not reach the next.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

RECORD = ("benchmark", "command", "commit", "machine")  # what ``--json`` adds to a benchmark's figures


def measure_speed(quick: bool, progress, keep=lambda results: None) -> dict:
    """The benchmarks' figures by name. A benchmark that fails is recorded with its error and the next one
    runs (a first run on a new GPU should say all it can); ``keep(results)`` is told the figures so far
    after each, so a run cut off still leaves them."""
    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU: absolute restore times mean something only there"}
    histories = (1024, 4096, *(() if quick else (16384,)))
    runs = [("transfer", ["--history", str(n)], f"transfer_{n}") for n in histories]
    runs += [("paged", ["--history", str(n)], f"vllm_paged_{n}") for n in histories]  # vLLM's connector's core
    runs.append(("ops", ["--tokens", "4096", *(() if quick else ["16384"])], "ops"))
    if not quick:
        runs.append(("storage", ["--model", "random:llama-2-7b", "--chunks", "64"], "storage"))
        runs += [("mii", ["--history", str(n)], f"mii_{n}") for n in (2048, 4096)]
    results = {}
    for bench, argv, name in runs:
        progress(name)
        try:
            results[name] = _bench(bench, argv)
        except RuntimeError as exc:
            results[name] = {"error": str(exc)}
        keep(results)
    return results


def _bench(name: str, argv: list[str]) -> dict:
    """The figures of ``hcache bench <name> <argv>`` (the benchmark's own defaults for the rest), run in a
    child process whose output shows as it runs; the report's commit and machine are the check's own."""
    with tempfile.TemporaryDirectory(prefix="hcache-check-speed-") as tmp:
        out = Path(tmp) / f"{name}.json"
        done = subprocess.run([sys.executable, "-m", "hcache", "bench", name, *argv, "--json", str(out)])
        if done.returncode != 0:
            raise RuntimeError(
                f"hcache bench {name} {' '.join(argv)} exited with status {done.returncode} (its output is above)"
            )
        record = json.loads(out.read_text())
    return {key: value for key, value in record.items() if key not in RECORD}
