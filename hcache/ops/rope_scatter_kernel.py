"""Triton kernel: rotate K and scatter K and V into the paged KV cache in one pass.

A restore's memory-bound half: it reads K, V and one cos/sin row per token once, and writes the cache once,
where the torch reference makes a rotated copy of K first. One program handles ``BLOCK_T`` tokens by
``BLOCK_H`` KV heads, so each token's cos/sin row is loaded once for all its heads.

The arithmetic follows :func:`hcache.ops.rope.apply_rope` operation by operation (``x1·cos - x2·sin`` and
``x2·cos + x1·sin`` in float32; with cos/sin in K's dtype each product and sum is rounded to it, with
float32 cos/sin only the result), and FMA contraction is off, so the kernel writes the reference's bits exactly: the tests check that under the interpreter, and
``hcache bench ops`` on a GPU before timing. Only the first half of each cos/sin row is read: in the
half-split layout both halves hold the same values.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Elements of one [BLOCK_T, BLOCK_H, BLOCK_D] tile: enough bytes in flight per program to be memory bound,
# few enough registers per thread at 4 warps.
_TILE_ELEMENTS = 4096
# No FMA contraction: a fused x·cos + y·sin rounds once where torch rounds twice.
COMPILE_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


def _rope_scatter(
    cache_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    n_tokens,
    n_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_slot,
    stride_kv,
    stride_head,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    ROUND_OP: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = (t < n_tokens)[:, None, None]
    rows_ok = t_ok & (h < n_heads)[None, :, None]
    t = t.to(tl.int64)[:, None, None]
    h = h.to(tl.int64)[None, :, None]
    slot = tl.load(slot_ptr + t, mask=t_ok, other=0).to(tl.int64)
    dst = cache_ptr + slot * stride_slot + h * stride_head
    k_src = k_ptr + t * stride_kt + h * stride_kh
    out_ty = cache_ptr.dtype.element_ty

    d = tl.arange(0, BLOCK_D)[None, None, :]
    in_head = rows_ok & (d < HEAD_SIZE)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=in_head)
    tl.store(dst + stride_kv + d, v.to(out_ty), mask=in_head)

    if HALF > 0:
        # apply_rope: x·cos + rotate_half(x)·sin with rotate_half(x) = [-x2, x1], in float32 (the
        # interpreter cannot compute in bf16), rounded to the input dtype wherever torch rounds: ROUND_OP
        # after each operation (identity for float32 tables), ROUND at the end.
        j = tl.arange(0, BLOCK_HALF)[None, None, :]
        in_half = rows_ok & (j < HALF)
        cos = tl.load(cos_ptr + t * stride_cos + j, mask=t_ok & (j < HALF)).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_sin + j, mask=t_ok & (j < HALF)).to(tl.float32)
        x1 = tl.load(k_src + j, mask=in_half).to(tl.float32)
        x2 = tl.load(k_src + HALF + j, mask=in_half).to(tl.float32)
        out1 = ROUND(ROUND_OP(ROUND_OP(x1 * cos) + ROUND_OP(-x2 * sin)))
        out2 = ROUND(ROUND_OP(ROUND_OP(x2 * cos) + ROUND_OP(x1 * sin)))
        tl.store(dst + j, out1.to(out_ty), mask=in_half)
        tl.store(dst + HALF + j, out2.to(out_ty), mask=in_half)
    if 2 * HALF < HEAD_SIZE:  # partial rotary or no RoPE: the channels past the rotary ones are copied
        passing = in_head & (d >= 2 * HALF)
        tl.store(dst + d, tl.load(k_src + d, mask=passing).to(out_ty), mask=passing)


# ROUND: a float32 result rounded to the input dtype's precision, as torch rounds each operation's result.
def _round_fp32(x):
    return x


def _round_fp16(x):
    return x.to(tl.float16).to(tl.float32)


def _round_bf16(x):
    # Round to nearest even on the bits: the interpreter casts fp32 to bf16 by truncation.
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


_ROUND = {torch.float32: _round_fp32, torch.float16: _round_fp16, torch.bfloat16: _round_bf16}


@functools.cache
def _jit(fn, interpret: bool):
    # triton.jit chooses between compiler and interpreter when it runs, from TRITON_INTERPRET. Wrapping at
    # first launch, once per mode, rather than at import lets the variable be set at any time before a
    # launch (a test's monkeypatch, a CI job), whatever imported hcache first.
    return triton.jit(fn)


def interpreting() -> bool:
    """Whether Triton kernels run on the interpreter (``TRITON_INTERPRET=1``), read at each call."""
    return bool(triton.knobs.runtime.interpret)


def launch(
    cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Run the kernel; arguments as :func:`hcache.ops.rope_scatter.rotate_and_write`."""
    # The kernel indexes raw pointers: a shape the torch path would reject must not reach it.
    n_tokens, n_heads, head_size = k.shape
    if v.shape != k.shape or cache.shape[3:] != k.shape[1:] or slots.shape != (n_tokens,):
        raise ValueError(
            f"shapes disagree: cache {tuple(cache.shape)}, slots {tuple(slots.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.dtype not in _ROUND:
        raise ValueError(f"the kernel takes float32, float16 or bfloat16 K; got {k.dtype}")
    if cos_sin is not None:
        rows, rotary_dim = cos_sin[0].shape
        if cos_sin[1].shape != (rows, rotary_dim) or rows != n_tokens or rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"cos/sin {tuple(cos_sin[0].shape)} do not fit k {tuple(k.shape)}")
        if cos_sin[0].dtype not in (k.dtype, torch.float32) or cos_sin[1].dtype != cos_sin[0].dtype:
            raise ValueError(
                f"cos/sin must be float32 or K's dtype ({k.dtype}); got {cos_sin[0].dtype}, {cos_sin[1].dtype}"
            )
    if n_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if cos_sin is not None and (cos_sin[0].stride(-1) != 1 or cos_sin[1].stride(-1) != 1):
        cos_sin = (cos_sin[0].contiguous(), cos_sin[1].contiguous())
    cache_rows = cache.view(-1, *cache.shape[2:])  # [slots, 2, n_kv_heads, head_size]
    if cos_sin is None:
        half, cos, sin = 0, k, k  # never read: HALF == 0 removes the rotation from the kernel
    else:
        cos, sin = cos_sin
        half = cos.shape[-1] // 2
    round_op = _ROUND[cos.dtype if cos_sin is not None else k.dtype]
    block_d = triton.next_power_of_2(head_size)
    block_h = min(triton.next_power_of_2(n_heads), max(1, _TILE_ELEMENTS // block_d))
    block_t = max(1, _TILE_ELEMENTS // (block_h * block_d))
    grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(n_heads, block_h))
    interpret = interpreting()
    _jit(_rope_scatter, interpret)[grid](
        cache_rows,
        k,
        v,
        cos,
        sin,
        slots,
        n_tokens,
        n_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        cache_rows.stride(0),
        cache_rows.stride(1),
        cache_rows.stride(2),
        HEAD_SIZE=head_size,
        HALF=half,
        ROUND_OP=_jit(round_op, interpret),
        ROUND=_jit(_ROUND[k.dtype], interpret),
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        **COMPILE_OPTIONS,
    )
