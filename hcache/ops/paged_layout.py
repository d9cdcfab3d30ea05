"""Where a token's K and V live inside a paged KV cache, laid out as vLLM's attention backends lay it out or
as FastGen (and the reference engine) does; and the one writer of a restore's stored K/V rows, every engine's.

vLLM's per-layer cache is logically ``[blocks, kv_heads, block_size, 2 * head_size]`` (RFC #42082): K's
head dim then V's on the last axis; an MLA layer's is ``[blocks, 1, block_size, head_size]``, one latent row a
token with no K/V split (one *part* where attention has two). How a block's interior is laid out in memory is the backend's:
FlashAttention keeps it plain, reached through the tensor's strides (:meth:`PagedLayout.split_kv`), while
the CPU backend's kernels pack K (and under AMX, V) in an order of their own that depends on the ISA
and dtype. So hcache does not assume the CPU's packing: :meth:`PagedLayout.probe` finds it by writing
known values through the backend's own cache-write op and seeing where each lands.

Either way the layout is one index map: for each token offset in a block, part (K or V, or the latent),
head and channel, the element's offset from the block's first element. Most backends' maps are strided: each of K and V (or the
two together) sits at fixed strides by token, head and channel, FlashAttention's as its tensor's strides
say, the CPU backend's with K's channels strided across a block's tokens. Rows are then read and written
through a strided view of the cache, indexed by (block, offset) alone: two indices a token, where a map
that is no stride pattern (AMX's packing) is read and written element by element, one index an element,
several times the bytes moved. A step's tokens take the same places in every layer's cache, so their
indices (:meth:`PagedLayout.elements`) are made once a step, on the cache's device, and every layer reads
or writes through them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .dequant_scatter import write_rows
from .paged_kv import slot_runs
from .quant import QuantRows, dequantise


@dataclass(frozen=True)
class Places:
    """Where tokens are in a cache, as a layout reads and writes them (:meth:`PagedLayout.elements`):
    ``index``, the layout's index tensors; for a flat layout, the tokens' slots, and ``runs``, the runs of
    consecutive slots they make (:func:`~hcache.ops.paged_kv.slot_runs`, on the host)."""

    index: tuple[torch.Tensor, ...]
    runs: list[tuple[int, int, int]] | None = None

    @property
    def slots(self) -> torch.Tensor:
        """A flat layout's tokens' slots, one a token, on the cache's device."""
        if self.runs is None:
            raise ValueError("only a flat layout places tokens by slot")
        return self.index[0]

    def tail(self, start: int) -> Places:
        """A flat layout's places of the tokens from the ``start``-th on: a view of the slots and the runs cut,
        with no device op (nothing queued on whichever stream asks)."""
        cut = [(row, slot, n, max(0, start - row)) for row, slot, n in self.runs if row + n > start]
        return Places(
            (self.slots[start:],), [(row + skip - start, slot + skip, n - skip) for row, slot, n, skip in cut]
        )


# A backend's own cache write: (rows [T, parts, H, C], cache, slot_mapping [T]) -> None
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(RuntimeError):
    """The cache is not laid out as this layout says (a backend that packs across blocks, say)."""


class PagedLayout:
    """``offsets[n, kv, h, c]``: where token ``n`` of a block keeps element ``c`` of head ``h`` of K
    (``kv=0``) or V (``kv=1``), or of an MLA latent row (``kv=0``, the one part), counted in elements from the
    block's first one; ``block_stride``: the
    elements from one block to the next. Where the map is strided (:func:`_strided_parts`), tokens are
    read and written through views of the cache at those strides, rather than element by element. Where it is
    *flat* (each token's row whole, in order, and block after block: FastGen's layout, the reference
    engine's), a token is a slot, ``block * block_size + offset``, and rows are written a run of consecutive
    slots at a time, straight from where they are stored (:func:`~hcache.ops.dequant_scatter.write_rows`)."""

    def __init__(self, offsets: torch.Tensor, block_stride: int):
        self.offsets, self.block_stride = offsets.to(torch.int64), block_stride
        self.block_size, self.kv_parts, self.num_heads, self.head_size = offsets.shape
        self.parts = _strided_parts(self.offsets)
        self.flat = block_stride == self.offsets.numel() and torch.equal(
            self.offsets.flatten(), torch.arange(self.offsets.numel(), device=self.offsets.device)
        )
        self._views: dict[
            tuple, list[torch.Tensor]
        ] = {}  # each cache's views, made once: a view costs as much as a decode step's gather
        self._flat: dict[tuple, torch.Tensor] = {}  # each cache's storage, flat, made once, likewise

    @classmethod
    def blocked(cls, cache: torch.Tensor) -> "PagedLayout":
        """FastGen's layout, the reference engine's: ``cache`` ``[blocks, block_size, parts, H, C]``, contiguous
        (flat)."""
        _, block_size, parts, heads, head_size = cache.shape
        per_block = block_size * parts * heads * head_size
        offsets = torch.arange(per_block, device=cache.device).reshape(block_size, parts, heads, head_size)
        return cls(offsets, per_block)

    @classmethod
    def split_kv(cls, cache: torch.Tensor, parts: int = 2) -> "PagedLayout":
        """The standardized layout read through the cache's strides (FlashAttention's, in whatever
        physical order its stride permutation gives): K is ``cache[b, h, n, :C]``, V ``cache[b, h, n, C:]``;
        with one part (MLA), the row is ``cache[b, h, n, :]``."""
        _, heads, block_size, content = cache.shape
        sb, sh, sn, sc = cache.stride()
        head_size = content // parts
        n, kv, h, c = torch.meshgrid(
            *(torch.arange(k, device=cache.device) for k in (block_size, parts, heads, head_size)), indexing="ij"
        )
        return cls(n * sn + h * sh + (kv * head_size + c) * sc, sb)

    @classmethod
    def probe(cls, write: CacheWrite, cache: torch.Tensor, parts: int = 2) -> "PagedLayout":
        """The layout that ``write`` (the backend's cache write) gives a cache shaped and typed as ``cache``,
        whose rows have ``parts`` parts (K and V, or one MLA latent row).
        Values are written as base-64 digits of each element's index, exact in any float dtype the cache
        may have (bfloat16 holds integers to 256), one digit a pass, into two blocks, so a layout that is not
        the same in every block is refused (:class:`LayoutError`)."""
        _, heads, block_size, content = cache.shape
        head_size = content // parts
        if not cache.is_contiguous():
            raise LayoutError("a probed cache must be contiguous: its blocks are found by their stride")
        scratch = torch.zeros((2, heads, block_size, content), dtype=cache.dtype, device=cache.device)
        per_block = parts * heads * block_size * head_size
        index = torch.arange(per_block, device=cache.device).reshape(block_size, parts, heads, head_size)
        slots = torch.arange(2 * block_size, device=cache.device)
        found = torch.zeros(scratch.numel(), dtype=torch.int64, device=cache.device)
        digits = 1
        while 64**digits < per_block:
            digits += 1
        for d in range(digits):
            digit = (index // 64**d) % 64 + 1  # 1..64: 0 is an element no write reached
            rows = torch.cat([digit, digit + 64]).to(cache.dtype)  # the second block's values differ from the first's
            scratch.zero_()
            write(rows, scratch, slots)
            values = scratch.reshape(-1).to(torch.int64)
            if d == 0:
                written = values > 0
            found += torch.where(values > 64, values - 65, values - 1).clamp(min=0) * 64**d
        where = torch.full((per_block,), -1, dtype=torch.int64, device=cache.device)
        half = scratch.numel() // 2
        first = written[:half].nonzero().squeeze(1)
        where[found[first]] = first
        second = written[half:].nonzero().squeeze(1) + half
        if (
            (where < 0).any()
            or len(first) != per_block
            or len(second) != per_block
            or not torch.equal(where[found[second]], second - half)
        ):
            raise LayoutError(
                f"the backend's cache write does not lay out every block of a {tuple(cache.shape)} cache alike"
            )
        return cls(where.reshape(block_size, parts, heads, head_size), half)

    @property
    def strided(self) -> bool:
        return self.parts is not None

    def elements(self, blocks: torch.Tensor | np.ndarray, offsets: torch.Tensor | np.ndarray, whole: int = 0) -> Places:
        """Where tokens at ``blocks`` and ``offsets`` in them are, on the device of the layout's map, as
        :meth:`read` and :meth:`write` take them. ``whole``: how many blocks the leading tokens fill, each
        whole and in order (the caller knows: a load's positions from a block's start on), which a strided
        layout reads and writes a block at a time, and the rest by (block, offset). A map that is no stride
        pattern takes the tokens' ``[T, parts, H, C]`` element indices from a cache's first element."""
        device = self.offsets.device
        if self.flat:  # the runs are found on the host, from host positions (numpy, as an engine has them)
            slots = blocks * self.block_size + offsets
            host = slots if isinstance(slots, np.ndarray) else slots.cpu().numpy()
            slots = torch.from_numpy(host).to(device, torch.int64, non_blocking=True)  # staged at once: no stream wait
            return Places((slots,), slot_runs(host))
        if self.strided:
            lead = whole * self.block_size
            rest = torch.stack((blocks[lead:], offsets[lead:])).to(device, torch.int64)  # one copy to the device
            return Places((blocks[: lead : self.block_size].to(device, torch.int64), *rest.unbind()))
        base = blocks.to(device, torch.int64) * self.block_stride
        return Places((base.view(-1, 1, 1, 1) + self.offsets[offsets.to(device, torch.int64)],))

    def _strided_views(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """The cache as ``[blocks, block_size, parts, H, C]`` views, one per strided part."""
        key = (cache.data_ptr(), cache.dtype, cache.shape[0])
        views = self._views.get(key)
        if views is None:
            start = cache.storage_offset()
            views = self._views[key] = [
                torch.as_strided(
                    cache,
                    (cache.shape[0], self.block_size, kv.stop - kv.start, self.num_heads, self.head_size),
                    (self.block_stride, *strides),
                    start + first,
                )
                for kv, first, strides in self.parts
            ]
        return views

    def _storage(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache's storage from its first element on, flat."""
        key = (cache.data_ptr(), cache.dtype)
        flat = self._flat.get(key)
        if flat is None:
            start = cache.storage_offset()
            flat = self._flat[key] = torch.as_strided(
                cache, (cache.untyped_storage().nbytes() // cache.element_size() - start,), (1,), start
            )
        return flat

    def read(self, cache: torch.Tensor, places: Places) -> torch.Tensor:
        """Tokens' K/V as ``[T, parts, H, C]`` (hcache's stored KV rows), from ``cache`` at their
        :meth:`elements`."""
        if self.flat:
            return self._strided_views(cache)[0].flatten(0, 1)[places.slots]
        if self.strided:
            whole, blocks, offsets = places.index
            parts = []
            for view in self._strided_views(cache):  # one gather where the tokens are all whole blocks or none are
                pieces = [view[whole].flatten(0, 1)] if len(whole) else []
                if blocks.numel() or not pieces:
                    pieces.append(view[blocks, offsets])
                parts.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        (elements,) = places.index
        return self._storage(cache).take(elements)  # take: half the time of indexing, for a decode step's few tokens

    def write(
        self, cache: torch.Tensor, places: Places, rows: torch.Tensor | Sequence[torch.Tensor | QuantRows]
    ) -> None:
        """Put rows ``[T, parts, H, C]`` (K rotated: hcache's stored KV rows) into ``cache`` at the tokens'
        :meth:`elements`: one tensor, or its consecutive parts as stored, 8-bit ones (:class:`QuantRows`)
        dequantised. A flat layout copies each part straight from where it is, a run of slots at a time (on a
        GPU, a DMA from pinned memory, in one batched call); other layouts write the parts decoded, as one."""
        parts = [rows] if isinstance(rows, (torch.Tensor, QuantRows)) else rows
        if self.flat:
            write_rows(self._strided_views(cache)[0], places.runs, places.slots, parts, 0)
            return
        decoded = [dequantise(p, cache.dtype) if isinstance(p, QuantRows) else p for p in parts]
        rows = decoded[0] if len(decoded) == 1 else torch.cat(decoded)
        if (rows.device, rows.dtype) != (cache.device, cache.dtype):
            rows = rows.to(cache.device, cache.dtype)
        if not self.strided:
            (elements,) = places.index
            self._storage(cache).put_(elements, rows)
            return
        whole, blocks, offsets = places.index
        lead = len(whole) * self.block_size
        for (kv, _, _), view in zip(self.parts, self._strided_views(cache)):
            if lead:  # block by block: the copy runs along the cache's own strides, an index a block
                view[whole] = rows[:lead, kv].unflatten(0, (-1, self.block_size))
            if lead < len(rows):
                view[blocks, offsets] = rows[lead:, kv]


def _strided_parts(offsets: torch.Tensor) -> list[tuple[slice, int, tuple[int, int, int, int]]] | None:
    """The map ``offsets[n, kv, h, c]`` as strided parts, if it is so made: K and V (or an MLA row) together
    (one part), else each apart (two), as ``(kv, first element, strides by token, kv, head and channel)``, each element
    at ``first + n * sn + kv * skv + h * sh + c * sc``; None where it is neither."""

    def fit(part: torch.Tensor) -> tuple[int, tuple[int, int, int, int]] | None:
        first = int(part[0, 0, 0, 0])
        # a dim of one place takes any stride; 0 would read as broadcast, and a copy then runs twice as long
        strides = tuple(int(part.narrow(d, 1, 1).flatten()[0]) - first if part.shape[d] > 1 else 1 for d in range(4))
        grid = torch.meshgrid(*(torch.arange(k, device=part.device) for k in part.shape), indexing="ij")
        return (first, strides) if torch.equal(part, first + sum(i * s for i, s in zip(grid, strides))) else None

    whole = fit(offsets)
    if whole is not None:
        return [(slice(0, offsets.shape[1]), *whole)]
    apart = [fit(offsets[:, kv : kv + 1]) for kv in range(offsets.shape[1])]
    return None if None in apart else [(slice(kv, kv + 1), *apart[kv]) for kv in range(len(apart))]
