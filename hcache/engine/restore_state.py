"""A restore in progress, shared by both engines: what ``begin_restore`` computes once so that every
layer's primitive reuses it, and the cache writes of the KV, H and slot-copy paths, so each is written
once whichever engine owns the cache. KV rows are written through the one paged writer
(:meth:`~hcache.ops.paged_layout.PagedLayout.write`), in the engines' flat layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops import rotate_and_write
from ..ops.paged_kv import copy_slots
from ..ops.paged_layout import PagedLayout, Places
from ..ops.quant import QuantRows
from ..ops.rope import Tables


@dataclass
class RestoreState:
    base: int  # the sequence's seen tokens when the restore began: position of its first restored token
    num_tokens: int
    tables: list[Tables | None]  # each layer's RoPE tables of the restored positions (:func:`layer_tables`)
    layout: PagedLayout  # the engine's cache's (:meth:`PagedLayout.blocked`)
    tokens: tuple[np.ndarray, np.ndarray]  # each restored row's block and offset in it (:func:`block_positions`)
    _places: dict[int, Places] = field(default_factory=dict)

    def __post_init__(self):
        # the slots are copied to the device here, in ``begin_restore``, on the caller's stream: a layer's
        # places from another row on are views of them, found on whichever stream writes the layer
        self._places[0] = self.layout.elements(*self.tokens)

    def places(self, start: int) -> Places:
        """Where rows ``[start, num_tokens)`` go."""
        places = self._places.get(start)
        if places is None:
            places = self._places[start] = self._places[0].tail(start)
        return places

    def write_projected(self, layer: int, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """H: ``layer``'s K/V projected from rows ``[start, start + len(k))``, rotated at their positions by the
        layer's RoPE, into ``cache``."""
        rows = slice(start, start + k.shape[0])
        tables = self.tables[layer]
        cos_sin = None if tables is None else (tables[0][rows], tables[1][rows])
        rotate_and_write(cache, self.places(start).slots[: k.shape[0]], k, v, cos_sin)

    def write_kv(
        self, cache: torch.Tensor, kv: torch.Tensor | QuantRows | Sequence[torch.Tensor | QuantRows], start: int
    ) -> None:
        """KV: saved rows (K rotated) from row ``start`` on, one part or consecutive parts, into ``cache``."""
        self.layout.write(cache, self.places(start), kv)

    def copy_from_slots(self, caches: list[torch.Tensor], src: torch.Tensor) -> None:
        """The first ``len(src)`` rows, every layer, from flat slots of held blocks (the GPU prefix cache's)."""
        copy_slots(caches, src, self.places(0).slots[: len(src)])
