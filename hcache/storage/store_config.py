"""How a runtime's store is built: the host tier, the local disk store under it, and shared tiers below."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import StorageError
from .chunk_store import ChunkStore
from .disk_store import DiskChunkStore
from .host_pool import PAGE, HostPool, round_up
from .lookup import StoreLookup
from .store_dir import directories
from .host_tier import DEFAULT_READERS, DEFAULT_WRITERS, HostTier
from .redis_store import SCHEMES as REDIS_SCHEMES
from .redis_store import RedisChunkStore

DEFAULT_HOST_BYTES = 4 << 30


@dataclass(frozen=True)
class StoreConfig:
    """``quota_bytes``/``ttl_s``: each disk store's capacity, local or shared (None: unbounded / no expiry). ``host_bytes``:
    the host pool, the tier in front of the disk that holds recent chunks and every chunk being saved
    (pinned when the engine is on a GPU; on a CPU its pages cost nothing until used). ``direct_io``,
    ``fsync``, ``verify``: see :class:`~hcache.storage.disk_store.DiskChunkStore`. ``writers``: threads
    writing chunks back to the stores. ``tiers``: stores shared with other nodes, below the local disk
    (nearest first): ``redis://host:port/db``, ``redis+cluster://host:port,host:port`` (options: see
    :meth:`~hcache.storage.redis_store.RedisChunkStore.from_url`), or a directory on a shared filesystem
    (``file:///mnt/shared/hcache`` or a plain path)."""

    quota_bytes: int | None = None
    ttl_s: float | None = None
    host_bytes: int = DEFAULT_HOST_BYTES
    direct_io: bool = True
    fsync: bool = True
    verify: str = "header"
    writers: int = DEFAULT_WRITERS
    tiers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.tiers, str):
            raise StorageError(f"tiers is a list of tier URLs, not the string {self.tiers!r}")
        object.__setattr__(self, "tiers", tuple(self.tiers))
        for url in self.tiers:  # parsed now; a Redis tier connects on first use
            RedisChunkStore.from_url(url) if _is_redis(url) else _path(url)

    def check(self, chunk_bytes: int) -> None:
        """Refuse options that cannot hold a chunk file of ``chunk_bytes``, before anything is opened."""
        if self.quota_bytes is not None and self.quota_bytes < chunk_bytes:
            raise StorageError(f"quota_bytes={self.quota_bytes} is smaller than one chunk ({chunk_bytes} bytes)")
        slot = round_up(chunk_bytes)
        if self.host_bytes // PAGE * PAGE < slot:
            raise StorageError(f"host_bytes={self.host_bytes} is smaller than one chunk's slot ({slot} bytes)")
        if self.writers < 1:
            raise StorageError(f"writers must be at least 1, not {self.writers}")

    def check_dirs(self, dirs: str | os.PathLike | Sequence[str | os.PathLike] | None) -> None:
        """Raise what :meth:`open_store` would for the local ``dirs`` and the shared directory tiers (held
        by another process, of another layout, not writable), opening nothing: for a check before the
        processes that open them start."""
        if dirs is not None:
            DiskChunkStore.check(dirs)
        for url in self.tiers:
            if not _is_redis(url):
                DiskChunkStore.check(_path(url), shared=True)

    def open_store(
        self,
        dirs: str | os.PathLike | Sequence[str | os.PathLike] | None,
        labels: Mapping[str, str] | None = None,
        *,
        pin: bool = False,
        readers: int = DEFAULT_READERS,
        eviction: str = "lru",
    ) -> HostTier:
        """The host tier over the disk store in ``dirs`` (None: no local disk) and the shared ``tiers``;
        ``pin``: page-lock the pool for DMA to a GPU; ``eviction``: the pool's policy (:mod:`.eviction`)."""
        if self.host_bytes <= 0:
            raise StorageError(f"host_bytes must be positive, not {self.host_bytes}")
        if dirs is None and not self.tiers:
            raise StorageError("a store needs a local directory or a shared tier")
        stores: list[ChunkStore] = []
        try:
            if dirs is not None:
                stores.append(self._disk(dirs, labels, shared=False))
            for url in self.tiers:
                stores.append(RedisChunkStore.from_url(url) if _is_redis(url) else self._disk(_path(url), labels, shared=True))
        except BaseException:
            for store in stores:
                store.close()
            raise
        return HostTier(stores, HostPool(self.host_bytes, pin=pin), readers=readers, writers=self.writers, eviction=eviction)

    def lookup(self, dirs: str | os.PathLike | Sequence[str | os.PathLike] | None) -> StoreLookup:
        """A look-up of what the store over ``dirs`` and the shared tiers holds, for a process that does not
        open it (:class:`~hcache.storage.lookup.StoreLookup`)."""
        shared = [Path(_path(url)) for url in self.tiers if not _is_redis(url)]
        local = directories(dirs) if dirs is not None else []
        return StoreLookup(local + shared, [RedisChunkStore.from_url(url) for url in self.tiers if _is_redis(url)])

    def _disk(self, dirs, labels: Mapping[str, str] | None, shared: bool) -> DiskChunkStore:
        return DiskChunkStore(
            dirs,
            quota_bytes=self.quota_bytes,
            ttl_s=self.ttl_s,
            direct_io=self.direct_io,
            fsync=self.fsync,
            verify=self.verify,
            labels=labels,
            shared=shared,
        )


def _is_redis(url: str) -> bool:
    return urlsplit(url).scheme in REDIS_SCHEMES


def _path(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme == "file":
        return parts.path
    if parts.scheme:
        raise StorageError(f"unknown tier {url!r}: expected redis://, redis+cluster://, file:// or a directory")
    return url
