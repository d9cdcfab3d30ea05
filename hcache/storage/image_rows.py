"""One tensor of many chunk images, read in one call. A restore reads each layer's rows out of every chunk
of a prefix: a call per chunk and layer is a few microseconds of Python each, and on a helper thread every
call is a handover of the GIL that the engine's own thread waits on. Images in one host arena and laid out
alike hold a tensor at the same offset from each image's start, so their starts index the rows of one
strided view of the arena, and one ``index_select`` gathers the tensor of them all. On a GPU the view is of
the pinned arena's device alias (:func:`~hcache.ops.device_copy.host_alias`): the gather is one kernel
that reads every slot across the bus, one transfer a layer where a DMA a chunk would take as many calls."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ..ops.device_copy import host_alias
from ..ops.quant import QuantRows
from .chunk import ChunkImage, TensorEntry
from .host_pool import PAGE
from .stored_state import is_encoded, scale_format


class ImageRows:
    """The tensors of images at byte ``starts`` of ``base``'s storage, each laid out by ``entries``, each
    tensor gathered across a run of them in one call (:meth:`of`: a restore's images), onto ``base``'s
    device."""

    def __init__(self, base: torch.Tensor, starts: list[int], entries: dict[tuple[int, str], TensorEntry]):
        self.base, self.starts, self.entries = base, starts, entries
        # a host pool's slots start on pages: its page size, or more (any, for one image at the start)
        self._step = functools.reduce(math.gcd, starts) or PAGE
        self._host_index = torch.tensor([start // self._step for start in starts], dtype=torch.int64)
        self._runs: dict[range, torch.Tensor] = {}

    @classmethod
    def of(cls, images: list[ChunkImage], device: torch.device = torch.device("cpu")) -> ImageRows | None:
        """``images``' rows on ``device``, or None where they do not share one storage and one layout, or where
        a GPU cannot read their storage in place (read image by image then)."""
        first = images[0] if images else None
        gathers = (
            first is not None
            and all(image.layout is first.layout or image.layout.entries == first.layout.entries for image in images)
            and len({image.data.untyped_storage().data_ptr() for image in images}) == 1
        )
        base = None if not gathers else first.data if device.type == "cpu" else host_alias(first.data, device)
        return (
            cls(base, [image.data.storage_offset() for image in images], first.layout.entries)
            if base is not None
            else None
        )

    def stored_rows(self, layer: int, fmt: str, chunks: range, empty: Callable) -> torch.Tensor | QuantRows:
        """The rows of one layer and format of ``images[chunks]``, one chunk after another, as
        :func:`~hcache.storage.stored_state.stored_rows` reads one chunk's: a tensor, or 8-bit codes with
        their scales; in tensors from ``empty(shape, dtype)``."""
        rows = self._gather(layer, fmt, chunks, empty)
        return (
            QuantRows(rows, self._gather(layer, scale_format(fmt), chunks, empty)) if is_encoded(rows.dtype) else rows
        )

    def _gather(self, layer: int, fmt: str, chunks: range, empty: Callable) -> torch.Tensor:
        e = self.entries[(layer, fmt)]
        # In 8-byte words (a GPU reading host memory then asks 256 bytes a warp): a tensor starts 64-byte
        # aligned in its image, an image on a page, and its rows are a chunk's, a multiple of 64
        assert (e.offset | e.nbytes | self._step) % 8 == 0, (e.offset, e.nbytes, self._step)
        rows = (self.base.untyped_storage().nbytes() - e.offset - e.nbytes) // self._step + 1
        source = self._words.as_strided(
            (rows, e.nbytes // 8), (self._step // 8, 1), e.offset // 8
        )  # row i: the tensor of the image starting at i * step
        index = self._runs.get(chunks)
        if index is None:
            index = self._runs[chunks] = self._index[chunks.start : chunks.stop]
        out = empty((len(chunks) * e.shape[0], *e.shape[1:]), e.dtype)
        torch.index_select(source, 0, index, out=out.view(torch.uint8).view(len(chunks), e.nbytes).view(torch.int64))
        return out

    @functools.cached_property
    def _index(self) -> torch.Tensor:
        """The images' rows on the base's device, copied on the stream of the first gather, which the
        gathers after it follow (a copier's side stream, not the stream that built this); from pageable
        memory a copy is staged at once, with no sync."""
        return self._host_index.to(self.base.device, non_blocking=True)

    @functools.cached_property
    def _words(self) -> torch.Tensor:
        """The base's whole storage as 8-byte words."""
        return torch.empty(0, dtype=torch.int64, device=self.base.device).set_(self.base.untyped_storage())
