"""What the restore path and the saver need from a store of chunks; the store knows nothing of models.

Implementations: :class:`~hcache.storage.disk_store.DiskChunkStore` (chunk files over several
directories) and :class:`~hcache.storage.dram_tier.DramTier` (a bounded DRAM tier in front of it).
"""
from __future__ import annotations

from typing import BinaryIO, Protocol


class ChunkStore(Protocol):
    bytes_written: int

    def contains(self, key: str) -> bool: ...

    def open(self, key: str) -> BinaryIO | None:
        """The chunk's bytes as a seekable binary file (the caller closes it), or None if absent. The
        chunk is not evicted while the file is open. Files may be used from several threads at once, one
        thread per file."""

    def put(self, key: str, data: bytes) -> None:
        """Publish a chunk atomically. Raises OSError when it cannot be stored; nothing is then published."""

    def discard(self, key: str) -> None: ...

    def keys(self) -> list[str]: ...
