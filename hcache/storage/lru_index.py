"""The stores' recency order and capacity policy: sizes, recency, pins, TTL and quota.

Entries are kept in least-recently-used order. A chunk that is pinned is never chosen for eviction; a chunk
unused for longer than the TTL is expired. An entry that names a parent (the chunk before it in its
chain) holds it: quota eviction never takes a parent before every entry that names it, since those are
unreachable without it. The disk store evicts by its quota (:meth:`LruIndex.make_room`),
its pins counted in :attr:`Entry.pins` (a read or a write in flight); the host tier evicts when its pool has
no room (:meth:`LruIndex.pop_victim`, by the index's :mod:`~.eviction` policy), a chunk pinned while its slot
is referenced (``pinned``). Not thread-safe by itself: its owner holds a lock around every call.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .eviction import check_policy, victim


@dataclass
class Entry:
    size: int
    last_used: float
    where: Any  # where the owner keeps the chunk (the disk store: a directory index; the host tier: its image)
    pins: int = 0
    stamped: float = 0.0  # the last use the owner recorded where a restart finds it (the disk store: the file time)
    value: float = 0.0  # what keeping it saves, the owner's opaque number (cost-aware eviction: :mod:`.eviction`)
    parent: str = ""  # the key of the chunk before it in its chain, kept while this one is


def _has_pins(entry: Entry) -> bool:
    return entry.pins > 0


class LruIndex:
    """``quota_bytes``, ``ttl_s``: None for none. ``pinned``: whether an entry may not be evicted now (by
    default, whether it has pins). ``policy``: what :meth:`pop_victim` gives up first (:mod:`.eviction`)."""

    def __init__(
        self,
        quota_bytes: int | None = None,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        pinned: Callable[[Entry], bool] = _has_pins,
        policy: str = "lru",
    ):
        self.quota_bytes, self.ttl_s, self.clock, self.pinned = quota_bytes, ttl_s, clock, pinned
        self.policy = check_policy(policy)
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.used_bytes = 0
        self._children: Counter[str] = Counter()  # how many entries name each key as their parent

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def expired(self, entry: Entry) -> bool:
        return self.ttl_s is not None and not self.pinned(entry) and self.clock() - entry.last_used > self.ttl_s

    def touch(self, key: str) -> Entry:
        entry = self.entries[key]
        entry.last_used = self.clock()
        self.entries.move_to_end(key)
        return entry

    def add(self, key: str, entry: Entry) -> None:
        """Insert as most recently used; ``entry.last_used`` may be older (start-up), order is by call."""
        self.remove(key)
        self.entries[key] = entry
        self.used_bytes += entry.size
        if entry.parent:
            self._children[entry.parent] += 1

    def add_in_age_order(self, items: list[tuple[str, Entry]]) -> None:
        for key, entry in sorted(items, key=lambda item: item[1].last_used):
            self.add(key, entry)

    def remove(self, key: str) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.size
            if entry.parent:
                self._children[entry.parent] -= 1
                if not self._children[entry.parent]:
                    del self._children[entry.parent]
        return entry

    def fits(self, size: int) -> bool:
        return self.quota_bytes is None or size <= self.quota_bytes

    def make_room(self, size: int, replacing: str | None = None, parent: str = "") -> list[tuple[str, Entry]] | None:
        """Remove and return the entries to evict so ``size`` more bytes fit: the expired ones, then the
        least recently used unpinned ones, each parent after the entries that name it; the entry to come
        names ``parent``, so that chain is kept whole (evicting it would leave the new one unreachable).
        None (and nothing removed) if pinned chunks and that chain leave too little. Both kinds sit at the
        front of the LRU order, so the scan stops at the first entry it may keep. A parent passed over for
        its children is older than the scan's point, so it goes as soon as the last of them has gone."""
        freed = self.entries[replacing].size if replacing in self.entries else 0
        victims: list[str] = []
        held: dict[str, bool] = {}  # parents passed over for their children: whether they had expired
        taken: Counter[str] = Counter()  # of each parent's children, how many are victims
        ready: deque[str] = deque()  # parents passed over whose children are all victims now

        def over() -> bool:
            return self.quota_bytes is not None and self.used_bytes - freed + size > self.quota_bytes

        def children(key: str) -> int:  # entries that name ``key``, and the one to come
            return self._children[key] + (key == parent)

        def take(key: str, entry: Entry) -> None:
            nonlocal freed
            victims.append(key)
            freed += entry.size
            if entry.parent:
                taken[entry.parent] += 1
                if entry.parent in held and taken[entry.parent] == children(entry.parent):
                    ready.append(entry.parent)

        def take_ready() -> None:
            while ready:
                key = ready.popleft()
                if held[key] or over():
                    take(key, self.entries[key])

        now = self.clock()
        for key, entry in self.entries.items():
            take_ready()
            stale = self.ttl_s is not None and now - entry.last_used > self.ttl_s
            if not stale and not over():
                break
            if self.pinned(entry) or key == replacing:
                continue
            if children(key) > taken[key]:
                held[key] = stale
                continue
            take(key, entry)
        take_ready()
        if over():
            return None
        return [(key, self.remove(key)) for key in victims]

    def pop_victim(self) -> tuple[str, Entry] | None:
        """Remove and return the unpinned entry the policy gives up first; None if every one is pinned."""
        idle = ((key, e.value, e.size, e.last_used) for key, e in self.entries.items() if not self.pinned(e))
        key = victim(self.policy, idle, self.clock())
        return None if key is None else (key, self.remove(key))

    def remove_unpinned(self) -> list[tuple[str, Entry]]:
        """Remove and return every entry that is not pinned, least recently used first."""
        idle = [key for key, entry in self.entries.items() if not self.pinned(entry)]
        return [(key, self.remove(key)) for key in idle]
