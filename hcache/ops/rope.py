"""Rotary position embedding (half-split Llama/NeoX layout, optional partial rotary).

The one RoPE implementation in hcache: the reference engine's forward and the hidden-state restore both
call it, so a restored K is rotated exactly as the forward rotated it.
"""
from __future__ import annotations

import torch

from ..model_spec import RopeSpec


def rope_cos_sin(rope: RopeSpec, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``[T, rotary_dim]`` for absolute ``positions`` ``[T]``, computed in float32."""
    inv_freq = torch.tensor(rope.inv_freq, dtype=torch.float32, device=positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope.attention_scaling).to(dtype), (emb.sin() * rope.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_size]``; channels past ``rotary_dim`` pass through unchanged."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
