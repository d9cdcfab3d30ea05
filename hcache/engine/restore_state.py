"""A restore in progress, shared by both engines: what ``begin_restore`` computes once so that every
layer's primitive reuses it, and the cache writes of the KV, H and slot-copy paths, so each is written
once whichever engine owns the cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops import rotate_and_write
from ..ops.dequant_scatter import write_rows
from ..ops.paged_kv import copy_slots
from ..ops.quant import QuantRows
from ..ops.rope import Tables


@dataclass
class RestoreState:
    base: int  # the sequence's seen tokens when the restore began: position of its first restored token
    num_tokens: int
    slots: torch.Tensor  # flat cache slots of the restored rows, on the device
    tables: list[Tables | None]  # each layer's RoPE tables of the restored positions (:func:`layer_tables`)
    runs: list[tuple[int, int, int]]  # the slots as runs of consecutive slots (host ints: no readback)

    def write_projected(self, layer: int, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """H: ``layer``'s K/V projected from rows ``[start, start + len(k))``, rotated at their positions by the
        layer's RoPE, into ``cache``."""
        rows = slice(start, start + k.shape[0])
        tables = self.tables[layer]
        cos_sin = None if tables is None else (tables[0][rows], tables[1][rows])
        rotate_and_write(cache, self.slots[rows], k, v, cos_sin)

    def write_kv(
        self, cache: torch.Tensor, kv: torch.Tensor | QuantRows | Sequence[torch.Tensor | QuantRows], start: int
    ) -> None:
        """KV: saved rows (K rotated), one part or consecutive parts, into ``cache`` in one batched copy."""
        write_rows(cache, self.runs, self.slots, [kv] if isinstance(kv, (torch.Tensor, QuantRows)) else kv, start)

    def copy_from_slots(self, caches: list[torch.Tensor], src: torch.Tensor) -> None:
        """The first ``len(src)`` rows, every layer, from flat slots of held blocks (the GPU prefix cache's)."""
        copy_slots(caches, src, self.slots[: len(src)])
