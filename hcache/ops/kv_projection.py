"""K/V-only projection: rebuild a layer's K and V from its saved (normalised) input.

Only the K and V rows of the QKV weight are multiplied, so no Q is computed. The rows are gathered once
into one ``[2·kv_dim, D]`` matrix per layer (a view when the model fuses QKV with K and V adjacent), so a
restore is a single GEMM per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.spec import ModelSpec, WeightRows


def linear_rows(module: nn.Linear, rows: WeightRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = module.weight[rows.start : rows.stop]
    bias = module.bias[rows.start : rows.stop] if module.bias is not None else None
    return weight, bias


class KVProjection:
    """The K/V rows ``[2·kv_dim, D]`` (K then V) of one layer's QKV projection, and their bias; ``k_norm``:
    the layer's own norm of each K head, before RoPE, where the family has one (Qwen3's ``k_norm``), so
    that K rebuilt from H is K as the forward made it."""

    def __init__(
        self, spec: ModelSpec, weight: torch.Tensor, bias: torch.Tensor | None, k_norm: nn.Module | None = None
    ):
        self.weight, self.bias, self.k_norm = weight, bias, k_norm
        self.kv_dim = spec.kv_dim
        self.head_shape = (spec.num_kv_heads, spec.head_size)

    @classmethod
    @torch.no_grad()
    def from_layer(cls, spec: ModelSpec, layer: nn.Module) -> "KVProjection":
        """From a HF decoder layer's modules."""
        k_mod = layer.get_submodule(spec.k_weight.module)
        v_mod = layer.get_submodule(spec.v_weight.module)
        k_norm = layer.get_submodule(spec.qk_norm[1]) if spec.qk_norm else None
        if k_mod is v_mod and spec.k_weight.stop == spec.v_weight.start:  # fused QKV: a view, no copy
            return cls(spec, *linear_rows(k_mod, WeightRows("", spec.k_weight.start, spec.v_weight.stop)), k_norm)
        (wk, bk), (wv, bv) = linear_rows(k_mod, spec.k_weight), linear_rows(v_mod, spec.v_weight)
        return cls(spec, torch.cat((wk, wv)), None if bk is None else torch.cat((bk, bv)), k_norm)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[T, n_kv_heads, head_size]`` (K not yet rotated) from hidden ``[T, D]``: one GEMM into its
        own output (never a FastGen module's shared buffer, so no cap on ``T``)."""
        out = torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        k, v = out.split(self.kv_dim, dim=-1)
        k = k.reshape(-1, *self.head_shape)
        return k if self.k_norm is None else self.k_norm(k), v.reshape(-1, *self.head_shape)
