"""A KV restore's copy into the paged cache when some of its rows are stored in an 8-bit encoding.

Two backends compute the same bits, chosen as :func:`hcache.ops.rope_scatter.resolve_backend` chooses:
``"torch"`` (:func:`~hcache.ops.quant.dequantise`, then an indexed write) and ``"triton"``, one fused pass
(:mod:`hcache.ops.dequant_scatter_kernel`). The codes cross to the device as they are stored (half the
bytes of the model's dtype, in one copy per part, as lossless rows do) and are dequantised there.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..transfer.copier import gather
from .dequant_scatter_kernel import launch
from .paged_kv import row_spans, write_kv_rows
from .quant import QuantRows, dequantise
from .rope_scatter import Backend, resolve_backend


def write_dequantised(cache: torch.Tensor, slots: torch.Tensor, rows: QuantRows, backend: Backend = "auto") -> None:
    """Dequantise ``rows`` (codes ``[T, 2, n_kv_heads, head_size]``, scales ``[T, 2, n_kv_heads]``, on the
    cache's device) into flat ``slots`` ``[T]`` of one layer's cache."""
    if resolve_backend(backend, cache.device) == "torch":
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, dequantise(rows, cache.dtype))
    else:
        launch(cache, slots, rows.codes, rows.scale)


def write_rows(
    cache: torch.Tensor, runs: list[tuple[int, int, int]], slots: torch.Tensor, parts: Sequence[torch.Tensor | QuantRows], start: int
) -> None:
    """:func:`~hcache.ops.paged_kv.write_kv_rows` for parts of which some may be :class:`QuantRows` (a
    restore over chunks saved lossless and in 8 bits). ``slots``: the restore's flat cache slots, row by
    row (``runs`` as one tensor, on the device).

    Where the kernel runs, lossless parts are copied as there, and the encoded parts of each code dtype
    are gathered to the device in one buffer and dequantised into their slots in one launch. Elsewhere
    (the CPU), each (part, run) overlap is dequantised straight into its run of the cache: one pass over
    the codes, computing what the kernel computes (a float32 product, rounded once to the cache's dtype)."""
    if not any(isinstance(p, QuantRows) for p in parts):
        write_kv_rows(cache, runs, parts, start)
    elif resolve_backend("auto", cache.device) == "torch":
        _write_rows_in_place(cache, runs, parts, start)
    else:
        _write_rows_gathered(cache, runs, slots, parts, start)


def _write_rows_in_place(cache: torch.Tensor, runs: list[tuple[int, int, int]], parts: Sequence[torch.Tensor | QuantRows], start: int) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    dst, src = [], []
    # float32 scales; int8 codes as they are (torch.mul promotes them in its loop), float8 ones converted
    factors = [
        (p.codes if p.codes.dtype == torch.int8 else p.codes.float(), p.scale.float().unsqueeze(-1)) if isinstance(p, QuantRows) else None
        for p in parts
    ]  # fmt: skip
    for p, offset, slot, n in row_spans(runs, [len(part) for part in parts], start):
        part = parts[p]
        if isinstance(part, QuantRows):
            codes, scale = factors[p]
            torch.mul(codes[offset : offset + n], scale[offset : offset + n], out=flat[slot : slot + n])
        else:
            dst.append(flat[slot : slot + n])
            src.append(part[offset : offset + n])
    if dst:
        torch._foreach_copy_(dst, src)


def _write_rows_gathered(
    cache: torch.Tensor, runs: list[tuple[int, int, int]], slots: torch.Tensor, parts: Sequence[torch.Tensor | QuantRows], start: int
) -> None:
    encoded: dict[torch.dtype, list[tuple[QuantRows, int]]] = {}  # code dtype -> (rows, first restore row)
    row = start
    for part in parts:
        if isinstance(part, QuantRows):
            encoded.setdefault(part.codes.dtype, []).append((part, row))
        else:
            write_kv_rows(cache, runs, [part], row)
        row += len(part)
    for pieces in encoded.values():
        rows = QuantRows(gather([r.codes for r, _ in pieces], cache.device), gather([r.scale for r, _ in pieces], cache.device))
        spans = [(first, first + len(r)) for r, first in pieces]
        if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):  # consecutive parts: one view of the slots
            where = slots[spans[0][0] : spans[-1][1]]
        else:
            where = torch.cat([slots[a:b] for a, b in spans])
        write_dequantised(cache, where, rows)
