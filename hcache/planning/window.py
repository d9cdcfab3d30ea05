"""Jenga's rule per layer type, in chunks: which of a sequence's chunks each layer keeps and reads.

A full-attention layer attends to every position before it, so it stores and restores every chunk. A
sliding-window layer attends to its last ``window`` positions only (:meth:`ModelSpec.attended_from`):

- **Restore.** A prefix of ``length`` tokens loads, for a sliding layer, only the chunks that reach
  ``attended_from(layer, length)``; the positions before are never attended again, and stay unwritten. An
  engine that holds a sliding layer's positions in whole blocks of ``block`` tokens (vLLM: from the block
  holding the first position attended, the blocks before it its null block) has the window's first block
  written whole: the rule reads from that block's first position.
- **Save.** A save of a sequence computed up to ``end`` keeps a sliding layer's rows of the chunks a restore
  ending anywhere in the last chunk before ``end`` reads: a returning turn restores to the end of the last
  full chunk of its history (or one token short of its prompt), which every save of that history covered.
  Rows further back are not stored: a conversation that branches more than a window before its end finds
  its sliding layers' state missing, and restores a shorter prefix (:func:`usable`) or recomputes.

``sliding_layers="all"`` turns the rule off: sliding-window layers store and restore every token, as
full-attention layers (:attr:`WindowRule.every_token`). The saver, the restore (both engines), the plan's
costs and the accounting ask one :class:`WindowRule`, and only it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..model.spec import ModelSpec
from ..storage.chunk_key import CHUNK_TOKENS


@dataclass(frozen=True)
class WindowRule:
    """The rule for ``spec`` in an engine of ``block``-token KV blocks; ``every_token``: the rule off."""

    spec: ModelSpec
    block: int = 1
    every_token: bool = False

    def window(self, layer: int) -> int | None:
        """The window the rule keeps of ``layer``: None for every token."""
        return None if self.every_token else self.spec.window(layer)

    def first_read(self, layer: int, length: int) -> int:
        """The first chunk a restore of ``length`` tokens reads of ``layer``: 0 for a full-attention layer."""
        if self.window(layer) is None:
            return 0
        return self.spec.attended_from(layer, length) // self.block * self.block // CHUNK_TOKENS

    def saves(self, layer: int, chunk: int, end: int) -> bool:
        """Whether a save of a sequence computed up to position ``end`` keeps ``layer``'s rows of ``chunk``."""
        return chunk >= self.first_read(layer, max(0, end - CHUNK_TOKENS))

    def read_tokens(self, layer: int, start: int, length: int) -> int:
        """Of the tokens ``start``..``length`` a restore loads, how many ``layer`` reads (whole chunks from
        its first read on, as stored)."""
        return max(0, length - max(start, self.first_read(layer, length) * CHUNK_TOKENS))

    def usable(
        self, layers: list[int], first: int, n: int, end: Callable[[int], int], holds: Callable[[int, int], bool]
    ) -> int:
        """How many of ``n`` verified chunks (from the sequence's chunk ``first`` on) a restore may use: the
        most whose every sliding layer among ``layers`` finds its window stored. ``end(m)``: the length,
        from the sequence's start, a restore of ``m`` chunks reaches; ``holds(j, layer)``: whether chunk
        ``j`` (counted from ``first``) holds that layer's rows. Chunks before ``first`` are in the engine's
        cache already."""
        sliding = [layer for layer in layers if self.window(layer) is not None]
        for m in range(n, 0, -1):
            if all(
                holds(j, layer) for layer in sliding for j in range(max(0, self.first_read(layer, end(m)) - first), m)
            ):
                return m
        return 0

    @property
    def sliding_layers(self) -> list[int]:
        return [layer for layer in range(self.spec.num_layers) if self.window(layer) is not None]
