"""How a runtime's store is built: the host pool in front, the local disk store under it, and stores shared
with other nodes below, each built by the kind its URL's scheme names (:data:`SHARED_KINDS`). A "tier" is
a level of this stack; a "shared store" is one of the levels below the local disk."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import StorageError
from .chunk_store import ChunkStore
from .disk_store import VERIFY_MODES, DiskChunkStore
from .host_pool import PAGE, HostPool, round_up
from .lookup import StoreLookup
from .store_dir import directories
from .host_tier import DEFAULT_READERS, HostTier
from .write_back import DEFAULT_WRITERS
from .redis_store import SCHEMES as REDIS_SCHEMES
from .redis_store import RedisChunkStore

DEFAULT_HOST_BYTES = 4 << 30


@dataclass(frozen=True)
class StoreConfig:
    """``quota_bytes``/``ttl_s``: each disk store's capacity, local or shared, in bytes and whole seconds
    (None: unbounded / no expiry). ``host_bytes``:
    the host pool, the tier in front of the disk that holds recent chunks and every chunk being saved
    (pinned when the engine is on a GPU; on a CPU its pages cost nothing until used). ``direct_io``,
    ``fsync``, ``verify``: see :class:`~hcache.storage.disk_store.DiskChunkStore`. ``writers``: threads
    writing chunks back to the stores. ``shared``: stores shared with other nodes, below the local disk
    (nearest first): ``redis://host:port/db``, ``redis+cluster://host:port,host:port`` (options: see
    :meth:`~hcache.storage.redis_store.RedisChunkStore.from_url`), or a directory on a shared filesystem
    (``file:///mnt/shared/hcache``, or a path that is absolute or starts with ``./``, ``../`` or ``~``).
    ``tiers``: the former name of ``shared``, accepted with a warning. Every option is checked here, when
    the settings are made, each bad one refused with one line: a numeric option is a positive whole number
    (no string, bool, NaN or infinity), and a shared store's URL is one by its scheme, so that a misspelt
    one never becomes a directory."""

    quota_bytes: int | None = None
    ttl_s: int | None = None
    host_bytes: int = DEFAULT_HOST_BYTES
    direct_io: bool = True
    fsync: bool = True
    verify: str = "header"
    writers: int = DEFAULT_WRITERS
    shared: tuple[str, ...] = ()
    tiers: InitVar[Sequence[str] | None] = None

    def __post_init__(self, tiers: Sequence[str] | None) -> None:
        if tiers is not None:
            if self.shared:
                raise StorageError("give the shared stores as shared, not also as tiers (its former name)")
            warnings.warn(
                "StoreConfig's tiers is now called shared; tiers will be refused in a later release",
                FutureWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "shared", tiers)
        for name in ("quota_bytes", "ttl_s", "host_bytes", "writers"):
            value = getattr(self, name)
            if not (value is None and name in ("quota_bytes", "ttl_s")) and not _positive_whole(value):
                raise StorageError(f"store.{name} must be a positive whole number, not {value!r:.80}")
        for name in ("direct_io", "fsync"):
            if not isinstance(getattr(self, name), bool):
                raise StorageError(f"store.{name} is True or False, not {getattr(self, name)!r:.80}")
        if self.verify not in VERIFY_MODES:
            raise StorageError(f"store.verify must be one of {VERIFY_MODES}, not {self.verify!r:.80}")
        if isinstance(self.shared, str):
            raise StorageError(f"store.shared is a list of store URLs, not the string {self.shared!r:.80}")
        object.__setattr__(self, "shared", tuple(self.shared))
        self._shared()  # parsed now; a Redis store connects on first use

    def check(self, chunk_bytes: int) -> None:
        """Refuse options that cannot hold a chunk file of ``chunk_bytes``, before anything is opened."""
        if self.quota_bytes is not None and self.quota_bytes < chunk_bytes:
            raise StorageError(f"quota_bytes={self.quota_bytes} is smaller than one chunk ({chunk_bytes} bytes)")
        slot = round_up(chunk_bytes)
        if self.host_bytes // PAGE * PAGE < slot:
            raise StorageError(f"host_bytes={self.host_bytes} is smaller than one chunk's slot ({slot} bytes)")

    def check_dirs(self, dirs: str | os.PathLike | Sequence[str | os.PathLike] | None) -> None:
        """Raise what :meth:`open_store` would for the local ``dirs`` and the shared directories (held
        by another process, of another layout, not writable), opening nothing: for a check before the
        processes that open them start."""
        if dirs is not None:
            DiskChunkStore.check(dirs)
        for store in self._shared():
            store.check()

    def open_store(
        self,
        dirs: str | os.PathLike | Sequence[str | os.PathLike] | None,
        labels: Mapping[str, str] | None = None,
        *,
        pin: bool = False,
        shareable: bool = False,
        readers: int = DEFAULT_READERS,
        eviction: str = "lru",
    ) -> HostTier:
        """The host tier over the disk store in ``dirs`` (None: no local disk) and the ``shared`` stores;
        ``pin``: page-lock the pool for DMA to a GPU; ``shareable``: the pool on memory another process may map
        (:class:`~hcache.storage.host_pool.HostPool`); ``eviction``: the pool's policy (:mod:`.eviction`)."""
        if dirs is None and not self.shared:
            raise StorageError("a store needs a local directory or a shared store")
        stores: list[ChunkStore] = []
        try:
            if dirs is not None:
                stores.append(self.disk(dirs, labels, shared=False))
            for shared in self._shared():
                stores.append(shared.open(self, labels))
        except BaseException:
            for store in stores:
                store.close()
            raise
        return HostTier(
            stores,
            HostPool(self.host_bytes, pin=pin, shareable=shareable),
            readers=readers,
            writers=self.writers,
            eviction=eviction,
        )

    def lookup(self, dirs: str | os.PathLike | Sequence[str | os.PathLike] | None) -> StoreLookup:
        """A look-up of what the store over ``dirs`` and the shared stores holds, for a process that does not
        open it (:class:`~hcache.storage.lookup.StoreLookup`)."""
        shared = self._shared()
        local = directories(dirs) if dirs is not None else []
        return StoreLookup(
            local + [t.path for t in shared if isinstance(t, SharedDirectory)],
            [t.open(self, None) for t in shared if isinstance(t, SharedRedis)],
        )

    def _shared(self) -> list[SharedStore]:
        return [shared_store(url) for url in self.shared]

    def disk(self, dirs, labels: Mapping[str, str] | None, shared: bool) -> DiskChunkStore:
        """A disk store over ``dirs`` with these options."""
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


class SharedRedis:
    """A Redis server or cluster shared by nodes (:class:`~hcache.storage.redis_store.RedisChunkStore`)."""

    def __init__(self, url: str):
        self.url = url
        RedisChunkStore.from_url(url)  # refuses a bad URL now

    def check(self) -> None:
        """Nothing to check before start: the server is asked on first use, and a failing one is a miss."""

    def open(self, config: StoreConfig, labels: Mapping[str, str] | None) -> ChunkStore:
        return RedisChunkStore.from_url(self.url)


class SharedDirectory:
    """A directory on a filesystem shared by nodes: ``file:///path`` (absolute: ``file://dir/x`` would name
    a host), or a path that cannot be a misspelt URL: absolute, or starting with ``./``, ``../`` or ``~``."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
                raise _not_a_store(url)
            self.path = Path(parts.path)
        elif url.startswith(("/", "./", "../", "~")):
            self.path = Path(url).expanduser()
        else:
            raise _not_a_store(url)

    def check(self) -> None:
        DiskChunkStore.check(self.path, shared=True)

    def open(self, config: StoreConfig, labels: Mapping[str, str] | None) -> ChunkStore:
        return config.disk(self.path, labels, shared=True)


SharedStore = SharedRedis | SharedDirectory
SHARED_KINDS: dict[str, type[SharedStore]] = {
    **dict.fromkeys(REDIS_SCHEMES, SharedRedis),
    "file": SharedDirectory,
    "": SharedDirectory,
}


def shared_store(url: str) -> SharedStore:
    """The shared store ``url`` names, by its scheme."""
    kind = SHARED_KINDS.get(urlsplit(url).scheme) if isinstance(url, str) else None
    if kind is None:
        raise _not_a_store(url)
    return kind(url)


def _not_a_store(url: object) -> StorageError:
    shown = re.sub(r":[^:/@]*@", ":***@", url) if isinstance(url, str) else url  # no password in messages
    return StorageError(
        f"unknown shared store {shown!r:.80}: expected redis://host:port/db, redis+cluster://host:port,..., "
        "file:///absolute/dir, or a directory path that is absolute or starts with ./, ../ or ~"
    )


def _positive_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
