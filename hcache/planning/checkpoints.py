"""Which positions keep a recurrent layer's state, the rule beside the window rule (:mod:`.window`), for the
saver and the restore alike.

A Mamba layer's state after a token stands for every token before it: a restore of a prefix needs that one
state, and none other. It is kept after the last token of every ``every``-th chunk (Jenga's rule, §"Mamba
Layer", in chunks: a state every ``every · 64`` tokens), in that chunk, under its checksums. A restore ends
only where such a state is stored and verified: a prefix of ``m`` chunks restores if it ends at the end of
chunk ``m - 1`` and that chunk holds the state of every recurrent layer the plan does not recompute. A
prefix that ends anywhere else (a chunk missing, bad or without its state, or a prompt that ends on a
chunk's end, whose last token is computed) ends at the last checkpoint before it instead; never a prefix
without its state.

An engine that has a state only where one of its steps ends (vLLM's align mode: a prefill step ends at its last
block boundary, past those between) keeps it only in a checkpoint chunk whose opening step ends at the chunk's
end (``at_step_end``); the other checkpoint chunks are stored without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..model.spec import ModelSpec
from ..storage.chunk_key import CHUNK_TOKENS


@dataclass(frozen=True)
class StateRule:
    """The rule for ``spec``: a state kept at the end of every ``every``-th chunk; ``at_step_end``: only where
    the step that opens the chunk ends there."""

    spec: ModelSpec
    every: int = 1
    at_step_end: bool = False

    def saves(self, chunk: int, end: int | None = None) -> bool:
        """Whether a save keeps the recurrent layers' state after chunk ``chunk`` (counted from 0), opened by a
        step that computes up to position ``end``."""
        return (chunk + 1) % self.every == 0 and (not self.at_step_end or end == (chunk + 1) * CHUNK_TOKENS)

    def usable(
        self, layers: Iterable[int], first: int, n: int, end: Callable[[int], int], holds: Callable[[int, int], bool]
    ) -> int:
        """How many of ``n`` verified chunks (from the sequence's chunk ``first`` on) a restore whose stored
        layers are ``layers`` may use: the most that end on a chunk's end holding each recurrent layer's state.
        ``end(m)``: the length a restore of ``m`` chunks reaches; ``holds(j, layer)``: whether chunk ``j``
        (counted from ``first``) holds the layer's state. All ``n`` if no layer of ``layers`` is recurrent."""
        recurrent = [layer for layer in layers if self.spec.is_recurrent(layer)]
        if not recurrent:
            return n
        for m in range(n, 0, -1):
            if end(m) == (first + m) * CHUNK_TOKENS and all(holds(m - 1, layer) for layer in recurrent):
                return m
        return 0
