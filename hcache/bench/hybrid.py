"""A hybrid's recurrent state by the checkpoint rule, beside an attention-only model: bytes a token by layer type,
restore and TTFT against recompute.

In hcache's own engine, two random-weight models of one attention shape: ``--dense`` (Qwen3: attention in every
layer) and ``--hybrid`` (Qwen3-Next: three gated delta nets to one attention layer, its nets' widths in the
80B model's proportions to the hidden size; or Granite 4). For each history and each ``--state-every`` (the
hybrid's; the dense model keeps no state), the history is saved once by ``--plan`` (a first turn, prefilled)
into a store of its own, then returns with a new question ``--repeats`` times. ``stored_bytes_per_token``: the
tensors the history's chunks hold, by layer type, over its tokens; ``read_bytes_per_token``: what a returning
turn read, by layer type, over the tokens it restored; ``restore_s``, ``ttft_s`` and ``recompute_s`` (the same
prompt prefilled whole, ``restore=False``): medians. ``load_average``: the machine's, before and after (times
on a loaded machine are not comparable with another run's).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from ..model.loader import LoadedModel
from ..model.random_weights import HYBRID_LAYERS, QWEN3_NEXT_FOR_VLLM, hybrid_layer_types, random_model
from ..model.spec import ModelSpec
from ..serving.runtime import HCacheRuntime
from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dense", default="qwen3", choices=("qwen3",), help="the attention-only family")
    parser.add_argument("--hybrid", default="qwen3_next", choices=tuple(HYBRID_LAYERS), help="the hybrid family")
    parser.add_argument("--histories", default="512,1024", help="history lengths, in tokens")
    parser.add_argument("--state-every", default="1,4", help="the hybrid's state_every values to compare")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64, half as many KV heads)")
    parser.add_argument("--plan", default="KV", help="the restore plan (and the format saved)")
    parser.add_argument("--question", type=int, default=16, help="tokens in each returning question")
    parser.add_argument("--repeats", type=int, default=3)


def _model(family: str, args) -> LoadedModel:
    heads = args.hidden // 64
    fields = {
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
        "num_hidden_layers": args.layers,
        "vocab_size": 4096,
        "max_position_embeddings": max(args.histories) + 2 * args.question,
    }
    if family in HYBRID_LAYERS:
        fields["layer_types"] = hybrid_layer_types(family, args.layers)
    if family == "qwen3_next":  # the 80B model's: key heads of 128 as wide as the hidden size, twice the value heads
        fields.update(
            QWEN3_NEXT_FOR_VLLM, linear_num_key_heads=args.hidden // 128, linear_num_value_heads=args.hidden // 64
        )
    model = random_model(family, **fields)
    return LoadedModel(f"random:{family}", model, ModelSpec.from_config(model.config), None)


def _stored_by_type(runtime: HCacheRuntime, history: list[int]) -> Counter:
    """The bytes of the tensors the history's chunks hold, by layer type."""
    spec, stored = runtime.spec, Counter()
    for key in chunk_keys(history, root_key(runtime.fingerprint)):
        image = runtime.store.fetch(key).result()
        try:
            for (layer, _), entry in image.layout.entries.items():
                stored[spec.layer_type(layer)] += math.prod(entry.shape) * entry.dtype.itemsize
        finally:
            runtime.store.release(image)
    return stored


def _row(runtime: HCacheRuntime, history: list[int], questions: list[list[int]]) -> dict:
    runtime.generate(history + questions[0][:1], 1, restore=False)  # the first turn saves the history
    runtime.store.flush()
    stored = _stored_by_type(runtime, history)
    times: dict[str, list[float]] = {"ttft_s": [], "restore_s": [], "recompute_s": []}
    for question in questions:
        result = runtime.generate(history + question, 1)
        times["ttft_s"].append(result.ttft_s)
        times["restore_s"].append(result.restore_s)
        times["recompute_s"].append(runtime.generate(history + question, 1, restore=False).ttft_s)
    row = {
        "stored_bytes_per_token": {kind: n / len(history) for kind, n in sorted(stored.items())},
        "read_bytes_per_token": {kind: n / max(1, result.restored_tokens) for kind, n in result.type_bytes.items()},
        "restored_tokens": result.restored_tokens,
        **{f"median_{name}": statistics.median(values) for name, values in times.items()},
    }
    row["speedup_vs_recompute"] = row["median_recompute_s"] / row["median_ttft_s"]
    return row


def run(args: argparse.Namespace) -> dict:
    args.histories = [int(h) for h in args.histories.split(",") if h.strip()]
    every = [int(k) for k in args.state_every.split(",") if k.strip()]
    if not args.histories or not every or min(every) < 1 or args.hidden % 128 or args.repeats < 1:
        raise SystemExit("hcache bench hybrid: --hidden must be a multiple of 128, the rest at least 1")
    if any(h % (CHUNK_TOKENS * k) for h in args.histories for k in every):
        raise SystemExit("hcache bench hybrid: each history must end where every --state-every keeps a state")
    load_before = os.getloadavg()  # the machine may be shared: times are comparable only on an idle one
    g = torch.Generator().manual_seed(0)
    configs = [(args.dense, None)] + [(args.hybrid, k) for k in every]
    models = {family: _model(family, args) for family in (args.dense, args.hybrid)}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hcache-bench-hybrid-") as tmp:
        for n in tqdm(args.histories, desc="histories", unit="history"):
            history = torch.randint(0, 4096, (n,), generator=g).tolist()
            questions = [torch.randint(0, 4096, (args.question,), generator=g).tolist() for _ in range(args.repeats)]
            row = {}
            for family, k in configs:
                name = family if k is None else f"{family} state_every={k}"
                store = Path(tmp) / f"{n}-{name.replace(' ', '-')}"
                with HCacheRuntime(
                    models[family], store, save="plan", plan=args.plan, state_every=k or 1, self_check="off"
                ) as runtime:
                    row[name] = _row(runtime, history, questions)
            results[str(n)] = row
    print(
        f"hidden {args.hidden}, {args.layers} layers, float32, plan {args.plan}, {args.repeats} returning turns each:"
    )
    print(
        f"{'history':>8} {'model':>32} {'stored B/token by layer type':>44} "
        f"{'restore ms':>11} {'TTFT ms':>8} {'recompute ms':>13}"
    )
    for n, row in results.items():
        for name, r in row.items():
            stored = ", ".join(f"{kind} {b:.0f}" for kind, b in r["stored_bytes_per_token"].items())
            print(
                f"{n:>8} {name:>32} {stored:>44} {1000 * r['median_restore_s']:11.1f} {1000 * r['median_ttft_s']:8.1f} "
                f"{1000 * r['median_recompute_s']:13.1f}"
            )
    return {
        "dense": models[args.dense].spec.describe(),
        "hybrid": models[args.hybrid].spec.describe(),
        "plan": args.plan,
        "question": args.question,
        "repeats": args.repeats,
        "load_average": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
        "histories": results,
    }
