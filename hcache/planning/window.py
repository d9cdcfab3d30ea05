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

The saver, the restore (both engines), the plan's costs and the accounting ask this module, and only it.
"""
from __future__ import annotations

from collections.abc import Callable

from ..model.spec import ModelSpec
from ..storage.chunk_key import CHUNK_TOKENS


def first_read(spec: ModelSpec, layer: int, length: int, block: int = 1) -> int:
    """The first chunk a restore of ``length`` tokens reads of ``layer``, in an engine of ``block``-token
    blocks: 0 for a full-attention layer."""
    return spec.attended_from(layer, length) // block * block // CHUNK_TOKENS


def saves(spec: ModelSpec, layer: int, chunk: int, end: int, block: int = 1) -> bool:
    """Whether a save of a sequence computed up to position ``end`` keeps ``layer``'s rows of chunk ``chunk``."""
    return chunk >= first_read(spec, layer, max(0, end - CHUNK_TOKENS), block)


def read_tokens(spec: ModelSpec, layer: int, start: int, length: int, block: int = 1) -> int:
    """Of the tokens ``start``..``length`` a restore loads, how many ``layer`` reads (whole chunks from its
    first read on, as stored)."""
    return max(0, length - max(start, first_read(spec, layer, length, block) * CHUNK_TOKENS))


def sliding_layers(spec: ModelSpec) -> list[int]:
    return [layer for layer in range(spec.num_layers) if spec.window(layer) is not None]


def usable(
    spec: ModelSpec, layers: list[int], first: int, n: int, end: Callable[[int], int], holds: Callable[[int, int], bool], block: int = 1
) -> int:
    """How many of ``n`` verified chunks (from the sequence's chunk ``first`` on) a restore may use: the most
    whose every sliding layer among ``layers`` finds its window stored. ``end(m)``: the length, from the
    sequence's start, a restore of ``m`` chunks reaches; ``holds(j, layer)``: whether chunk ``j`` (counted from
    ``first``) holds that layer's rows. Chunks before ``first`` are in the engine's cache already."""
    sliding = [layer for layer in layers if spec.window(layer) is not None]
    for m in range(n, 0, -1):
        if all(holds(j, layer) for layer in sliding for j in range(max(0, first_read(spec, layer, end(m), block) - first), m)):
            return m
    return 0
