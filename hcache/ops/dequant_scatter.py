"""A KV restore's copy into the paged cache when some of its rows are stored in an 8-bit encoding.

Two backends compute the same bits, chosen as :func:`hcache.ops.rope_scatter.resolve_backend` chooses:
``"torch"`` (:func:`~hcache.ops.quant.dequantise`, then an indexed write) and ``"triton"``, one fused pass
(:mod:`hcache.ops.dequant_scatter_kernel`). The codes cross to the device as they are stored (half the
bytes of the model's dtype, in one copy per part, as lossless rows do) and are dequantised there.
"""
from __future__ import annotations

import itertools
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

    Lossless parts are copied as there. Each run of consecutive parts in one 8-bit encoding is gathered to
    the device (one copy per part, as lossless parts take) and dequantised into its slots in one pass: by
    the kernel where it runs, else (the CPU) by torch straight into each run of consecutive slots,
    computing what the kernel computes (a float32 product, rounded once to the cache's dtype)."""
    if not any(isinstance(p, QuantRows) for p in parts):
        write_kv_rows(cache, runs, parts, start)
        return
    kernel = resolve_backend("auto", cache.device) == "triton"
    row = start
    for _, group in itertools.groupby(parts, lambda p: p.codes.dtype if isinstance(p, QuantRows) else None):
        group = list(group)
        n = sum(len(p) for p in group)
        if not isinstance(group[0], QuantRows):
            write_kv_rows(cache, runs, group, row)
        else:
            rows = QuantRows(gather([p.codes for p in group], cache.device), gather([p.scale for p in group], cache.device))
            if kernel:
                write_dequantised(cache, slots[row : row + n], rows)
            else:
                _dequantise_into_runs(cache, runs, rows, row)
        row += n


def _dequantise_into_runs(cache: torch.Tensor, runs: list[tuple[int, int, int]], rows: QuantRows, start: int) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    codes = rows.codes.float()  # exact; the product is then computed and rounded as the kernel does
    scale = rows.scale.float().unsqueeze(-1)
    for _, offset, slot, n in row_spans(runs, [len(rows)], start):
        torch.mul(codes[offset : offset + n], scale[offset : offset + n], out=flat[slot : slot + n])
