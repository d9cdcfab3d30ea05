"""What the host tier needs from a store of chunk files behind it; a store knows nothing of models.

A store moves whole chunk images between itself and host-pool slots: one request per chunk. Implementations:
:class:`~hcache.storage.disk_store.DiskChunkStore` (chunk files over several directories, private to a
process or shared by nodes over one filesystem) and :class:`~hcache.storage.redis_store.RedisChunkStore`
(a Redis server or cluster shared by nodes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # the chunk format needs torch; a process that only asks what is stored (vLLM's scheduler) need not
    from .chunk import ChunkLayout


class Loss(str, Enum):
    """Why a store no longer holds a chunk it held, as far as it knows (a look-up's miss reason)."""

    EVICTED = "evicted"  # by its quota, TTL or LRU, or deleted by someone else
    FAILED_VERIFICATION = (
        "failed_verification"  # its file failed a check: at start-up, on a read, or its length changed
    )


class Sight(str, Enum):
    """What a follower of a store can be told of the changes to what it holds (:meth:`ChunkStore.watch`)."""

    OWN = "own"  # no one else changes it: this node's writes and its own losses are every change
    ALL = "all"  # it tells every change, this node's writes too, in its own order
    NONE = "none"  # others change it unseen: what it holds cannot be told


Why = TypeVar("Why")


class LossLog(Generic[Why]):
    """The latest ``kept`` keys lost and why, oldest first: what tells a lost chunk's miss from a never
    stored one's, in bounded memory. Not thread-safe by itself."""

    def __init__(self, kept: int = 1 << 14):
        self.kept = kept
        self._why: OrderedDict[str, Why] = OrderedDict()
        self.listeners: list[Callable[[str, Why], None]] = []  # told of each loss as it is added

    def add(self, key: str, why: Why) -> None:
        for listener in self.listeners:
            listener(key, why)
        self._why[key] = why
        self._why.move_to_end(key)
        if len(self._why) > self.kept:
            self._why.popitem(last=False)

    def pop(self, key: str) -> None:
        self._why.pop(key, None)

    def get(self, key: str) -> Why | None:
        return self._why.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._why

    def __iter__(self) -> Iterator[tuple[str, Why]]:
        return iter(list(self._why.items()))


class ChunkStore(Protocol):
    name: str  # where it is, for messages
    kind: str  # what it is, for counters: disk, shared_disk or redis

    def contains(self, key: str) -> bool: ...

    def contains_many(self, keys: list[str]) -> list[bool]:
        """``contains`` of each key, in one round trip where the store is remote."""

    def touch(self, keys: list[str]) -> None:
        """Count a use of these chunks served by a tier above (LRU, TTL), in one round trip where the store
        is remote; keys it does not hold are ignored."""

    def read_into(self, key: str, take: Callable[[int], memoryview | None]) -> int | None:
        """Read the chunk's whole image into ``take(size)`` and return ``size``; None if absent (or if
        ``take`` gives no buffer). A store may call ``take`` again, for a chunk found to have another size
        as it is read; the last buffer holds it. Raises OSError when it cannot be read."""

    def header(self, key: str) -> tuple[ChunkLayout, dict] | None:
        """The stored chunk's layout and metadata, from its header checked against its length; None if it is
        absent, unreadable or damaged."""

    def put(self, key: str, data: memoryview, length: int | None = None, parent: str = "") -> None:
        """Publish ``data[:length]`` atomically, replacing any chunk of that key; ``parent``: the chunk before
        it in its chain, which a store that evicts keeps at least as long. Raises OSError when it cannot be
        stored; nothing is then published."""

    def pin(self, keys: list[str]) -> list[object | None]:
        """Hold each stored chunk of ``keys`` against this store's own evictions (its quota, its TTL) until
        :meth:`unpin`: a pin each, None where the chunk is not stored. A store that others evict from (Redis)
        holds nothing; its pin says only that the chunk was stored."""

    def unpin(self, pins: list[object]) -> None:
        """Let go of pins :meth:`pin` gave."""

    def discard(self, key: str) -> None:
        """Delete a chunk found bad (remembered as such: :meth:`gone`)."""

    def gone(self, key: str) -> Loss | None:
        """Why this store no longer holds the chunk, if it lost it lately and knows: why a look-up misses
        it. A store that others evict from (Redis, a shared directory) may not know."""

    def losses(self) -> list[tuple[str, Loss]]:
        """The chunks it lost lately and why, oldest first (for an index kept by another process)."""

    def follow(self, lost: Callable[[str, Loss], None]) -> None:
        """Call ``lost(key, why)`` for each chunk it loses from now on, as far as it knows (with its lock held:
        only note it)."""

    def watch(
        self, stored: Callable[[str, tuple[ChunkLayout, dict]], None], lost: Callable[[str, Loss | None], None]
    ) -> Sight:
        """Follow the changes anyone makes, where the store has others that change it and can tell them:
        ``stored(key, header)`` for a chunk written (its layout and metadata), ``lost(key, why)`` for one that
        left, from a thread of the store's own, from now on. What it will tell (:class:`Sight`)."""

    @property
    def available(self) -> bool:
        """False while the store is failing (its look-ups answer "absent"): why a look-up may miss."""

    def keys(self) -> list[str]: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...
