"""One tensor of many chunk images, read in one call. A restore reads each layer's rows out of every chunk
of a prefix: a call per chunk and layer is a few microseconds of Python each, and on a helper thread every
call is a handover of the GIL that the engine's own thread waits on. Images in one host arena and laid out
alike hold a tensor at the same offset from each image's start, so their starts index the rows of one
strided view of the arena, and one ``index_select`` gathers the tensor of them all."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ..ops.quant import QuantRows
from .chunk import ChunkImage, TensorEntry
from .stored_state import is_encoded, scale_format


class ImageRows:
    """The tensors of images at byte ``starts`` of ``base``'s storage, each laid out by ``entries``, each
    tensor gathered across a run of them in one call (:meth:`of`: a restore's images)."""

    def __init__(self, base: torch.Tensor, starts: list[int], entries: dict[tuple[int, str], TensorEntry]):
        self.base, self.starts, self.entries = base, starts, entries
        self._step = (
            functools.reduce(math.gcd, starts) or 1
        )  # a host pool's slots start on pages: its page size, or more
        self._index = torch.tensor([start // self._step for start in starts], dtype=torch.int64)
        self._runs: dict[range, torch.Tensor] = {}

    @classmethod
    def of(cls, images: list[ChunkImage]) -> ImageRows | None:
        """``images``' rows, or None where they do not share one storage and one layout (read image by image
        then)."""
        first = images[0] if images else None
        gathers = (
            first is not None
            and all(image.layout is first.layout or image.layout.entries == first.layout.entries for image in images)
            and len({image.data.untyped_storage().data_ptr() for image in images}) == 1
        )
        return (
            cls(first.data, [image.data.storage_offset() for image in images], first.layout.entries)
            if gathers
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
        base = self.base
        rows = (base.untyped_storage().nbytes() - e.offset - e.nbytes) // self._step + 1
        source = base.as_strided(
            (rows, e.nbytes), (self._step, 1), e.offset
        )  # row i: the tensor of the image starting at i * step
        index = self._runs.get(chunks)
        if index is None:
            index = self._runs[chunks] = self._index[chunks.start : chunks.stop]
        out = empty((len(chunks) * e.shape[0], *e.shape[1:]), e.dtype)
        torch.index_select(source, 0, index, out=out.view(torch.uint8).view(len(chunks), e.nbytes))
        return out
