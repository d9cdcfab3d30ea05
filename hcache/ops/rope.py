"""Rotary position embedding (half-split Llama/NeoX layout, optional partial rotary).

The one RoPE implementation in hcache. An engine's K must be rotated as that engine's own forward rotates
it, and the two engines round differently, so there is one rule per engine (:data:`RopeRule`), chosen by
the engine and carried by the cos/sin tables:

- ``"hf"`` (the reference engine, as transformers): fp32 ``inv_freq`` × position, cos/sin rounded to the
  model dtype, then ``x·cos + rotate_half(x)·sin`` with each product and sum rounded to that dtype;
- ``"fastgen"`` (DeepSpeed-FastGen's ``linear_blocked_kv_rotary``, ``blocked_kv_rotary_cuda.cu`` lines
  116-147 in deepspeed 0.19): ``inv_freq = 1.0 / powf(theta, (2i)/rotary_dim)`` rounded to the *model
  dtype* (fp16/bf16), widened back to fp32 and × position in fp32; cos/sin in fp32; the rotation in fp32,
  rounded once to the model dtype. In fp16 the rounded ``inv_freq`` is off by up to 2^-12 relative, an
  angle error that grows with position (0.1 in K at 700 tokens against the "hf" rule).

:func:`apply_rope` and the Triton kernel follow the tables: tables in K's dtype round per operation
("hf"), fp32 tables round once ("fastgen").
"""

from __future__ import annotations

from typing import Literal

import torch

from ..model.spec import ModelSpec, RopeSpec

RopeRule = Literal["hf", "fastgen"]


def rope_cos_sin(
    rope: RopeSpec, positions: torch.Tensor, dtype: torch.dtype, rule: RopeRule = "hf"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``[T, rotary_dim]`` for absolute ``positions`` ``[T]`` of a model in ``dtype``:
    in ``dtype`` under the "hf" rule, in float32 under the "fastgen" rule."""
    if rule == "hf":
        inv_freq = torch.tensor(rope.inv_freq, dtype=torch.float32, device=positions.device)
        out_dtype = dtype
    elif rule == "fastgen":
        if rope.rope_type != "default":
            raise ValueError(f"FastGen synthesises unscaled frequencies; rope_type {rope.rope_type!r} has none")
        inv_freq = fastgen_inv_freq(rope.theta, rope.rotary_dim, dtype).to(positions.device)
        out_dtype = torch.float32
    else:
        raise ValueError(f"unknown RoPE rule {rule!r}; expected 'hf' or 'fastgen'")
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope.attention_scaling).to(out_dtype), (emb.sin() * rope.attention_scaling).to(out_dtype)


Tables = tuple[torch.Tensor, torch.Tensor]


def layer_tables(
    spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype, rule: RopeRule = "hf"
) -> list[Tables | None]:
    """Each layer's cos/sin of ``positions`` (None for a layer without RoPE), each distinct RoPE computed once:
    a family whose sliding and full layers rotate by two bases (Gemma 3) has two tables, others one."""
    tables: dict[RopeSpec, Tables] = {}
    for layer in range(spec.num_layers):
        rope = spec.rope_of(layer)
        if rope is not None and rope not in tables:
            tables[rope] = rope_cos_sin(rope, positions, dtype, rule)
    return [tables.get(spec.rope_of(layer)) for layer in range(spec.num_layers)]


def fastgen_inv_freq(theta: float, rotary_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """FastGen's ``inv_freq`` ``[rotary_dim // 2]`` as float32: ``to<T>(1.0 / powf(theta_base, e))`` with
    ``e = (float)(2i) / (float)rotary_dim``, the reciprocal in double (``1.0`` is a double literal) and
    rounded straight from double to ``T`` (``__double2half`` / ``__double2bfloat16``)."""
    e = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / torch.tensor(float(rotary_dim), dtype=torch.float32)
    inv = 1.0 / torch.pow(torch.tensor(theta, dtype=torch.float32), e).to(torch.float64)
    return _round_from_double(inv, dtype).to(torch.float32)


def _round_from_double(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 → ``dtype``, rounded once to nearest even, as CUDA's double→half conversions do.

    torch converts through float32, which can round twice; rounding to float32 *to odd* first keeps the
    second rounding exact (float32 has more than two bits beyond fp16's and bf16's significands)."""
    if dtype in (torch.float32, torch.float64):
        return x.to(dtype)
    f = x.to(torch.float32)
    toward_zero = torch.where(f.abs().to(torch.float64) > x.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    inexact = toward_zero.to(torch.float64) != x
    odd = (toward_zero.view(torch.int32) | inexact.to(torch.int32)).view(torch.float32)
    return odd.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_size]``; channels past ``rotary_dim`` pass through unchanged.

    Computed in the wider of ``x``'s and the tables' dtypes and rounded to ``x``'s: per operation with
    tables in ``x``'s dtype, once with float32 tables (see the module's rules)."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = (x_rot * cos + rotated * sin).to(x.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
