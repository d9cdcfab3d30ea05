"""The prefix a router finds cached from KV cache events, taken as vLLM takes a hit over its KV cache groups
(vllm/v1/core/kv_cache_coordinator.py, ``HybridKVCacheCoordinator.find_longest_cache_hit``, and each kind's
manager in single_type_kv_cache_manager.py): full attention, the longest prefix of cached blocks; a sliding
window, the last run of ``ceil((window - 1) / block)`` cached blocks (or a run from the start); a Mamba
state, the last cached block; every group's answer taken again at the shortest until all agree. Pure: no
vLLM, no torch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

SLIDING = ("sliding_window", "sliding_window_mla")


def vllm_hit(
    cached: Callable[[int, object], bool],
    groups: Sequence[tuple[int, str | None, int | None, int]],
    hashes: Sequence[object],
    hash_block: int,
    length: int,
) -> int:
    """The tokens of a prompt found cached: ``cached(group, hash)`` says whether a group holds a block;
    ``groups``: each group's index, kind, window and block size; ``hashes``: the prompt's block hashes at
    ``hash_block`` (a group's block is named by the last it ends with); ``length``: at most so many tokens
    (vLLM's: the prompt's all but the last)."""
    align = math.lcm(*(size for *_, size in groups))
    hit = min(length, len(hashes) * hash_block) // align * align
    while True:
        found = min(_group_hit(cached, group, hashes, hash_block, hit) for group in groups) // align * align
        if found == hit:
            return hit
        hit = found


def _group_hit(cached, group, hashes, hash_block: int, length: int) -> int:
    index, kind, window, size = group
    present = [cached(index, hashes[(i + 1) * size // hash_block - 1]) for i in range(length // size)]
    if kind == "mamba":
        return next(((i + 1) * size for i in reversed(range(len(present))) if present[i]), 0)
    if kind in SLIDING:
        need, run = -(-(window - 1) // size), 0
        for i in reversed(range(len(present))):
            run = run + 1 if present[i] else 0
            if run >= need:
                return (i + run) * size
        return run * size
    return next((i * size for i, held in enumerate(present) if not held), len(present) * size)
