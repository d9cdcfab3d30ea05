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


def fast_math_angle_error(positions: torch.Tensor) -> torch.Tensor:
    """Bound (radians) on ``__cosf``/``__sinf``'s error at a token's largest angle (``inv_freq <= 1``, so
    ``angle <= position``): the argument is scaled to revolutions by an fp32 1/2π in round-toward-zero,
    relative error under 2^-22.6, so about ``position·2^-22``; plus the approximation's own ~2^-21.4."""
    return 2.0**-21.4 + positions.to(torch.float32) * 2.0**-22


def rope_bound(expected: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Per element of a rotated K ``[T, heads, head_size]`` at ``positions`` ``[T]``, how far the real kernel
    may be from a correct fp32 evaluation of its arithmetic, in units of the pair's magnitude
    ``p = sqrt(k_i² + k_partner²)`` (the rotation keeps it; one ulp of either element is at most ``eps·p``):

    - ``2·eps·p``: the final rounding to T can land one ulp either way, because the FMA and ``__powf``
      (a few fp32 ulps) move the fp32 value by ~2^-23 relative; one ulp of margin;
    - ``sqrt(2)·err·p``: cos and sin each off by ``err`` (:func:`fast_math_angle_error`) move
      ``k_i·cos ± k_partner·sin`` by at most that: 0.35 fp16 ulps below position 1,000, 2.8 at 8K.

    ``e``'s and ``powf``'s fp32 errors could also move ``trunc_freq`` to the neighbouring T value if its
    exact value lay within ~2^-19 relative of a rounding midpoint; the GPU run shows whether a model under
    test is that unlucky. Channels past ``rotary_dim`` are copied: bound 0.
    """
    x = expected.to(torch.float32)
    half = rotary_dim // 2
    lo, hi = x[..., :half], x[..., half:rotary_dim]
    pair = (lo * lo + hi * hi).sqrt()
    eps = torch.finfo(expected.dtype).eps  # one ulp at 1.0: 2^-10 in fp16, 2^-7 in bf16
    per_pair = (2 * eps + 2**0.5 * fast_math_angle_error(positions))[:, None, None] * pair
    bound = torch.zeros_like(x)
    bound[..., :half] = bound[..., half:rotary_dim] = per_pair
    return bound


def assert_within_rope_bound(actual: torch.Tensor, expected: torch.Tensor, positions: torch.Tensor, rotary_dim: int) -> None:
    """``actual`` K ``[T, heads, head_size]`` is FastGen's ``expected`` up to :func:`rope_bound`."""
    diff = (actual.to(torch.float32) - expected.to(torch.float32)).abs()
    excess = diff - rope_bound(expected, positions, rotary_dim)
    worst = int(excess.flatten().argmax())
    assert (excess <= 0).all(), (
        f"{int((excess > 0).sum())} of {excess.numel()} elements past the bound; worst at flat index {worst}: "
        f"{float(actual.flatten()[worst])} vs {float(expected.flatten()[worst])}"
    )
