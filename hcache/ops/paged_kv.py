"""Reads and writes of the paged (blocked) KV cache in DeepSpeed-FastGen's layout.

One layer's cache is ``[num_blocks, block_size, 2, n_kv_heads, head_size]``; index 0 of dim 2 is K, 1 is V.
A sequence owns a list of blocks (its block table); token ``p`` of it lives in slot
``table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` for a sequence whose blocks are ``block_table``."""
    return block_table[positions // block_size] * block_size + positions % block_size


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter ``k`` and ``v`` ``[T, n_kv_heads, head_size]`` into ``slots`` ``[T]`` of one layer's cache."""
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots, 0] = k.to(cache.dtype)
    flat[slots, 1] = v.to(cache.dtype)


def read_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[T, 2, n_kv_heads, head_size]`` (a copy; K then V) at ``slots`` ``[T]``: what :func:`write_kv` wrote
    there, in one gather."""
    return cache.view(-1, *cache.shape[2:])[slots]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length, n_kv_heads, head_size]`` of the first ``length`` tokens of one sequence."""
    n_blocks = -(-length // cache.shape[1])
    kv = cache[block_table[:n_blocks]].flatten(0, 1)[:length]
    return kv[:, 0], kv[:, 1]


def flat_slots(blocks: list[int], lo: int, hi: int, block_size: int, device: torch.device | str) -> torch.Tensor:
    """Flat cache slots of rows ``[lo, hi)`` of ``blocks`` read as one run of tokens (:func:`block_slots`)."""
    blocks_of, offsets = block_slots([(blocks, lo, hi)], block_size, block_size)
    return (blocks_of * block_size + offsets).to(device)


def block_positions(
    spans: list[tuple[list[int], int, int]], block_size: int, kernel_block: int
) -> tuple[np.ndarray, np.ndarray]:
    """The cache blocks and offsets in them of positions ``[start, end)`` of each request in ``spans``
    (``(block_ids, start, end)``: it holds ``block_ids``, blocks of ``block_size`` tokens), one request after
    another: vLLM may split its blocks into smaller kernel blocks of ``kernel_block`` tokens, which the cache
    tensors hold. The same few operations for a step's requests, however many (a decode step's each take
    one token), in numpy: on a step's few indices a numpy call costs a microsecond, a torch call ten."""
    ids, first_block, first, rows = [], [], [], []  # per request: where its block ids and positions begin
    total = 0
    for block_ids, start, end in spans:
        first_block.append(len(ids))
        ids += block_ids
        first.append(start)
        rows.append(total)
        total += end - start
    row_of = np.array(rows, dtype=np.int64)
    index = np.arange(total, dtype=np.int64)
    request = np.searchsorted(row_of, index, side="right") - 1  # each position's request (past any that has none)
    positions = index - row_of[request] + np.array(first, dtype=np.int64)[request]
    blocks = np.array(ids, dtype=np.int64)[positions // block_size + np.array(first_block, dtype=np.int64)[request]]
    within = positions % block_size
    return blocks * (block_size // kernel_block) + within // kernel_block, within % kernel_block


def block_slots(
    spans: list[tuple[list[int], int, int]], block_size: int, kernel_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_positions` as tensors, on the host."""
    blocks, offsets = block_positions(spans, block_size, kernel_block)
    return torch.from_numpy(blocks), torch.from_numpy(offsets)


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """``(first row, first slot, length)`` of each run of consecutive slots in ``slots`` (a row's each): a run
    ends where the next row's slot does not follow. Found on the host, from slots computed there from a
    block table, so a restore never reads slots back from the device."""
    if not len(slots):
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(slots) != 1) + 1))
    lengths = np.diff(np.append(starts, len(slots)))
    return list(zip(starts.tolist(), slots[starts].tolist(), lengths.tolist()))


def row_spans(runs: list[tuple[int, int, int]], lengths: Sequence[int], start: int):
    """``(part, first row in it, first slot, rows)`` of each overlap of consecutive parts of ``lengths`` rows,
    placed at rows ``[start, ...)`` of a restore whose slots are ``runs`` (:func:`slot_runs`)."""
    i = bisect.bisect_right(runs, (start, float("inf"), 0)) - 1
    for p, part_length in enumerate(lengths):
        done = 0
        while done < part_length:
            row, slot, length = runs[i]
            n = min(row + length - start, part_length - done)
            yield p, done, slot + start - row, n
            done, start = done + n, start + n
            if start == row + length:
                i += 1


def write_kv_rows(
    cache: torch.Tensor, runs: list[tuple[int, int, int]], parts: Sequence[torch.Tensor], start: int
) -> None:
    """Copy stored rows ``[T, 2, n_kv_heads, head_size]`` (K rotated, the cache's own row layout), given as
    consecutive ``parts`` (a chunk's rows each), into rows ``[start, start + T)`` of a restore whose slots
    are ``runs`` (:func:`slot_runs`): one batched call for the layer, one copy per (part, run) overlap,
    asynchronous from pinned host memory to a GPU."""
    flat = cache.view(-1, *cache.shape[2:])
    dst, src = [], []
    for p, offset, slot, n in row_spans(runs, [part.shape[0] for part in parts], start):
        dst.append(flat[slot : slot + n])
        src.append(parts[p][offset : offset + n])
    if dst:
        torch._foreach_copy_(dst, src, non_blocking=True)


def copy_slots(caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's K/V from flat slots ``src`` ``[T]`` to ``dst`` ``[T]`` (disjoint): one gather and one
    scatter per layer, on the device, however the slots are scattered over blocks."""
    for cache in caches:
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, dst, flat.index_select(0, src))
