"""``hcache bench vllm --decode``: what hcache's connector costs a decode step in vLLM, measured in turns
of decode steps, side by side in one run.

Three engines are started and kept: vLLM alone, vLLM with the connector saving (its default plan), and
with the connector not saving (``save="none"``), all with vLLM's prefix cache off. For each batch size in
``--batches`` and history in ``--histories``, round after round (``--repeats``), every engine is given the
same requests of random tokens and steps them to their first tokens (their prefills, not timed). Then the
engines decode **in turns**: each in turn is resumed, takes ``--block`` decode steps, timed, and is paused
(vLLM's ``pause_scheduler``: vLLM's engine core runs in a process of its own and would otherwise go on
stepping, on the same core as the engine being timed), until each has timed ``--steps``. A step's time
drifts on a shared machine by more than the few percent in question, over seconds; turns a second apart
share that drift, so each engine's mean step in a turn is compared with vLLM alone's in the same round of
turns: ``overhead`` is the median of those paired ratios less one, with a 95% bootstrap interval
(``overhead_ci``). The order of the engines rotates from one round of turns to the next.

The requests' lengths are ``history`` plus offsets spread over a chunk (64 tokens), so the saving engine
fills and publishes chunks in some steps of every 64, as a batch of real conversations does: ``--steps``
of at least 64 time every request's chunk being saved.

``--loads`` returning conversations, saved by the saving engine before the round, join its batch at the
start of every other turn of its (the second, the fourth, ...), the same conversations each time (vLLM's
prefix cache is off, so each is loaded again): while their loads run (vLLM holds them back,
``load_kv_async``) the engine keeps stepping the decoders, and the ratios of those turns
(``loading_overhead``) are set beside the others' (``not_loading_overhead``, which the printout shows as
the saving engine's overhead; its ``overhead`` mixes both). A step's time drifts by a tenth from turn to turn here,
so one loading turn a round could not tell a few percent: half the turns load. The other engines are given
as many requests at the same turns, their question alone (9 tokens), which join and leave their batches as
the loaded ones leave the saving engine's: a loading turn then differs from theirs by the loads alone. A
step in which any of these requests computes is not counted. Where the loads were read from
(host pool or disk) is taken from the request log: a small host pool (``--host-mb``) sends the earlier
conversations to the disk once the decoders' saves fill it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

CHUNK = 64  # hcache's chunk: a request saves one each 64 tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,16", help="running requests per decode step, comma-separated")
    parser.add_argument("--histories", default="1024,4096", help="tokens of each request's history, comma-separated")
    parser.add_argument(
        "--steps",
        type=int,
        default=96,
        help="decode steps timed per round and engine (64 or more: every request saves a chunk)",
    )
    parser.add_argument("--block", type=int, default=8, help="decode steps an engine takes in its turn")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, each with new requests")
    parser.add_argument(
        "--loads", type=int, default=2, help="returning conversations loaded mid-decode by the saving engine (0: none)"
    )
    parser.add_argument("--host-mb", type=int, default=256, help="the connector's host pool, in MiB")


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from ..model.loader import model_dir
    from ..model.spec import ModelSpec
    from ..vllm.settings import kv_transfer_config

    batches = [int(b) for b in args.batches.split(",")]
    histories = [int(h) for h in args.histories.split(",")]
    if min(batches) < 1 or min(histories) < CHUNK or args.steps < 2 or args.repeats < 1 or args.block < 2:
        raise SystemExit(
            f"hcache bench vllm --decode: batches >= 1, histories >= {CHUNK}, --steps and --block >= 2, --repeats >= 1"
        )
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(100, 40000, (n,), generator=g).tolist()  # noqa: E731
    max_len = max(histories) + CHUNK + 2 * args.steps + 64
    budget = (max(batches) + args.loads) * max_len
    per_token = ModelSpec.from_config(AutoConfig.from_pretrained(model_dir(args.model)), args.dtype).kv_bytes_per_token
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hcache-bench-vllm-decode-") as tmp:
        log = Path(tmp) / "requests.jsonl"
        store = {"host_bytes": args.host_mb << 20}
        connectors = {
            "vllm": None,
            "hcache_saving": {"store_dirs": [str(Path(tmp) / "saving")], "store": store, "request_log": str(log)},
            "hcache_not_saving": {"store_dirs": [str(Path(tmp) / "idle")], "store": store, "save": "none"},
        }
        engines = {}
        for name, connector in tqdm(connectors.items(), desc="vLLM engines", unit="engine"):
            engines[name] = LLM(
                model=str(model_dir(args.model)),
                dtype=args.dtype,
                enforce_eager=True,
                max_model_len=max_len,
                kv_cache_memory_bytes=budget * per_token * 2,
                enable_prefix_caching=False,
                disable_log_stats=True,
                kv_transfer_config=kv_transfer_config(connector) if connector else None,
            )
        try:
            for batch, history in tqdm(
                [(b, h) for b in batches for h in histories], desc="batch x history", unit="case"
            ):
                steps: dict[str, list[float]] = {name: [] for name in engines}
                loading: list[bool] = []  # per round of turns: the saving engine's loads were in flight in its turn
                loaded_from: dict[str, int] = {}
                for _ in range(args.repeats):
                    returning = [tokens(history) for _ in range(args.loads)]
                    if returning:  # saved now by the saving engine, loaded by it mid-decode
                        engines["hcache_saving"].generate(
                            [{"prompt_token_ids": r} for r in returning], SamplingParams(max_tokens=1), use_tqdm=False
                        )
                        log.unlink(missing_ok=True)
                    prompts = [
                        tokens(history + i * CHUNK // batch) for i in range(batch)
                    ]  # chunk fills spread over the steps
                    timed, during = _interleaved(
                        {name: llm.llm_engine for name, llm in engines.items()},
                        prompts,
                        returning,
                        args.steps,
                        args.block,
                    )
                    for name, times in timed.items():
                        steps[name] += times
                    loading += during
                    if returning:
                        for record in (json.loads(line) for line in log.read_text().splitlines()):
                            for tier, n in record["tier_tokens"].items():
                                loaded_from[tier] = loaded_from.get(tier, 0) + n
                results[f"{batch}x{history}"] = _compare(steps, loading, loaded_from)
        finally:
            for llm in engines.values():
                llm.llm_engine.engine_core.shutdown()
    _print(results, args)
    return {
        "model": args.model,
        "dtype": args.dtype,
        "steps": args.steps,
        "repeats": args.repeats,
        "loads": args.loads,
        "host_mb": args.host_mb,
        "block": args.block,
        "decode": results,
    }


def _interleaved(
    engines: dict, prompts: list[list[int]], returning: list[list[int]], steps: int, block: int
) -> tuple[dict[str, list[float]], list[bool]]:
    """Every engine given ``prompts``, stepped to their first tokens and paused; then the engines take turns,
    ``block`` decode steps each, resumed for their turn and paused after it, until each has timed ``steps``.
    ``returning`` join the saving engine at every other turn, and their last token and question the others.
    Returns each engine's mean step of each turn, in the same order for every engine, and for each turn
    whether the saving engine's loads were in flight in it; a step in which a returning request computes its
    question is left out of its turn."""
    from vllm import SamplingParams

    turns = -(-steps // block)
    decode = SamplingParams(max_tokens=turns * (block + 2) + 8, ignore_eos=True, temperature=0)
    ids: dict[str, list[str]] = {}
    for name, engine in engines.items():
        ids[name] = [f"d{time.monotonic_ns()}x{i}" for i in range(len(prompts))]  # vLLM may suffix "-..." to an id
        for rid, prompt in zip(ids[name], prompts):
            engine.add_request(rid, {"prompt_token_ids": prompt}, decode)
        started: set[str] = set()
        while len(started) < len(prompts):
            started |= {_base(out.request_id) for out in engine.step() if out.outputs and out.outputs[0].token_ids}
        _pause(engine)
    names = list(engines)
    means: dict[str, list[float]] = {name: [] for name in names}
    during, waiting = [], {name: set() for name in names}
    for turn in range(turns):
        loads = False
        for name in names[turn % len(names) :] + names[: turn % len(names)]:  # each engine first, second and last alike
            engine = engines[name]
            engine.engine_core.call_utility("resume_scheduler")
            if returning and turn % 2 == 1 and not waiting[name]:
                waiting[name] = {f"r{time.monotonic_ns()}x{j}" for j in range(len(returning))}
                for rid, prompt in zip(sorted(waiting[name]), returning):
                    asked = prompt if name == "hcache_saving" else prompt[-1:]  # the others: the question alone
                    engine.add_request(rid, {"prompt_token_ids": asked + [13] * 8}, SamplingParams(max_tokens=1))
            outs = engine.step()  # the step in flight when it was paused, or its output: not a whole step of this turn
            waiting[name] -= {_base(out.request_id) for out in outs}  # a question alone may be answered in it
            took = []
            for _ in range(block):
                loads = loads or (name == "hcache_saving" and bool(waiting[name]))
                began = time.perf_counter()
                outs = engine.step()
                elapsed = time.perf_counter() - began
                joined = {_base(out.request_id) for out in outs} & waiting[name]
                if not joined:
                    took.append(elapsed)
                waiting[name] -= (
                    joined  # loaded (or, elsewhere, computed) and answered: the steps after are without loads again
                )
            means[name].append(statistics.fmean(took) if took else float("nan"))
            _pause(engine)
        during.append(loads)
    for name, engine in engines.items():
        engine.engine_core.call_utility("resume_scheduler")
        engine.abort_request(ids[name])
        while engine.has_unfinished_requests():
            engine.step()
    return means, during


def _pause(engine) -> None:
    """Stop ``engine`` stepping, its requests kept (vLLM's ``pause_scheduler("keep")``), so that it does not
    compute while another engine is timed: vLLM's engine core runs in a process of its own and steps on
    by itself while it has requests."""
    engine.engine_core.call_utility("pause_scheduler", "keep", False)


def _base(request_id: str) -> str:
    return request_id.split("-")[0]


def paired_overhead(steps: list[float], base: list[float], seed: int = 0) -> tuple[float, tuple[float, float]]:
    """The median of ``steps[i] / base[i]`` less one, and its 95% bootstrap interval (resampled in pairs)."""
    ratios = np.asarray(steps) / np.asarray(base)
    boot = np.random.default_rng(seed).choice(ratios, size=(2000, len(ratios))).astype(float)
    low, high = np.percentile(np.median(boot, axis=1), [2.5, 97.5])
    return float(np.median(ratios) - 1), (float(low - 1), float(high - 1))


def _compare(steps: dict[str, list[float]], loading: list[bool], loaded_from: dict[str, int]) -> dict:
    base = steps["vllm"]
    out = {}
    for name, times in steps.items():
        overhead, ci = paired_overhead(times, base)
        out[name] = {
            "turn_step_s": times,
            "median_step_s": statistics.median(times),
            "overhead": overhead,
            "overhead_ci": ci,
        }
    if any(loading):
        saving = out["hcache_saving"]
        pick = lambda flag, xs: [x for x, f in zip(xs, loading) if f == flag]  # noqa: E731
        saving["loading"] = loading
        saving["loading_overhead"], saving["loading_overhead_ci"] = paired_overhead(
            pick(True, steps["hcache_saving"]), pick(True, base)
        )
        saving["not_loading_overhead"], saving["not_loading_overhead_ci"] = paired_overhead(
            pick(False, steps["hcache_saving"]), pick(False, base)
        )
        saving["loaded_tokens_by_tier"] = loaded_from
    return out


def _print(results: dict, args: argparse.Namespace) -> None:
    print(
        f"{args.model}, {args.dtype}: {args.steps} decode steps x {args.repeats} rounds, engines in turns of {args.block} steps;"
        " overhead: the median of each turn's mean step over vLLM alone's in the same round of turns, less one (95% interval)"
    )
    print(
        f"{'case':>10} {'engine':18} {'step ms':>8} {'overhead':>22} {'while loading':>22}  loaded from"
        "   (the saving engine's overhead: its turns without loads)"
    )
    for case, engines in results.items():
        for name, r in engines.items():
            cell = lambda o, ci: f"{100 * o:+6.1f}% [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"  # noqa: E731
            overhead = cell(r["overhead"], r["overhead_ci"])
            extra = ""
            if "loading" in r:
                overhead = cell(r["not_loading_overhead"], r["not_loading_overhead_ci"])
                extra = f" {cell(r['loading_overhead'], r['loading_overhead_ci']):>22}  {r['loaded_tokens_by_tier']}"
            print(f"{case:>10} {name:18} {1000 * r['median_step_s']:8.1f} {overhead:>22}{extra}")
