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

from .device_copy import gather
from .dequant_scatter_kernel import launch
from .paged_kv import row_spans, write_kv_rows
from .quant import QuantRows, codes_as_float, dequantise
from .rope_scatter import Backend, resolve_backend


def write_dequantised(cache: torch.Tensor, slots: torch.Tensor, rows: QuantRows, backend: Backend = "auto") -> None:
    """Dequantise ``rows`` (codes ``[T, 2, n_kv_heads, head_size]``, scales ``[T, 2, n_kv_heads]``, on the
    cache's device) into flat ``slots`` ``[T]`` of one layer's cache."""
    if resolve_backend(backend, cache.device) == "torch":
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, dequantise(rows, cache.dtype))
    else:
        launch(cache, slots, rows.codes, rows.scale)


def write_rows(
    cache: torch.Tensor,
    runs: list[tuple[int, int, int]],
    slots: torch.Tensor,
    parts: Sequence[torch.Tensor | QuantRows],
    start: int,
) -> None:
    """:func:`~hcache.ops.paged_kv.write_kv_rows` for parts of which some may be :class:`QuantRows` (a
    restore over chunks saved lossless and in 8 bits). ``slots``: the restore's flat cache slots, row by
    row (``runs`` as one tensor, on the device).

    Lossless parts are copied as there. Each run of consecutive parts in one 8-bit encoding is dequantised
    into its slots: by the kernel where it runs, in one pass over the run's codes and scales gathered to
    the device (one copy per part, as lossless parts take); elsewhere (a CPU) in place, its codes copied
    into the cache as lossless rows are (the cache's dtype holds every 8-bit code exactly), then scaled
    there, computing what the kernel computes (a float32 product, rounded once to the cache's dtype)."""
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
        elif kernel:
            rows = QuantRows(
                gather([p.codes for p in group], cache.device), gather([p.scale for p in group], cache.device)
            )
            write_dequantised(cache, slots[row : row + n], rows)
        else:
            _dequantise_in_place(cache, runs, group, row)
        row += n


def _dequantise_in_place(
    cache: torch.Tensor, runs: list[tuple[int, int, int]], parts: list[QuantRows], start: int
) -> None:
    codes = [p.codes for p in parts]
    if codes[0].dtype == torch.float8_e4m3fn:  # torch's copy converts float8 one element at a time on a CPU
        codes = [codes_as_float(gather(codes, cache.device))]
    write_kv_rows(cache, runs, codes, start)
    scale = gather([p.scale for p in parts], cache.device).float().unsqueeze(-1)
    flat = cache.view(-1, *cache.shape[2:])
    for _, offset, slot, n in row_spans(runs, [len(scale)], start):
        flat[slot : slot + n].mul_(scale[offset : offset + n])
