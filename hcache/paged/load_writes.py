"""One load's writes into a paged cache, layer by layer: made by the loader's thread
(:mod:`hcache.paged.loader`) and, on a CPU, by its load process (:mod:`hcache.paged.copy_process`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planning.plan import Method
from ..serving.restore import gather_runs
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.image_rows import ImageRows
from ..storage.stored_state import decode_rows, stored_rows
from ..transfer.copier import Copier
from ..transfer.scratch import Scratch
from .layout import PagedLayout, Places


@dataclass(frozen=True)
class PagedLayer:
    """One attention layer of vLLM's paged cache: its index in the model, its cache and how that is laid
    out, and its KV cache group (whose block ids it holds its positions in)."""

    index: int
    cache: torch.Tensor
    layout: PagedLayout
    group: int = 0


class LoadWrites:
    """One load's layer writes: each layer's rows gathered from the pool and, for KV, written into the
    cache (:meth:`stage`); H's rows staged for the loader's rebuild. Made by the loader's thread, and by the
    load process for the KV layers it is sent (:meth:`message`, :meth:`received`). ``slots``: by KV cache
    group, the first position held in a real block and the blocks and offsets from there to ``end``;
    ``shared``: the images' rows gathered a layer at a time (a CPU's), else ``images`` read a chunk at a
    time through ``copier`` (a GPU's)."""

    def __init__(self, slots: dict, first: int, end: int, kernel_block: int, copier: Copier | None, scratch: Scratch | None,
                 shared: ImageRows | None, images: list | None = None):  # fmt: skip
        self.slots, self.first, self.end, self.kernel_block = slots, first, end, kernel_block
        self.copier, self.scratch, self.shared, self.images = copier, scratch, shared, images
        self._elements: dict[tuple, Places] = {}

    @staticmethod
    def message(shared: ImageRows, slots: dict, first: int, end: int, jobs: list[tuple]) -> dict:
        """What the load process needs to write ``jobs``: plain data (numpy, not tensors: a pickled tensor
        would travel as a shared-memory handle the process cannot open)."""
        return {"starts": shared.starts, "entries": shared.entries, "first": first, "end": end,
                "slots": {g: (held, blocks.numpy(), offsets.numpy()) for g, (held, blocks, offsets) in slots.items()},
                "jobs": [(layer.index, method.value, chunks.start, chunks.stop, begin) for layer, method, chunks, begin in jobs]}  # fmt: skip

    @classmethod
    def received(cls, message: dict, arena: torch.Tensor, layers: dict[int, PagedLayer], kernel_block: int, scratch: Scratch) -> tuple:
        """The load process's side of :meth:`message`: its writes over ``arena`` and its jobs over ``layers``."""
        slots = {g: (held, torch.from_numpy(blocks), torch.from_numpy(offsets)) for g, (held, blocks, offsets) in message["slots"].items()}
        shared = ImageRows(arena, message["starts"], message["entries"])
        jobs = [(layers[index], Method(method), range(start, stop), begin) for index, method, start, stop, begin in message["jobs"]]
        return cls(slots, message["first"], message["end"], kernel_block, None, scratch, shared), jobs

    def rows_of(self, layer: PagedLayer, runs: list, chunks: range, begin: int) -> torch.Tensor:
        """A layer's rows of positions ``[begin, end)``, from the runs :meth:`stage` gathered."""
        # 8-bit rows decoded into the scratch's slot of the job staged last: used up before it is reused
        empty = self.scratch.empty if self.scratch is not None else None
        decoded = [decode_rows(run, layer.cache.dtype, empty) for run in runs]  # one run, unless chunks were stored in several encodings
        rows = decoded[0] if len(decoded) == 1 else torch.cat(decoded)
        origin = (self.first + chunks.start) * CHUNK_TOKENS
        return rows if (begin, self.end) == (origin, origin + rows.shape[0]) else rows[begin - origin : self.end - origin]

    def stage(self, item: tuple) -> tuple | None:
        """On the side stream: the layer's rows to the device, and KV's written; H's returned, with where
        they go."""
        layer, method, chunks, begin = item
        if self.scratch is not None:
            self.scratch.next_job()
        held, blocks, offsets = self.slots[layer.group]
        key = (id(layer.layout), layer.group, begin)
        if key not in self._elements:
            whole = (self.end - begin) // self.kernel_block if begin % self.kernel_block == 0 else 0  # kernel blocks, from a block's start on
            self._elements[key] = layer.layout.elements(blocks[begin - held :], offsets[begin - held :], whole)
        if self.shared is not None:  # a CPU's: one call a layer, whatever the number of chunks
            runs = [self.shared.stored_rows(layer.index, method.value, chunks, self.scratch.empty)]
        else:  # a GPU's: one DMA per chunk from its pinned slot (:meth:`Copier.gather`)
            runs = gather_runs(self.copier, [stored_rows(self.images[j], layer.index, method.value) for j in chunks], self.scratch)
        if method is Method.H:
            return runs, self._elements[key]
        layer.layout.write(layer.cache, self._elements[key], self.rows_of(layer, runs, chunks, begin))
        return None
