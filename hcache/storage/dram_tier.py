"""A host-DRAM tier in front of a disk store, as in AttentionStore: recent chunks are served from memory.

Writes go through to the backing store (so a crash loses nothing the disk had) and stay in DRAM; a read
that misses loads the whole chunk from the backing store into DRAM once. DRAM is bounded by
``capacity_bytes`` with LRU eviction. A file handed out from DRAM holds a reference to the chunk's bytes,
so evicting a chunk from DRAM never disturbs a restore that is reading it; the backing store pins its own
copy while such a read from disk is in progress.
"""
from __future__ import annotations

import io
import threading
import time

from .chunk_store import ChunkStore
from .lru_index import Entry, LruIndex


class DramTier:
    def __init__(self, backing: ChunkStore, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"DRAM tier capacity must be positive, not {capacity_bytes}")
        self.backing = backing
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._index = LruIndex(capacity_bytes, None, time.monotonic)

    @property
    def bytes_written(self) -> int:
        return self.backing.bytes_written

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self.backing.contains(key)

    def open(self, key: str) -> io.BytesIO | None:
        with self._lock:
            if key in self._index:
                self.hits += 1
                return io.BytesIO(self._index.touch(key).where)
            self.misses += 1
        file = self.backing.open(key)
        if file is None:
            return None
        with file:
            data = file.read()
        self._keep(key, data)
        return io.BytesIO(data)

    def put(self, key: str, data: bytes) -> None:
        self.backing.put(key, data)  # first, so DRAM never holds a chunk the disk refused
        self._keep(key, bytes(data))

    def discard(self, key: str) -> None:
        with self._lock:
            self._index.remove(key)
        self.backing.discard(key)

    def keys(self) -> list[str]:
        return self.backing.keys()

    def _keep(self, key: str, data: bytes) -> None:
        with self._lock:
            if not self._index.fits(len(data)):
                return
            self._index.make_room(len(data), replacing=key)  # nothing is pinned in DRAM, so it always fits
            self._index.add(key, Entry(len(data), time.monotonic(), data))
