"""``hcache bench vllm --decode``: what hcache's connector costs a decode step in vLLM, measured step by
step, side by side in one run.

Three engines are started and kept: vLLM alone, vLLM with the connector saving (its default plan), and
with the connector not saving (``save="none"``), all with vLLM's prefix cache off. For each batch size in
``--batches`` and history in ``--histories``, round after round (``--repeats``), each engine in turn is
given that many requests of that many random tokens, ``max_tokens`` long; once every one has its first
token (its prefill is done), the next ``--steps`` calls of ``LLMEngine.step()`` are timed: each is one
decode step of the whole batch. ``overhead`` is an engine's median step over vLLM alone's at the same
batch and history.

``--loads`` returning conversations, saved by the saving engine before the round, then join its batch
mid-decode: while their loads run (vLLM holds them back, ``load_kv_async``), the engine keeps stepping the
decoders, and those steps (``decode_while_loading``) are compared with the same round's decode steps
without loads. A step in which a loaded request computes its question is not counted in either. Where the
loads were read from (host pool or disk) is taken from the request log: a small host pool
(``--host-mb``) sends the earlier conversations to the disk once the decoders' saves fill it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", default="1,16", help="running requests per decode step, comma-separated")
    parser.add_argument("--histories", default="1024,4096", help="tokens of each request's history, comma-separated")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each engine in turn")
    parser.add_argument("--loads", type=int, default=2, help="returning conversations loaded mid-decode by the saving engine (0: none)")
    parser.add_argument("--host-mb", type=int, default=256, help="the connector's host pool, in MiB")


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    from ..model.loader import model_dir
    from ..vllm.settings import kv_transfer_config

    batches = [int(b) for b in args.batches.split(",")]
    histories = [int(h) for h in args.histories.split(",")]
    if min(batches) < 1 or min(histories) < 64 or args.steps < 2 or args.repeats < 1:
        raise SystemExit("hcache bench vllm --decode: batches >= 1, histories >= 64, --steps >= 2, --repeats >= 1")
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(100, 40000, (n,), generator=g).tolist()  # noqa: E731
    max_len = max(histories) + args.steps + 64
    budget = (max(batches) + args.loads) * max_len
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
            engines[name] = LLM(model=str(model_dir(args.model)), dtype=args.dtype, enforce_eager=True, max_model_len=max_len,
                                kv_cache_memory_bytes=budget * _kv_bytes_per_token(args) * 2, enable_prefix_caching=False,
                                disable_log_stats=True, kv_transfer_config=kv_transfer_config(connector) if connector else None)  # fmt: skip
        try:
            cases = [(b, h) for b in batches for h in histories]
            for batch, history in tqdm(cases, desc="batch x history", unit="case"):
                steps = {name: [] for name in engines}
                loading, loaded_from = [], {}
                for _ in range(args.repeats):
                    for name, llm in engines.items():
                        returning = []
                        if name == "hcache_saving" and args.loads:  # saved now, loaded mid-decode below
                            returning = [tokens(history) for _ in range(args.loads)]
                            llm.generate([{"prompt_token_ids": r} for r in returning], SamplingParams(max_tokens=1), use_tqdm=False)
                            log.unlink(missing_ok=True)
                        decode, during = _round(llm, [tokens(history) for _ in range(batch)], returning, args.steps)
                        steps[name] += decode
                        loading += during
                        if returning:
                            for record in (json.loads(line) for line in log.read_text().splitlines()):
                                for tier, n in record["tier_tokens"].items():
                                    loaded_from[tier] = loaded_from.get(tier, 0) + n
                base = statistics.median(steps["vllm"])
                for name, times in steps.items():
                    results.setdefault(name, {})[f"{batch}x{history}"] = {
                        "step_s": times, "median_step_s": statistics.median(times), "overhead": statistics.median(times) / base - 1,
                    }  # fmt: skip
                if loading:
                    saving = results["hcache_saving"][f"{batch}x{history}"]
                    saving["decode_while_loading_s"] = loading
                    saving["median_decode_while_loading_s"] = statistics.median(loading)
                    saving["loading_vs_not"] = statistics.median(loading) / saving["median_step_s"] - 1
                    saving["loaded_tokens_by_tier"] = loaded_from
        finally:
            for llm in engines.values():
                llm.llm_engine.engine_core.shutdown()
    print(f"{args.model}, {args.dtype}: median decode step, {args.steps} steps x {args.repeats} rounds, engines interleaved")
    print(f"{'case':>10} {'engine':18} {'step ms':>8} {'vs vLLM':>8} {'while loading ms':>17} {'vs not':>7}  loaded from")
    for name, cases in results.items():
        for case, r in cases.items():
            during = r.get("median_decode_while_loading_s")
            extra = f"{1000 * during:17.1f} {100 * r['loading_vs_not']:+6.1f}%  {r['loaded_tokens_by_tier']}" if during is not None else ""
            print(f"{case:>10} {name:18} {1000 * r['median_step_s']:8.1f} {100 * r['overhead']:+7.1f}% {extra}")
    return {"model": args.model, "dtype": args.dtype, "steps": args.steps, "repeats": args.repeats, "loads": args.loads,
            "host_mb": args.host_mb, "decode": results}  # fmt: skip


def _kv_bytes_per_token(args) -> int:
    from ..model.loader import model_dir

    config = json.loads((model_dir(args.model) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    width = 4 if args.dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", config["num_attention_heads"]) * head * width


def _round(llm, prompts: list[list[int]], returning: list[list[int]], steps: int) -> tuple[list[float], list[float]]:
    """Step ``prompts`` to their first tokens, then time ``steps`` decode steps; with ``returning``, they are
    added after the first timed half, and the steps while they load are timed apart. Returns (decode steps
    without loads, decode steps while loading)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    decode = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0)
    ids = [f"d{time.monotonic_ns()}x{i}" for i in range(len(prompts))]  # vLLM may suffix "-..." to an id
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, decode)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {_base(out.request_id) for out in engine.step() if out.outputs and out.outputs[0].token_ids}
    plain, during, waiting = [], [], set()
    for i in range(steps):
        if returning and i == steps // 2:
            waiting = {f"r{time.monotonic_ns()}x{j}" for j in range(len(returning))}
            for rid, prompt in zip(sorted(waiting), returning):
                engine.add_request(rid, {"prompt_token_ids": prompt + [13] * 8}, SamplingParams(max_tokens=1))
        began = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - began
        joined = {_base(out.request_id) for out in outs} & waiting
        if not waiting:
            plain.append(took)
        elif not joined:
            during.append(took)
        waiting -= joined  # loaded and answered: the steps after are without loads again
    while engine.has_unfinished_requests():
        engine.step()
    return plain, during


def _base(request_id: str) -> str:
    return request_id.split("-")[0]
