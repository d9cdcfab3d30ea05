"""How a runtime's store is built: the disk store's options and the host tier in front of it."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import StorageError
from ..transfer.host_pool import PAGE, HostPool, round_up
from .disk_store import DiskChunkStore
from .host_tier import DEFAULT_READERS, DEFAULT_WRITERS, HostTier

DEFAULT_HOST_BYTES = 4 << 30


@dataclass(frozen=True)
class StoreConfig:
    """``quota_bytes``/``ttl_s``: the disk store's capacity (None: unbounded / no expiry). ``host_bytes``:
    the host pool, the tier in front of the disk that holds recent chunks and every chunk being saved
    (pinned when the engine is on a GPU; on a CPU its pages cost nothing until used). ``direct_io``,
    ``fsync``, ``verify``: see :class:`~hcache.storage.disk_store.DiskChunkStore`. ``writers``: threads
    writing chunks back to disk."""

    quota_bytes: int | None = None
    ttl_s: float | None = None
    host_bytes: int = DEFAULT_HOST_BYTES
    direct_io: bool = True
    fsync: bool = True
    verify: str = "header"
    writers: int = DEFAULT_WRITERS

    def check(self, chunk_bytes: int) -> None:
        """Refuse options that cannot hold a chunk file of ``chunk_bytes``, before anything is opened."""
        if self.quota_bytes is not None and self.quota_bytes < chunk_bytes:
            raise StorageError(f"quota_bytes={self.quota_bytes} is smaller than one chunk ({chunk_bytes} bytes)")
        slot = round_up(chunk_bytes)
        if self.host_bytes // PAGE * PAGE < slot:
            raise StorageError(f"host_bytes={self.host_bytes} is smaller than one chunk's slot ({slot} bytes)")
        if self.writers < 1:
            raise StorageError(f"writers must be at least 1, not {self.writers}")

    def open_store(
        self,
        dirs: str | os.PathLike | Sequence[str | os.PathLike],
        labels: Mapping[str, str] | None = None,
        *,
        pin: bool = False,
        readers: int = DEFAULT_READERS,
    ) -> HostTier:
        """The host tier over the disk store in ``dirs``; ``pin``: page-lock the pool for DMA to a GPU."""
        if self.host_bytes <= 0:
            raise StorageError(f"host_bytes must be positive, not {self.host_bytes}")
        disk = DiskChunkStore(
            dirs,
            quota_bytes=self.quota_bytes,
            ttl_s=self.ttl_s,
            direct_io=self.direct_io,
            fsync=self.fsync,
            verify=self.verify,
            labels=labels,
        )
        return HostTier(disk, HostPool(self.host_bytes, pin=pin), readers=readers, writers=self.writers)
