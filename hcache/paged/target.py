"""The restore core's target for a vLLM-style paged cache (:class:`~hcache.restore.layers.RestoreTarget`):
one load's layer writes, made by the loader's thread (:mod:`hcache.paged.loader`) and, on a CPU, by its
load process for the KV layers (:mod:`hcache.paged.copy_process`), which it is sent as plain data
(:meth:`PagedTarget.message`, :meth:`PagedTarget.received`). A recurrent layer's state is written by the
loader's thread, into the block that holds it at the load's end (:class:`StateLayer`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..planning.plan import Method
from ..restore.layers import StoredRows
from ..restore.reads import LayerJob
from ..storage.image_rows import ImageRows
from ..storage.stored_state import pack_state, unpack_state
from ..transfer.scratch import Scratch
from ..ops.paged_layout import PagedLayout, Places


@dataclass(frozen=True)
class PagedLayer:
    """One attention layer of vLLM's paged cache: its index in the model, its cache and how that is laid
    out, and its KV cache group (whose block ids it holds its positions in)."""

    index: int
    cache: torch.Tensor
    layout: PagedLayout
    group: int = 0


@dataclass(frozen=True)
class StateLayer:
    """One recurrent layer of vLLM's cache: its state's tensors (a convolution's inputs and the recurrent
    state, each ``[blocks, ...]``) and its KV cache group. In align mode vLLM keeps a sequence's state after
    position ``p`` (a block boundary, or where its last step ended) in its block ``(p - 1) // block_size``,
    and a sequence resumed at ``p`` starts from there."""

    index: int
    tensors: tuple[torch.Tensor, ...]
    group: int

    def read(self, block: int) -> torch.Tensor:
        """The state in ``block``, as a chunk stores it (:func:`~hcache.storage.stored_state.pack_state`)."""
        return pack_state([t[block] for t in self.tensors])

    def write(self, block: int, rows: torch.Tensor) -> None:
        """Set the state in ``block`` from a chunk's rows."""
        for t, part in zip(self.tensors, unpack_state(rows, [tuple(t.shape[1:]) for t in self.tensors])):
            t[block].copy_(part)


class PagedTarget:
    """``layers`` by index; ``slots``: by KV cache group, the first position held in a real block and the
    blocks and offsets from there to ``end``; ``jobs``: the layers it writes, whose places in the caches are
    found here, once, before the first write; ``rebuild(layer, hidden, positions)``: K/V rows from hidden
    states, for the H layers, whose ``positions`` are ``[start, end)``'s; ``states``: the recurrent layers, and
    ``state_blocks``, by group, the block that holds their state at ``end``."""

    def __init__(
        self,
        layers: dict[int, PagedLayer],
        slots: dict,
        jobs: list[LayerJob],
        end: int,
        kernel_block: int,
        rebuild: Callable | None = None,
        positions: torch.Tensor | None = None,
        start: int = 0,
        states: dict[int, StateLayer] | None = None,
        state_blocks: dict[int, int] | None = None,
    ):
        self.layers, self.rebuild, self.positions, self.start = layers, rebuild, positions, start
        self.states, self.state_blocks = states or {}, state_blocks or {}
        self._places: dict[tuple, Places] = {}
        for job in jobs:
            if job.state:
                continue
            layer = self.layers[job.layer]
            held, blocks, offsets = slots[layer.group]
            key = self._key(job)
            if key not in self._places:
                whole = (
                    (end - job.begin) // kernel_block if job.begin % kernel_block == 0 else 0
                )  # kernel blocks, from a block's start on
                self._places[key] = layer.layout.elements(
                    blocks[job.begin - held :], offsets[job.begin - held :], whole
                )

    def _key(self, job: LayerJob) -> tuple:
        layer = self.layers[job.layer]
        return id(layer.layout), layer.group, job.begin

    def write_kv(self, job: LayerJob, rows: StoredRows) -> None:
        layer = self.layers[job.layer]
        layer.layout.write(layer.cache, self._places[self._key(job)], rows.rows(job, rows.gather(job)))

    def write_hidden(self, job: LayerJob, hidden: torch.Tensor) -> None:
        layer = self.layers[job.layer]
        kv = self.rebuild(job.layer, hidden, self.positions[job.begin - self.start :])
        layer.layout.write(layer.cache, self._places[self._key(job)], kv)

    def write_state(self, job: LayerJob, rows: torch.Tensor) -> None:
        layer = self.states[job.layer]
        layer.write(self.state_blocks[layer.group], rows)

    @staticmethod
    def message(shared: ImageRows, slots: dict, first: int, end: int, jobs: list[LayerJob]) -> dict:
        """What the load process needs to write ``jobs``: plain data (numpy, not tensors: a pickled tensor
        would travel as a shared-memory handle the process cannot open)."""
        return {
            "starts": shared.starts,
            "entries": shared.entries,
            "first": first,
            "end": end,
            "slots": {g: (held, blocks.numpy(), offsets.numpy()) for g, (held, blocks, offsets) in slots.items()},
            "jobs": [(job.layer, job.method.value, job.chunks.start, job.chunks.stop, job.begin) for job in jobs],
        }

    @classmethod
    def received(
        cls, message: dict, arena: torch.Tensor, layers: dict[int, PagedLayer], kernel_block: int, scratch: Scratch
    ) -> tuple[PagedTarget, StoredRows, list[LayerJob]]:
        """The load process's side of :meth:`message`: its target over ``layers``, its rows over ``arena``,
        and its jobs."""
        slots = {
            g: (held, torch.from_numpy(blocks), torch.from_numpy(offsets))
            for g, (held, blocks, offsets) in message["slots"].items()
        }
        jobs = [
            LayerJob(index, Method(method), range(start, stop), begin)
            for index, method, start, stop, begin in message["jobs"]
        ]
        end = message["end"]
        shared = ImageRows(arena, message["starts"], message["entries"])
        dtype = next(iter(layers.values())).cache.dtype
        rows = StoredRows([], message["first"], end, None, dtype, scratch, shared)
        return cls(layers, slots, jobs, end, kernel_block), rows, jobs
