"""Sliding-window layers by Jenga's window rule against storing every token: bytes stored and returning TTFT.

In hcache's own engine: what sliding-window layers store, and a returning conversation's TTFT, with the
rule (``sliding_layers="window"``) against storing and restoring every token (``"all"``), side by side in
one run, at histories several windows long.

The model is a random-weight ``--family`` (Qwen2, Qwen3, Gemma 2 or Gemma 3: families whose ``layer_types``
transformers windows per layer) of ``--layers`` layers, every ``--full-every``-th one full attention and the
rest windowed by ``--window`` tokens: 2 is Gemma 2's layout, 6 Gemma 3's. For each history (``--multiples`` of the window), each rule saves the history
once (a first turn, prefilled) into a store of its own, then the history returns with a new question
``--repeats`` times, the rules in turn. ``stored_bytes_per_token``: the bytes of the chunk files the first turn
wrote, headers included, over the history's tokens; ``read_bytes_per_token``: what a returning turn read, over the tokens it restored, by layer type;
``ttft_s``: the returning turn's time to its first token, and ``restore_s`` its restore's alone (looking up,
reading, writing the cache), medians. ``recompute``: the same engine and store
settings prefilling the whole prompt (``restore=False``), the like-for-like baseline.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from ..model.loader import LoadedModel
from ..model.random_weights import random_model
from ..model.spec import ModelSpec
from ..serving.runtime import HCacheRuntime

RULES = ("window", "all")


FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3_text")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=FAMILIES, default="qwen2", help="the model's family (random weights)")
    parser.add_argument("--window", type=int, default=256, help="the sliding layers' window, in tokens")
    parser.add_argument(
        "--full-every", type=int, default=2, help="every N-th layer is full attention (2: Gemma 2, 6: Gemma 3)"
    )
    parser.add_argument("--multiples", default="2,4,8", help="history lengths, in windows")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument(
        "--hidden", type=int, default=576, help="hidden size (SmolLM2's by default: 9 heads of 64, 3 KV heads)"
    )
    parser.add_argument("--question", type=int, default=16, help="tokens in each returning question")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")


def _model(args) -> LoadedModel:
    kinds = ["full_attention" if (i + 1) % args.full_every == 0 else "sliding_attention" for i in range(args.layers)]
    heads = args.hidden // 64
    model = random_model(
        args.family,
        getattr(torch, args.dtype),
        head_dim=64,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        num_hidden_layers=args.layers,
        vocab_size=4096,
        max_position_embeddings=max(args.multiples) * args.window + 4 * args.question,
        sliding_window=args.window,
        layer_types=kinds,
        **({"use_sliding_window": True} if args.family.startswith("qwen") else {}),
    )
    spec = ModelSpec.from_config(model.config, getattr(torch, args.dtype))
    return LoadedModel(f"random:{args.family}-windowed", model, spec, None)


def _stored_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.glob("chunks/*/*.safetensors"))


def run(args: argparse.Namespace) -> dict:
    args.multiples = [int(m) for m in args.multiples.split(",") if m.strip()]
    if (
        args.window < 64
        or args.full_every < 1
        or not args.multiples
        or min(args.multiples) < 1
        or args.repeats < 1
        or args.hidden < 64
        or args.hidden % 64
    ):
        raise SystemExit(
            "hcache bench window: --window must be at least 64, --hidden a multiple of 64 (heads of 64), "
            "--full-every, --multiples and --repeats at least 1"
        )
    loaded = _model(args)
    g = torch.Generator().manual_seed(0)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hcache-bench-window-") as tmp:
        runtimes = {
            rule: HCacheRuntime(loaded, Path(tmp) / rule, plan="KV", sliding_layers=rule, self_check="off")
            for rule in RULES
        }
        try:
            for multiple in tqdm(args.multiples, desc="histories", unit="history"):
                history = torch.randint(0, 4096, (multiple * args.window,), generator=g).tolist()
                questions = [
                    torch.randint(0, 4096, (args.question,), generator=g).tolist() for _ in range(args.repeats)
                ]
                row: dict[str, dict] = {}
                for rule, runtime in runtimes.items():
                    before = _stored_bytes(Path(tmp) / rule)  # the earlier histories'
                    runtime.generate(history + questions[0][:1], 1, restore=False)  # the first turn saves the history
                    runtime.store.flush()
                    stored = _stored_bytes(Path(tmp) / rule) - before
                    row[rule] = {
                        "stored_bytes_per_token": stored / len(history),
                        "ttft_s": [],
                        "restore_s": [],
                        "recompute_s": [],
                    }
                for question in questions:  # the rules in turn, so that the machine's drift hits both alike
                    for rule, runtime in runtimes.items():
                        result = runtime.generate(history + question, 1)
                        row[rule]["ttft_s"].append(result.ttft_s)
                        row[rule]["restore_s"].append(result.restore_s)
                        row[rule]["read_bytes_per_token"] = {
                            kind: n / max(1, result.restored_tokens) for kind, n in result.type_bytes.items()
                        }
                        row[rule]["restored_tokens"] = result.restored_tokens
                        row[rule]["recompute_s"].append(runtime.generate(history + question, 1, restore=False).ttft_s)
                for r in row.values():
                    r["median_ttft_s"], r["median_recompute_s"] = (
                        statistics.median(r["ttft_s"]),
                        statistics.median(r["recompute_s"]),
                    )
                    r["median_restore_s"] = statistics.median(r["restore_s"])
                    r["speedup_vs_recompute"] = r["median_recompute_s"] / r["median_ttft_s"]
                row["window_over_all"] = {
                    "stored_bytes": row["window"]["stored_bytes_per_token"] / row["all"]["stored_bytes_per_token"],
                    "ttft": row["window"]["median_ttft_s"] / row["all"]["median_ttft_s"],
                    "restore": row["window"]["median_restore_s"] / row["all"]["median_restore_s"],
                }
                results[str(len(history))] = row
        finally:
            for runtime in runtimes.values():
                runtime.close()
    print(
        f"random {args.family}, {args.layers} layers (1 in {args.full_every} full attention, the rest a {args.window}-token window), "
        f"hidden {args.hidden}, {args.dtype}, plan KV, {args.repeats} returning turns each:"
    )
    print(
        f"{'history':>8} {'rule':>7} {'stored B/token':>15} {'read B/token':>13} {'restore ms':>11} {'TTFT ms':>9} {'recompute ms':>13} {'speedup':>8}"
    )
    for history, row in results.items():
        for rule in RULES:
            r = row[rule]
            print(
                f"{history:>8} {rule:>7} {r['stored_bytes_per_token']:15.0f} {sum(r['read_bytes_per_token'].values()):13.0f} "
                f"{1000 * r['median_restore_s']:11.1f} {1000 * r['median_ttft_s']:9.1f} {1000 * r['median_recompute_s']:13.1f} {r['speedup_vs_recompute']:7.2f}x"
            )
        ratio = row["window_over_all"]
        print(
            f"{history:>8} window/all: stored bytes {ratio['stored_bytes']:.2f}x, restore {ratio['restore']:.2f}x, TTFT {ratio['ttft']:.2f}x"
        )
    return {
        "family": args.family,
        "model": loaded.spec.describe(),
        "window": args.window,
        "full_every": args.full_every,
        "layers": args.layers,
        "dtype": args.dtype,
        "question": args.question,
        "repeats": args.repeats,
        "histories": results,
    }
