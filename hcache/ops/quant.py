"""8-bit stored encodings of saved state: each vector along the last dimension (a hidden-state row, one KV
head of one token) is stored as 8-bit codes with its own float16 scale, ``x ≈ code · scale``.

``int8``: codes are ``round(x / scale)`` with ``scale = absmax / 127``: uniform steps, best where a vector's
values are of one magnitude (K and V heads). ``fp8``: codes are float8 e4m3 of ``x / scale`` with
``scale = absmax / 448``: 3 mantissa bits at every magnitude, so a vector's small values keep their
relative precision beside an outlier channel (hidden states; ``hcache bench quality`` has the numbers).

:func:`dequantise` is the reference arithmetic (one float32 product, one rounding to the target dtype) that
the fused Triton kernel (:mod:`hcache.ops.dequant_scatter_kernel`) matches bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ENCODINGS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float16
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_SCALE_MIN = 2.0**-24  # float16's smallest subnormal: a zero vector gets a scale that divides safely
_SCALE_MAX = torch.finfo(SCALE_DTYPE).max


@dataclass(frozen=True)
class QuantRows:
    """Rows in an 8-bit encoding: ``codes`` ``[T, ..., d]`` (int8 or float8 e4m3) and ``scale`` ``[T, ...]``;
    sliced by rows like a tensor of rows."""

    codes: torch.Tensor
    scale: torch.Tensor

    def __len__(self) -> int:
        return self.codes.shape[0]

    def __getitem__(self, rows: slice) -> "QuantRows":
        return QuantRows(self.codes[rows], self.scale[rows])


def quantise(x: torch.Tensor, dtype: torch.dtype) -> QuantRows:
    """``x`` in the 8-bit ``dtype``, on ``x``'s device; scales are rounded to float16 before the codes are
    computed from them, so dequantising uses exactly the scale the codes were made for."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1) / qmax).clamp(_SCALE_MIN, _SCALE_MAX).to(SCALE_DTYPE)
    y = (xf / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)
    codes = y.round().to(dtype) if dtype == torch.int8 else y.to(dtype)
    return QuantRows(codes, scale)


def dequantise(rows: QuantRows, dtype: torch.dtype, empty: Callable | None = None) -> torch.Tensor:
    """``codes · scale`` in float32, rounded once to ``dtype``: the codes, exact in any dtype, written into
    the result and scaled in place by the float32 scales (a ``dtype`` tensor times a float32 one is taken in
    float32), so the only buffer is the result. ``empty(shape, dtype)``: where it goes (a new tensor, by
    default; a CPU load's kept buffers, :mod:`hcache.transfer.scratch`)."""
    out = _codes_into(rows.codes, dtype, empty)
    return out.mul_(rows.scale.float().unsqueeze(-1))


def codes_as_float(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes as float32, exactly."""
    return _codes_into(codes, torch.float32)


def _codes_into(codes: torch.Tensor, dtype: torch.dtype, empty: Callable | None = None) -> torch.Tensor:
    """8-bit codes in a tensor of ``dtype`` from ``empty`` (floating point: every code is exact in it).

    Torch converts float8 on a CPU one element at a time, many times slower than int8, so there e4m3's
    bits are moved into float16's place instead, in a few vector ops: the sign to bit 15, exponent and
    mantissa up by 7. That float16 is the code's value over 2^8 (its exponent bias is 8 more than e4m3's,
    and e4m3's subnormals land on float16's), which 2^8 restores, exactly. (e4m3's NaN would read 480; codes
    are clamped, and a chunk's bytes are checksummed.)"""
    if empty is None:
        empty = lambda shape, dt: torch.empty(shape, dtype=dt, device=codes.device)  # noqa: E731
    out = empty(codes.shape, dtype)
    if codes.dtype != torch.float8_e4m3fn or codes.device.type != "cpu":
        return out.copy_(codes)
    bits = empty(codes.shape, torch.int16).copy_(codes.view(torch.int8))
    bits <<= 7
    bits &= ~0x4000  # the sign extension cleared from bit 14
    return out.copy_(bits.view(torch.float16)).mul_(256.0)
