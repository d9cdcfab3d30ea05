"""What the host tier needs from a store of chunk files behind it; a store knows nothing of models.

A store moves whole chunk images between itself and host-pool slots: one request per chunk. Implementations:
:class:`~hcache.storage.disk_store.DiskChunkStore` (chunk files over several directories, private to a
process or shared by nodes over one filesystem) and :class:`~hcache.storage.redis_store.RedisChunkStore`
(a Redis server or cluster shared by nodes).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


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
        ``take`` gives no buffer). Raises OSError when it cannot be read."""

    def names(self, key: str) -> frozenset[str] | None:
        """The tensor names the stored chunk holds, or None if it is absent or unreadable."""

    def put(self, key: str, data: memoryview, length: int | None = None) -> None:
        """Publish ``data[:length]`` atomically, replacing any chunk of that key. Raises OSError when it
        cannot be stored; nothing is then published."""

    def discard(self, key: str) -> None: ...

    def evicted(self, key: str) -> bool:
        """Whether this store evicted the chunk lately (quota, TTL or LRU), as far as it knows: why a
        look-up misses it. A store that others evict from (Redis, a shared directory) may not know."""

    @property
    def available(self) -> bool:
        """False while the store is failing (its look-ups answer "absent"): why a look-up may miss."""

    def keys(self) -> list[str]: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...
