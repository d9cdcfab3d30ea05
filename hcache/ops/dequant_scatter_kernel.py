"""Triton kernel: dequantise 8-bit stored K/V rows and scatter them into the paged KV cache in one pass.

A KV restore from an 8-bit chunk reads the codes (one byte per element) and one float16 scale per head
once, and writes the cache once: the dequantised rows never exist as a tensor of their own. One program
handles ``BLOCK_T`` tokens by ``BLOCK_R`` of their ``2·n_kv_heads`` head vectors (K's, then V's).

The arithmetic is :func:`hcache.ops.quant.dequantise`'s: ``code · scale`` in float32 (both exact there),
rounded once to the cache's dtype (to nearest even, also on the interpreter, which truncates to bfloat16).
float8 codes are decoded from their bits, so the interpreter, which has no float8 type, computes the same
values as a GPU. The tests check every case bit for bit against the torch reference under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rope_scatter_kernel import _ROUND, COMPILE_OPTIONS, _jit, interpreting

_TILE_ELEMENTS = 4096


def _dequant_scatter(
    cache_ptr,
    code_ptr,
    scale_ptr,
    slot_ptr,
    n_tokens,
    n_rows,
    stride_slot,
    HEAD_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_ok = (t < n_tokens)[:, None] & (r < n_rows)[None, :]
    t = t.to(tl.int64)[:, None]
    r = r.to(tl.int64)[None, :]
    slot = tl.load(slot_ptr + t, mask=(t < n_tokens), other=0).to(tl.int64)
    scale = tl.load(scale_ptr + t * n_rows + r, mask=rows_ok, other=0).to(tl.float32)[:, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    ok = rows_ok[:, :, None] & (d < HEAD_SIZE)
    code = tl.load(code_ptr + (t * n_rows + r)[:, :, None] * HEAD_SIZE + d, mask=ok, other=0)
    if FP8:  # e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
        bits = code.to(tl.int32) & 0xFF
        exp = (bits >> 3) & 0xF
        man = bits & 0x7
        normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(exp > 0, normal, man.to(tl.float32) * 0.001953125)
        x = tl.where((bits & 0x80) != 0, -magnitude, magnitude)
    else:
        x = code.to(tl.float32)
    out = ROUND(x * scale)
    dst = cache_ptr + slot[:, :, None] * stride_slot + r[:, :, None] * HEAD_SIZE + d
    tl.store(dst, out.to(cache_ptr.dtype.element_ty), mask=ok)


def launch(cache: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Run the kernel: ``codes`` ``[T, 2, n_kv_heads, head_size]`` (int8 or float8 e4m3) and ``scale``
    ``[T, 2, n_kv_heads]`` into flat ``slots`` ``[T]`` of one layer's contiguous cache, all on one device."""
    n_tokens = codes.shape[0]
    if (
        cache.shape[2:] != codes.shape[1:]
        or scale.shape != codes.shape[:-1]
        or slots.shape != (n_tokens,)
        or not cache.is_contiguous()
    ):
        raise ValueError(
            f"shapes disagree: cache {tuple(cache.shape)}, slots {tuple(slots.shape)}, "
            f"codes {tuple(codes.shape)}, scale {tuple(scale.shape)}"
        )
    if codes.dtype not in (torch.int8, torch.float8_e4m3fn) or cache.dtype not in _ROUND:
        raise ValueError(
            f"the kernel takes int8 or float8 e4m3 codes into a float cache; got {codes.dtype}, {cache.dtype}"
        )
    if n_tokens == 0:
        return
    head_size = codes.shape[-1]
    n_rows = codes[0].numel() // head_size
    fp8 = codes.dtype == torch.float8_e4m3fn
    codes = (codes.view(torch.uint8) if fp8 else codes).contiguous()
    scale = scale.contiguous()
    cache_rows = cache.view(-1, *cache.shape[2:])
    block_d = triton.next_power_of_2(head_size)
    block_r = min(triton.next_power_of_2(n_rows), max(1, _TILE_ELEMENTS // block_d))
    block_t = max(1, _TILE_ELEMENTS // (block_r * block_d))
    grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(n_rows, block_r))
    interpret = interpreting()
    _jit(_dequant_scatter, interpret)[grid](
        cache_rows,
        codes,
        scale,
        slots,
        n_tokens,
        n_rows,
        cache_rows.stride(0),
        HEAD_SIZE=head_size,
        FP8=fp8,
        ROUND=_jit(_ROUND[cache.dtype], interpret),
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **COMPILE_OPTIONS,
    )
