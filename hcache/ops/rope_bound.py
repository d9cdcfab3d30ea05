"""How far FastGen's fused RoPE kernel may be from an exact evaluation of its own arithmetic.

H restores rotate K with hcache's copy of FastGen's RoPE rule; FastGen's CUDA kernel rotates with fast-math
``__cosf``/``__sinf`` and an FMA. The two agree bit for bit on V and within this bound on K, which is what
``hcache check`` and the GPU tests hold H's K to.
"""

from __future__ import annotations

import torch


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
