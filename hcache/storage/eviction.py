"""Which cached chunk to give up first: the one policy rule of the host tier and the GPU prefix cache.

- ``"lru"``: the least recently used.
- ``"cost"``: the least retention value (Pensieve, EuroSys '25, §4.3.1), ``value / size / idle``: what
  keeping the chunk saves (its owner's opaque number, such as the seconds a recompute of it would take,
  which grow with its depth in a conversation: attention over a longer context), per byte it holds, over
  the seconds since its last use. Cheap, large and long-idle chunks go first; ties go to the least
  recently used, so chunks of equal value are evicted as LRU would.

Mechanism stays with the caches: they say which entries may go (not pinned, and for the GPU prefix cache
not the prefix of another cached entry) and in what recency order; this module only picks among them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TypeVar

POLICIES = ("cost", "lru")
# Idle times below this count as this: a chunk used this instant is not infinitely valuable, and the
# clock's resolution cannot tell uses closer than this apart anyway.
MIN_IDLE_S = 1e-3

K = TypeVar("K")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    return policy


def retention(value: float, size: int, idle_s: float) -> float:
    """Pensieve's retention value per byte: what keeping ``size`` bytes saves, over ``idle_s`` seconds idle."""
    return value / max(size, 1) / max(idle_s, MIN_IDLE_S)


def victim(policy: str, candidates: Iterable[tuple[K, float, int, float]], now: float) -> K | None:
    """The key to evict among ``candidates``, ``(key, value, size, last_used)`` least recently used first
    (None if there are none): the first for ``"lru"``, the least retention value for ``"cost"``."""
    if policy == "lru":
        return next((key for key, *_ in candidates), None)
    best, least = None, float("inf")
    for key, value, size, last_used in candidates:
        score = retention(value, size, now - last_used)
        if score < least:
            best, least = key, score
    return best


VALUES_KEPT = 1 << 16


class Values:
    """The values callers gave chunks, by key (the latest ``kept``), so a chunk that leaves a cache and comes
    back without its caller saying it again (a host-pool chunk evicted, later loaded from disk) keeps its
    value. A chunk never valued (saved before a restart, or by another node) gets the mean of those kept:
    neutral, so that its recency decides. Not thread-safe: its owner holds a lock."""

    def __init__(self, kept: int = VALUES_KEPT):
        self.kept, self._values, self._sum = kept, OrderedDict(), 0.0

    def set(self, key: str, value: float) -> None:
        self._sum += value - self._values.pop(key, 0.0)
        self._values[key] = value
        if len(self._values) > self.kept:
            self._sum -= self._values.popitem(last=False)[1]

    def get(self, key: str) -> float:
        found = self._values.get(key)
        return found if found is not None else self._sum / len(self._values) if self._values else 0.0
