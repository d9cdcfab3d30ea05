"""The families whose weights hcache knows: where each keeps its layers, its normalised layer input (what H
saves), its Q, K, V and O projections and its norms, and which layers transformers' forward windows. A
family is named here once; :class:`~hcache.model.spec.ModelSpec` reads a model's config against it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    layers: str
    capture: str  # the module whose output is the normalised layer input (what hcache saves)
    q: tuple[str, str]  # (module, which slice of a fused qkv: "", "q", "k" or "v")
    k: tuple[str, str]
    v: tuple[str, str]
    o: str
    positions: str  # "rope" or "learned"
    windows: str = (
        "none"  # which layers transformers' forward windows: "none", "uniform" (every layer) or "layer_types"
    )
    qk_norm: tuple[str, str] | None = None  # the RMS norms Q and K pass through, per head, before RoPE (Qwen3)
    # the norms of the attention's output, the MLP's input and its output (Gemma)
    sandwich: tuple[str, str, str] | None = None
    recurrent: str | None = (
        None  # transformers' layer type of the family's recurrent layers (Mamba-2 or gated delta net)
    )
    mixer: str = "mamba"  # the recurrent layer's module, transformers' own, which the engine runs on the kept state
    recurrent_kind: str = "mamba"  # hcache's name of the recurrent layers' type: "mamba" or "gated_delta_net"
    output_gate: bool = False  # Q's projection also yields a gate per head: attention's output · sigmoid(gate)
    # The MLP block takes [batch, tokens, hidden], not [tokens, hidden] (Qwen3-Next's sparse MoE): a fact of how
    # the reference engine calls it, not of what the model computes, so no part of ModelSpec's identity
    batched_mlp: bool = False


_SEPARATE_QKV = dict(q=("self_attn.q_proj", ""), k=("self_attn.k_proj", ""), v=("self_attn.v_proj", ""))
_LLAMA_LIKE = Family(
    layers="model.layers", capture="input_layernorm", o="self_attn.o_proj", positions="rope", **_SEPARATE_QKV
)
_QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
_SANDWICH = ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": dataclasses.replace(_LLAMA_LIKE, windows="uniform"),
    "qwen2": dataclasses.replace(_LLAMA_LIKE, windows="layer_types"),
    "qwen3": dataclasses.replace(_LLAMA_LIKE, windows="layer_types", qk_norm=_QK_NORM),
    "gemma2": dataclasses.replace(_LLAMA_LIKE, windows="layer_types", sandwich=_SANDWICH),
    "gemma3_text": dataclasses.replace(_LLAMA_LIKE, windows="layer_types", qk_norm=_QK_NORM, sandwich=_SANDWICH),
    "phi3": Family(
        layers="model.layers",
        capture="input_layernorm",
        q=("self_attn.qkv_proj", "q"),
        k=("self_attn.qkv_proj", "k"),
        v=("self_attn.qkv_proj", "v"),
        o="self_attn.o_proj",
        positions="rope",
        windows="uniform",
    ),
    "granitemoehybrid": dataclasses.replace(_LLAMA_LIKE, recurrent="linear_attention"),
    "qwen3_next": dataclasses.replace(
        _LLAMA_LIKE,
        qk_norm=_QK_NORM,
        recurrent="linear_attention",
        mixer="linear_attn",
        recurrent_kind="gated_delta_net",
        output_gate=True,
        batched_mlp=True,
    ),
    "opt": Family(
        layers="model.decoder.layers",
        capture="self_attn_layer_norm",
        q=("self_attn.q_proj", ""),
        k=("self_attn.k_proj", ""),
        v=("self_attn.v_proj", ""),
        o="self_attn.out_proj",
        positions="learned",
    ),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))
