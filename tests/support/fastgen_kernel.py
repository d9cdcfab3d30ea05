"""FastGen's ``kv_rotary_embeddings`` CUDA kernel, emulated in torch from its source, and the tolerance
between it and the real kernel.

Written from deepspeed 0.19's ``inference/v2/kernels/ragged_ops/linear_blocked_kv_rotary/
blocked_kv_rotary_cuda.cu``, the branch for K (``need_kv``, lines 111-147) with ``inv_freq == nullptr``, as
``BlockedRotaryEmbeddings`` calls it (``blocked_kv_rotary.cpp`` line 128). Per head channel ``i`` of a token
at ``global_token_idx``:

- line 120: ``e = (float)((i % half) * 2) / (float)rotary_dim``;
- line 125: ``trunc_freq = to<T>(1.0 / powf(theta_base, e))``: a double reciprocal rounded straight to T
  (``__double2half``/``__double2bfloat16``, ``conversion_utils.h``);
- line 126: ``angle = to<float>(trunc_freq) * (float)global_token_idx``;
- lines 129-140: the partner channel ``i ± half`` comes by warp shuffle, negated when it is the upper half;
- lines 145-146: ``k = to<T>(k_f * cosf(angle) + k_partner * sinf(angle))``: fp32, rounded once to T.

Written element by element as the kernel is, independently of :mod:`hcache.ops.rope`. It computes in IEEE
fp32 with torch's ``cos``/``sin``/``pow``; the real kernel is built with ``--use_fast_math`` (deepspeed's
``op_builder/builder.py``), so there ``cosf``/``sinf``/``powf`` are the hardware approximations ``__cosf``,
``__sinf``, ``__powf``, and nvcc contracts the last line into an FMA: :func:`rope_bound` is the
difference that allows.
"""

from __future__ import annotations

import torch

from hcache.ops.rope_bound import rope_bound


def _to_t(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 → ``dtype`` rounded once to nearest even, on the bits of the double (fp16 subnormals: on
    their fixed 2^-24 grid), as ``__double2half``/``__double2bfloat16`` round."""
    if dtype == torch.float32:
        return x.to(torch.float32)
    if dtype == torch.float16:
        subnormal = x.abs() < 2.0**-14
        on_grid = torch.round(x * 2.0**24) / 2.0**24  # torch.round: ties to even
    drop = {torch.float16: 52 - 10, torch.bfloat16: 52 - 7}[dtype]
    bits = x.view(torch.int64)
    bits = (bits + (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)) & ~((1 << drop) - 1)
    out = bits.view(torch.float64)
    if dtype == torch.float16:
        out = torch.where(subnormal, on_grid, out)
    return out.to(torch.float32).to(dtype)  # exact: already representable


def kv_rotary(k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta_base: float) -> torch.Tensor:
    """K ``[T, n_kv_heads, head_size]`` (dtype T) rotated as the kernel writes it to the cache."""
    head_size, dtype = k.shape[-1], k.dtype
    half = rotary_dim // 2
    i = torch.arange(head_size)
    e = ((i % half) * 2).to(torch.float32) / torch.tensor(float(rotary_dim), dtype=torch.float32)
    trunc_freq = _to_t(1.0 / torch.pow(torch.tensor(theta_base, dtype=torch.float32), e).double(), dtype)
    angle = trunc_freq.to(torch.float32)[None, :] * positions.to(torch.float32)[:, None]  # [T, head_size]
    k_f = k.to(torch.float32)
    sign = torch.where(i >= half, -1.0, 1.0)
    partner = torch.where(i < half, i + half, i - half).clamp(max=head_size - 1)
    k_partner = (k_f * sign)[..., partner]  # the partner lane's k_rot
    out = (k_f * torch.cos(angle)[:, None, :] + k_partner * torch.sin(angle)[:, None, :]).to(dtype)
    return torch.where(i < rotary_dim, out, k)  # line 142: channels past rotary_dim keep their input


def assert_within_rope_bound(
    actual: torch.Tensor, expected: torch.Tensor, positions: torch.Tensor, rotary_dim: int
) -> None:
    """``actual`` K ``[T, heads, head_size]`` is FastGen's ``expected`` up to :func:`rope_bound`."""
    diff = (actual.to(torch.float32) - expected.to(torch.float32)).abs()
    excess = diff - rope_bound(expected, positions, rotary_dim)
    worst = int(excess.flatten().argmax())
    assert (excess <= 0).all(), (
        f"{int((excess > 0).sum())} of {excess.numel()} elements past the bound; worst at flat index {worst}: "
        f"{float(actual.flatten()[worst])} vs {float(expected.flatten()[worst])}"
    )
