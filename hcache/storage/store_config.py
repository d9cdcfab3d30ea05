"""How a runtime's store is built: the options of the disk store, the DRAM tier and the saver."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import StorageError
from .chunk_store import ChunkStore
from .disk_store import DiskChunkStore
from .dram_tier import DramTier
from .saver import DEFAULT_STAGING_BYTES, DEFAULT_THREADS


@dataclass(frozen=True)
class StoreConfig:
    """``quota_bytes``/``ttl_s``: the disk store's capacity (None: unbounded / no expiry). ``dram_bytes``:
    the DRAM tier's size (0: no tier). ``direct_io``, ``fsync``, ``verify``: see
    :class:`~hcache.storage.disk_store.DiskChunkStore`. ``saver_threads``/``staging_bytes``: the two-stage
    saver's stage-2 pool and stage-1 ring."""

    quota_bytes: int | None = None
    ttl_s: float | None = None
    dram_bytes: int = 0
    direct_io: bool = True
    fsync: bool = True
    verify: str = "header"
    saver_threads: int = DEFAULT_THREADS
    staging_bytes: int = DEFAULT_STAGING_BYTES

    def open_store(
        self, dirs: str | os.PathLike | Sequence[str | os.PathLike], labels: Mapping[str, str] | None = None
    ) -> ChunkStore:
        if self.dram_bytes < 0:
            raise StorageError(f"dram_bytes must be 0 (no DRAM tier) or positive, not {self.dram_bytes}")
        disk = DiskChunkStore(
            dirs,
            quota_bytes=self.quota_bytes,
            ttl_s=self.ttl_s,
            direct_io=self.direct_io,
            fsync=self.fsync,
            verify=self.verify,
            labels=labels,
        )
        return DramTier(disk, self.dram_bytes) if self.dram_bytes else disk
