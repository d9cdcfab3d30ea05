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
        cache.view(-1, *cache.shape[2:])[slots] = dequantise(rows, cache.dtype)
    else:
        launch(cache, slots, rows.codes, rows.scale)


def write_rows(
    cache: torch.Tensor, runs: list[tuple[int, int, int]], parts: Sequence[torch.Tensor | QuantRows], start: int
) -> None:
    """:func:`~hcache.ops.paged_kv.write_kv_rows` for parts of which some may be :class:`QuantRows` (a
    restore over chunks saved lossless and compressed): lossless parts are copied as there; encoded parts
    are gathered to the device, per code dtype one buffer, and dequantised into their slots in one pass."""
    if not any(isinstance(p, QuantRows) for p in parts):
        write_kv_rows(cache, runs, parts, start)
        return
    plain: dict[int, torch.Tensor] = {}
    encoded: dict[torch.dtype, list[tuple[QuantRows, int]]] = {}  # code dtype -> (rows, first slot)
    for p, offset, slot, n in row_spans(runs, [len(part) for part in parts], start):
        part = parts[p]
        if isinstance(part, QuantRows):
            encoded.setdefault(part.codes.dtype, []).append((part[offset : offset + n], slot))
        else:
            plain[p] = part
    lengths = [len(part) for part in parts]
    for p, part in plain.items():
        write_kv_rows(cache, runs, [part], start + sum(lengths[:p]))
    for pieces in encoded.values():
        rows = QuantRows(gather([r.codes for r, _ in pieces], cache.device), gather([r.scale for r, _ in pieces], cache.device))
        slots = torch.cat([torch.arange(slot, slot + len(r)) for r, slot in pieces]).to(cache.device)
        write_dequantised(cache, slots, rows)

