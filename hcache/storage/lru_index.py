"""The stores' recency order and capacity policy: sizes, recency, pins, TTL and quota.

Entries are kept in least-recently-used order. A chunk that is pinned is never chosen for eviction; a chunk
unused for longer than the TTL is expired. An entry that names a parent (the chunk before it in its
chain) holds it: quota eviction takes a parent only after every entry that names it, since those are
unreachable without it, unless they are pinned and nothing else makes room. A parent comes from a chunk's
header, which may be damaged or hostile, so it is trusted only when it names another, older entry and
closes no cycle (a cycle could never be evicted child first): the parents are a forest, and every chain
that is not pinned can be evicted. The disk store evicts by its quota (:meth:`LruIndex.make_room`),
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
    parent: str = ""  # the key of the chunk before it in its chain, kept while this one is ("" if not trusted)


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
        """Insert as most recently used; ``entry.last_used`` may be older (start-up), order is by call. Its
        parent is kept only if it is another entry that does not descend from ``key`` (``entry.parent`` is
        cleared otherwise): walking up from it costs a chain's length, and only when an entry names ``key``."""
        parent = self._insert(key, entry)
        if parent in self.entries and not self._descends(parent, key):
            self._link(key, parent)

    def add_in_age_order(self, items: list[tuple[str, Entry]]) -> None:
        """A start-up's entries: their parents are linked once all are in, since a parent is the more
        recently used and comes later, then each cycle the links make is cut once, in one pass over them."""
        items = sorted(items, key=lambda item: item[1].last_used)
        parents = [self._insert(key, entry) for key, entry in items]
        for (key, _), parent in zip(items, parents):
            if parent in self.entries and parent != key:
                self._link(key, parent)
        done: set[str] = set()
        for start in self.entries:
            path: dict[str, None] = {}  # the walk up from ``start``, in order
            key = start
            while key in self.entries and key not in done and key not in path:
                path[key] = None
                key = self.entries[key].parent
            if key in path:  # the walk came back to ``key``: cut the link that closed the cycle
                self._unlink(next(reversed(path)))
            done.update(path)

    def _insert(self, key: str, entry: Entry) -> str:
        """Put ``entry`` in as most recently used, unlinked; return the parent it named."""
        parent = entry.parent
        self.remove(key)
        entry.parent = ""
        self.entries[key] = entry
        self.used_bytes += entry.size
        return parent

    def _descends(self, key: str, ancestor: str) -> bool:
        """Whether ``key`` is ``ancestor`` or an entry after it in its chain."""
        if not self._children[ancestor]:  # nothing names it: no chain goes on from it
            return key == ancestor
        while key and key != ancestor:
            entry = self.entries.get(key)
            key = entry.parent if entry is not None else ""
        return key == ancestor

    def _link(self, key: str, parent: str) -> None:
        self.entries[key].parent = parent
        self._children[parent] += 1

    def _unlink(self, key: str) -> None:
        entry = self.entries[key]
        if entry.parent:
            self._children[entry.parent] -= 1
            if not self._children[entry.parent]:
                del self._children[entry.parent]
            entry.parent = ""

    def remove(self, key: str) -> Entry | None:
        if key not in self.entries:
            return None
        self._unlink(key)
        entry = self.entries.pop(key)
        self.used_bytes -= entry.size
        return entry

    def resize(self, key: str, size: int) -> None:
        """The entry's chunk is ``size`` bytes now (its file changed behind its owner's back)."""
        entry = self.entries[key]
        self.used_bytes += size - entry.size
        entry.size = size

    def fits(self, size: int) -> bool:
        return self.quota_bytes is None or size <= self.quota_bytes

    def make_room(self, size: int, replacing: str | None = None, parent: str = "") -> list[tuple[str, Entry]] | None:
        """Remove and return the entries to evict so ``size`` more bytes fit: the expired ones, then the
        least recently used unpinned ones, each parent after the entries that name it; the entry to come
        names ``parent``, so that chain is kept whole (evicting it would leave the new one unreachable).
        Both kinds sit at the front of the LRU order, so the scan stops at the first entry it may keep. A
        parent passed over for its children is older than the scan's point, so it goes as soon as the last
        of them has gone. If that is not enough, chains held by a pinned entry go from it up, each parent
        as if that entry had gone: a read in flight must not refuse every put. None (and nothing removed)
        if pinned entries and the chain to come still leave too little."""
        freed = self.entries[replacing].size if replacing in self.entries else 0
        victims: list[str] = []
        held: dict[str, bool] = {}  # parents passed over for their children: whether they had expired
        taken: Counter[str] = Counter()  # of each parent's children, how many are victims
        ready: deque[str] = deque()  # parents passed over whose children are all victims now

        def over() -> bool:
            return self.quota_bytes is not None and self.used_bytes - freed + size > self.quota_bytes

        def children(key: str) -> int:  # entries that name ``key``, and the one to come
            return self._children[key] + (key == parent)

        def release(key: str) -> None:  # a child of ``key`` is a victim, or counts as one
            taken[key] += 1
            if key in held and taken[key] == children(key):
                ready.append(key)

        def take(key: str, entry: Entry) -> None:
            nonlocal freed
            victims.append(key)
            freed += entry.size
            if entry.parent:
                release(entry.parent)

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
            keep, key = set(), parent  # the chain to come
            while key in self.entries:
                keep.add(key)
                key = self.entries[key].parent
            for key, entry in self.entries.items():
                if entry.parent and key not in keep and (self.pinned(entry) or key == replacing):
                    release(entry.parent)
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
