"""TTFT of a returning conversation through DeepSpeed-MII: recompute, KV offload and hcache, side by side.

A random-weight model of a named shape (``random:llama-2-7b`` by default on a GPU) is saved with a
word-level tokenizer (``w0. w1. ...``: text round-trips to exactly the same token ids) and served by MII's
own ``pipeline``, once per method, each with a store of its own:
- ``mii``: plain ``mii.pipeline`` on FastGen, no hcache (GPU only);
- ``recompute``: hcache's engine with hcache off, which prefills the whole history;
- ``kv``, ``h`` (and ``auto`` with ``--profile``): hcache restoring the history by that plan.

Each method first prefills ``history + turn₀`` (one token: ``prefill_s``, with hcache saving the history,
without for ``mii`` and ``recompute``). Then, ``--repeats`` times after a warm-up, a new ``turn`` follows the
same history, and the time of ``pipe([prompt], max_new_tokens=1)`` is its TTFT (tokenising and MII's
scheduling included, alike for every method). Last, ``--repeats`` more returning turns are answered with
``--new-tokens`` greedy tokens each, compared with the first method's (``tokens_match``); their median
time past the median TTFT, per further token, is ``decode_s_per_token`` (saving on or off, as for
prefill): both medians, so one slow call does not make it negative.
``ttft_speedup`` is recompute's median TTFT over each method's; ``prefill_cost`` and ``decode_cost`` are
each method's prefill and decode times over recompute's: the cost of saving, where hcache saves.
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

from ..model.loader import model_dtype
from ..model.random_weights import save_random_model
from ..workload.servers import pipeline_on_free_port

METHODS = {"recompute": {"enabled": False}, "kv": {"plan": "KV"}, "h": {"plan": "H"}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    parser.add_argument("--model", default="random:llama-2-7b" if gpu else "random:llama", help="a random:<shape>")
    parser.add_argument(
        "--engine", default="auto", choices=["auto", "fastgen", "reference"], help="auto: FastGen on a GPU"
    )
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: float16 on a GPU)")
    parser.add_argument(
        "--history", type=int, default=4096 if gpu else 384, help="tokens of history the conversation returns with"
    )
    parser.add_argument("--turn", type=int, default=64, help="new tokens of each returning turn")
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared between methods")
    parser.add_argument("--repeats", type=int, default=3, help="timed returning turns per method, after one warm-up")
    parser.add_argument("--profile", default=None, help="also run hcache's auto plan with this profile")


def run(args: argparse.Namespace) -> dict:
    from ..config import HCacheConfig, engine_and_device

    engine = engine_and_device(HCacheConfig(engine=args.engine))[0]
    if not args.model.startswith("random:"):
        raise ValueError(f"--model must be a random:<shape>, not {args.model!r} (prompts are random words)")
    methods = {**({"mii": None} if engine == "fastgen" else {}), **METHODS}
    if args.profile:
        methods["auto"] = {"plan": "auto", "profile": args.profile}
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="hcache-bench-mii-") as tmp:
        model_dir = save_random_model(
            args.model, model_dtype(args.dtype, "cuda" if engine == "fastgen" else "cpu"), Path(tmp) / "model"
        )
        config = json.loads((model_dir / "config.json").read_text())
        vocab, context = config["vocab_size"], config["max_position_embeddings"]
        if args.history + args.turn + args.new_tokens > context:
            raise ValueError(f"history + turn + new tokens must fit {args.model}'s context of {context} tokens")

        def words(n: int) -> str:
            return " ".join(f"w{i}." for i in torch.randint(0, vocab, (n,), generator=gen).tolist())

        history, turns = words(args.history), [words(args.turn) for _ in range(2 * args.repeats + 2)]
        timed, answered_turns = turns[1 : args.repeats + 2], turns[args.repeats + 2 :]  # the first timed one warms up
        results, reference = {}, None
        for name, options in tqdm(methods.items(), desc="methods", unit="method"):
            log = Path(tmp) / f"{name}.jsonl"
            config = (
                None
                if options is None
                else {"engine": engine, "store_dirs": [f"{tmp}/{name}"], "request_log": str(log), **options}
            )
            pipe = pipeline_on_free_port(str(model_dir), config)
            try:
                prefill = _timed(lambda: pipe([f"{history} {turns[0]}"], max_new_tokens=1, do_sample=False))[1]
                ttft = [
                    _timed(lambda: pipe([f"{history} {turn}"], max_new_tokens=1, do_sample=False))[1] for turn in timed
                ]
                answers = [
                    _timed(lambda: pipe([f"{history} {turn}"], max_new_tokens=args.new_tokens, do_sample=False))
                    for turn in answered_turns
                ]
                tokens = [out[0].generated_text for out, _ in answers]
                reference = reference if reference is not None else tokens
            finally:
                if config is not None:
                    pipe.inference_engine.close()
                pipe.destroy()
            turns_logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            ttft_median = statistics.median(ttft[1:])  # the first returning turn warms up
            results[name] = {
                "ttft_s_median": ttft_median,
                "prefill_s": prefill,
                "decode_s_per_token": (statistics.median(t for _, t in answers) - ttft_median)
                / max(args.new_tokens - 1, 1),
                "tokens_match": tokens == reference,
                "restored_tokens": turns_logged[-1]["restored_tokens"] if turns_logged else 0,
            }
    base = results["recompute"]
    for r in results.values():
        r["ttft_speedup"] = base["ttft_s_median"] / r["ttft_s_median"]
        r["prefill_cost"] = r["prefill_s"] / base["prefill_s"]
        r["decode_cost"] = r["decode_s_per_token"] / base["decode_s_per_token"]
    print(f"{args.model} on {engine}, history {args.history} + turn {args.turn} tokens, median of {args.repeats}")
    print(f"{'method':<10}{'TTFT s':>10}{'speedup':>9}{'restored':>10}{'prefill':>9}{'decode':>8}  tokens match")
    for name, r in results.items():
        print(
            f"{name:<10}{r['ttft_s_median']:>10.3f}{r['ttft_speedup']:>8.2f}x{r['restored_tokens']:>10}"
            f"{r['prefill_cost']:>8.2f}x{r['decode_cost']:>7.2f}x  {r['tokens_match']}"
        )
    return {
        "model": args.model,
        "engine": engine,
        "history_tokens": args.history,
        "turn_tokens": args.turn,
        "methods": results,
    }


def _timed(fn):
    """``fn()``'s result and its wall time in seconds."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start
