"""The model ``hcache bench vllm`` serves: the checkpoint named, or one of random weights remade as another
family (``--family``) of its size, or reshaped (``--heads``, ``--mha``, ``--window``); and what its stored
chunks hold, by layer type."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ..model.random_weights import QWEN3_NEXT_FOR_VLLM, hybrid_layer_types

_SIZE = (  # what a model remade as another family (--family) keeps of its size
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


def family_fields(family: str, config: dict, head: int) -> dict:
    """A random ``family`` model's config fields, of the size of ``config`` (a checkpoint's), with heads of
    ``head``; a Qwen3-Next as vLLM's CPU build takes it, its layers in Qwen3-Next's pattern, its gated delta
    nets with a key head per K/V head of attention and twice the value heads, its experts' widths half the MLP's."""
    fields = {k: config[k] for k in _SIZE if k in config} | {"head_dim": head}
    if family == "qwen3_next":
        layers, kv, width = config["num_hidden_layers"], fields["num_key_value_heads"], config["intermediate_size"]
        fields.update(
            QWEN3_NEXT_FOR_VLLM,
            layer_types=hybrid_layer_types(family, layers),
            linear_num_key_heads=kv,
            linear_num_value_heads=2 * kv,
            moe_intermediate_size=width // 2,
            shared_expert_intermediate_size=width // 2,
        )
    return fields


def shaped(args, directory: Path) -> tuple[Path, dict]:
    """The model's checkpoint, or one of random weights remade by ``--family`` and reshaped by ``--heads``,
    ``--mha`` and ``--window``; its heads."""
    from ..model.loader import model_dir, save_checkpoint
    from ..model.random_weights import random_like, random_model

    model = model_dir(args.model)
    config = json.loads((model / "config.json").read_text())
    heads = {
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
    }
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    overrides = {}
    if args.heads:
        try:
            q, kv = (int(n) for n in args.heads.split(","))
        except ValueError:
            raise SystemExit(f"hcache bench vllm: --heads takes Q,KV, two numbers, not {args.heads!r}") from None
        overrides = {"num_attention_heads": q, "num_key_value_heads": kv, "hidden_size": q * head, "head_dim": head}
    if args.mha:
        overrides["num_key_value_heads"] = overrides.get("num_attention_heads", heads["num_attention_heads"])
    if args.window:
        layers = config["num_hidden_layers"]
        overrides.update(
            sliding_window=args.window,
            layer_types=[
                "full_attention" if (i + 1) % args.full_every == 0 else "sliding_attention" for i in range(layers)
            ],
        )
    heads.update({k: v for k, v in overrides.items() if k in heads})
    if heads["num_attention_heads"] % args.tp or (
        heads["num_key_value_heads"] % args.tp and args.tp % heads["num_key_value_heads"]
    ):
        raise SystemExit(
            f"hcache bench vllm: {args.model}'s {heads['num_attention_heads']} query and {heads['num_key_value_heads']} "
            f"key/value heads do not divide among --tp {args.tp} ranks: reshape it with --heads Q,KV"
        )
    if args.family:
        remade = random_model(args.family, **family_fields(args.family, config, head) | overrides)
    elif overrides:
        remade = random_like(model, **overrides)
    else:
        return model, heads
    return save_checkpoint(remade, directory, args.model), heads


def stored_bytes_by_type(files: list[Path], spec) -> Counter:
    """The bytes of the tensors that chunk ``files`` hold, by the type of their layer, as the store's own header
    reader lays them out."""
    from ..storage.chunk import read_header

    by_type: Counter = Counter()
    for path in files:
        with path.open("rb") as f:
            layout, _ = read_header(f, path.stem, path.stat().st_size)
        for (layer, _), entry in layout.entries.items():
            by_type[spec.layer_type(layer)] += entry.nbytes
    return by_type
