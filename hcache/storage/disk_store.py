"""Chunk files over several directories (one per SSD), with a crash-safe index, a quota, LRU and TTL.

Layout: ``<dir>/chunks/<key[:2]>/<key>.safetensors`` in one of the store's directories, chosen round-robin when the
chunk is written. Each directory is opened by :mod:`.store_dir` (its manifest and its lock).

Crash safety. A chunk is written to a temporary name (``.<key>.<random>.tmp``), flushed to the device
(``fdatasync``), and renamed into place, so a chunk name never refers to a torn file, whenever the writer dies. The
directory is not fsynced after each rename: a power loss may forget the newest renames, which costs a recompute of
those chunks, never a wrong answer. The index is in memory and rebuilt from the directories at start-up
(:mod:`.dir_scan`): temporary files are deleted, every chunk file is checked (its header and length by default,
every checksum with ``verify="full"``) and a bad one is deleted. So the index never lists a chunk that is not on
disk whole.

Capacity. ``quota_bytes`` bounds the bytes of chunk files; a put that does not fit evicts the least recently used
chunks first, but not a chunk before the chunks after it in its chain (its parent is in its header) unless they are
pinned and nothing else makes room: they are unreachable without it, so a conversation's first chunk, which every
later turn and every conversation sharing that start looks up, goes last. A header's parent is trusted only when it
names another, older chunk of this store and closes no cycle (:class:`~.lru_index.LruIndex`), so no damaged or
hostile header can hold the store over its quota. ``ttl_s`` expires chunks unused for that long. A use is a look-up,
a read, or a hit in a tier above passed down by :meth:`touch` (the host pool serves the most used chunks, so without
it they would look the least used here); a look-up of a chain's chunks uses the last first, so a parent is always
the more recent. The order and the TTL are rebuilt from file times at start-up, so a use also sets the file's time:
at most once a second per chunk (``_STAMP_S``), on a thread of the store's own, never on the caller's
(:mod:`.use_stamps`). A crash loses at most the uses of the last moments. A chunk is pinned while :meth:`read_into`
reads it, or while a caller holds it (:meth:`pin`: a load to come), and a pinned chunk is never evicted.

Losses. What the store evicted, what it found bad (at start-up, on a read, or a file whose length changed) and
discarded, and what vanished behind its back, are remembered (the latest 16,384): :meth:`gone` says why a look-up
misses a chunk it held.

Privacy. Chunk files hold token ids in clear, so directories are 0700 and files 0600 whatever the umask.

Shared mode (``shared=True``: several nodes over one NFS, Lustre or 3FS mount, each with a store object of its own).
A chunk another node wrote is found on an index miss, by its path. Publishing stays atomic (temporary name, fsync,
rename), so a reader sees a whole chunk or none. Each node's quota and LRU count only the chunks it has seen; a
chunk one node evicts while another reads it is either read whole (the reader holds the file open) or fails to read
(a stale handle): a clean miss, and any torn read is caught by the chunk's checksums. Start-up deletes only
temporary files older than a day, since a young one may be another node's write in flight; so does a private store's
start-up when another store object of the process has the directory open already (its writes may be in flight).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..errors import StorageError
from . import direct_io as dio
from .chunk import ChunkInvalid, ChunkLayout, read_header
from .chunk_file import publish
from .chunk_store import Loss, LossLog, Sight
from .dir_scan import scan
from .lru_index import Entry, LruIndex
from .store_dir import CHUNK_KEY, chunk_path, directories, open_dir
from .stored_state import Source
from .use_stamps import UseStamps

log = logging.getLogger(__name__)


VERIFY_MODES = ("none", "header", "full")
_STAMP_S = 1.0  # a use is recorded in the file's time at most this often: a restart's order is that coarse


def _release_all(releases: list) -> None:
    for release in releases:
        release()


class StoreFull(OSError):
    """The quota cannot take a chunk because pinned chunks hold the space, or the chain the chunk continues,
    which is not evicted for it (the chunk is not written to disk; the host tier keeps it in memory)."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)


class DiskChunkStore:
    """A :class:`~hcache.storage.chunk_store.ChunkStore` over one or more directories.

    ``dirs``: a directory or a list of them, one per device. ``quota_bytes``: the most bytes of chunk
    files kept (None: unbounded). ``ttl_s``: expire chunks unused for this long. ``direct_io``: use
    O_DIRECT where the filesystem allows it. ``fsync``: flush each chunk to the device before publishing
    it (off only for throwaway stores). ``verify``: what start-up checks of each chunk file (``"none"``,
    ``"header"``, ``"full"``). ``labels``: who saves here (recorded in each directory's manifest).
    ``shared``: other processes or nodes use these directories too (see the module's docstring).
    """

    def __init__(
        self,
        dirs: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        quota_bytes: int | None = None,
        ttl_s: float | None = None,
        direct_io: bool = True,
        fsync: bool = True,
        verify: str = "header",
        labels: Mapping[str, str] | None = None,
        shared: bool = False,
        clock: Callable[[], float] = time.time,
    ):
        self.dirs = directories(dirs)
        if quota_bytes is not None and not 0 < quota_bytes < math.inf:  # NaN too: it would turn the quota off
            raise StorageError(f"quota_bytes must be positive and finite, not {quota_bytes}")
        if ttl_s is not None and not 0 < ttl_s < math.inf:
            raise StorageError(f"ttl_s must be positive and finite, not {ttl_s}")
        if verify not in VERIFY_MODES:
            raise StorageError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
        self.fsync, self.shared = fsync, shared
        self.name = ("shared " if shared else "") + ",".join(str(p) for p in self.dirs)
        self.kind = (Source.SHARED_DISK if shared else Source.DISK).value
        self.bytes_written = 0
        self.write_errors = 0
        self.evictions = 0
        self._gone: LossLog[Loss] = LossLog()  # the latest keys lost, and why: for miss reasons
        self.dropped_at_start = 0  # chunk files found bad at start-up
        self.other_version_at_start = 0  # chunk files of another layout version, left alone
        self._lock = threading.Lock()
        self._index = LruIndex(quota_bytes, ttl_s, clock)
        self._stamp_s = _STAMP_S if ttl_s is None else min(_STAMP_S, ttl_s / 8)
        self._stamps = stamps = UseStamps()
        self._next_dir = 0
        self._writing: set[str] = set()  # keys with a put in flight
        self._written = threading.Condition(self._lock)  # notified when a put ends
        releases: list = [stamps.shutdown]
        self._finalizer = weakref.finalize(self, _release_all, releases)
        sole = []  # per directory: no other store object here holds it, so its temporary files are abandoned
        for d in self.dirs:
            release, first = open_dir(d, dict(labels or {}), shared)
            releases.append(release)
            sole.append(first and not shared)
        try:
            self.direct = [direct_io and dio.supports_direct(d) for d in self.dirs]
        except OSError as exc:
            raise StorageError(f"chunk store {self.dirs} is not writable: {exc}") from exc
        self._rebuild(verify, sole)

    @property
    def root(self) -> Path:
        return self.dirs[0]

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def quota_bytes(self) -> int | None:
        return self._index.quota_bytes

    # ---- start-up ----------------------------------------------------------------------------------
    @classmethod
    def check(cls, dirs: str | os.PathLike | Sequence[str | os.PathLike], *, shared: bool = False) -> None:
        """Raise the StorageError that opening a store on ``dirs`` would raise for a directory (one that
        cannot be made or written, that another process holds, or of another layout), reading no chunk: for
        a check before starting the processes that will open it."""
        for d in directories(dirs):
            release, _ = open_dir(d, None, shared)
            try:
                dio.supports_direct(d)
            except OSError as exc:
                raise StorageError(f"chunk store {d} is not a writable directory: {exc}") from exc
            finally:
                release()

    def close(self) -> None:
        """Record the last uses in the file times and let another process open these directories (also done
        when the store is collected, without the last uses)."""
        if self._finalizer.alive:
            self._stamps.flush()
        self._finalizer()

    def _rebuild(self, verify: str, sole: list[bool]) -> None:
        found = scan(self.dirs, verify, sole)
        self.dropped_at_start, self.other_version_at_start = len(found.dropped), found.other_version
        for key in found.dropped:
            self._gone.add(key, Loss.FAILED_VERIFICATION)
        self._index.add_in_age_order([(key, entry) for key, (_, entry) in found.chunks.items()])
        with self._lock:
            victims = self._index.make_room(0) or []
            if victims:  # a quota below what the directories hold: the oldest go now
                log.warning(
                    "store %s holds more than its quota of %d bytes: evicting its %d least recently used chunks (%d bytes)",
                    self.root,
                    self.quota_bytes,
                    len(victims),
                    sum(e.size for _, e in victims),
                )
            self._evict(victims)

    # ---- the ChunkStore protocol ------------------------------------------------------------------
    def path(self, key: str, dir_index: int | None = None) -> Path:
        if dir_index is None:
            with self._lock:
                entry = self._index.entries.get(key)
            dir_index = entry.where if entry is not None else 0
        return chunk_path(self.dirs[dir_index], key)

    def contains(self, key: str) -> bool:
        """Whether the chunk is stored; a hit counts as a use (LRU and TTL): a restore's lookup is one."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each chunk is stored; the hits count as uses, the last first: ``keys`` are a chain's, in
        order, and a parent must be the more recently used."""
        with self._lock:
            hits = [self._lookup(key) is not None for key in keys]
            for key, hit in zip(reversed(keys), reversed(hits)):
                if hit:
                    self._use(key)
        return hits

    def touch(self, keys: list[str]) -> None:
        """Uses of these chunks served by a tier above (host-pool hits), the last first, as a look-up's."""
        with self._lock:
            for key in reversed(keys):
                if key in self._index and key not in self._writing:
                    self._use(key)

    def read_into(self, key: str, take: Callable[[int], memoryview | None]) -> int | None:
        """Read a whole chunk file with one request into ``take(size)`` (a buffer of at least ``size``
        bytes, page-aligned for O_DIRECT), and return its size; None if the chunk is absent or ``take``
        gives nothing. The chunk is pinned while it is read. A file whose length changed since it was
        indexed, and whose header describes its new length, is indexed at that length and read again into
        a second ``take``: its reader's checks then tell another store object's replacement, which is
        served, from a damaged header, which fails verification, as they would had the store opened on it.
        Raises OSError when the file cannot be read, and :class:`ChunkInvalid` when its length changed and
        its header does not describe the new length (truncated or grown: damaged)."""
        with self._lock:
            entry = self._lookup(key)
            if entry is None:
                return None
            self._use(key)
            entry.pins += 1
            where, size = entry.where, entry.size
        path = self.path(key, where)
        try:
            try:
                return self._read(path, where, size, take)
            except dio.LengthChanged as exc:
                with open(path, "rb") as f:
                    read_header(f, key, exc.actual)  # raises ChunkInvalid unless the header describes the file
                with self._lock:
                    if self._index.entries.get(key) is not entry:
                        return None  # replaced or dropped meanwhile: the next look-up sees what is there
                    self._index.resize(key, exc.actual)
                    self._evict(self._index.make_room(0) or [])
                return self._read(path, where, exc.actual, take)
        except (FileNotFoundError, dio.LengthChanged):
            self._forget(key, entry)  # deleted behind the store's back, or replaced again while read
            return None
        finally:
            self._unpin(entry)

    def _read(self, path: Path, where: int, size: int, take: Callable[[int], memoryview | None]) -> int | None:
        out = take(size)
        if out is None:
            return None
        dio.read_file(path, out, size, self.direct[where])
        return size

    def pin(self, keys: list[str]) -> list[Entry | None]:
        """Hold each stored chunk of ``keys`` until :meth:`unpin`: the quota and the TTL pass a pinned chunk
        over, as they do one being read. Another process's store over a shared directory does not see it."""
        with self._lock:
            entries = [self._lookup(key) for key in keys]
            for entry in entries:
                if entry is not None:
                    entry.pins += 1
        return entries

    def unpin(self, pins: list[Entry]) -> None:
        with self._lock:
            for entry in pins:
                entry.pins -= 1

    def header(self, key: str) -> tuple[ChunkLayout, dict] | None:
        """The stored chunk's layout and metadata, or None if it is absent, unreadable or damaged. The
        header is checked against the file's length, not the index's: a write-back asks this to skip a chunk
        stored already, and must not skip one whose file changed behind the store's back."""
        with self._lock:
            entry = self._lookup(key)
            if entry is None:
                return None
            where = entry.where
        try:
            with open(self.path(key, where), "rb") as f:
                return read_header(f, key, os.fstat(f.fileno()).st_size)
        except (OSError, ChunkInvalid):
            return None

    def put(self, key: str, data: bytes | memoryview, length: int | None = None, parent: str = "") -> None:
        """Publish ``data[:length]`` as a chunk atomically, replacing any chunk of that key but another
        layout version's (a page-aligned ``data``, such as a host-pool slot, is written in place with
        O_DIRECT); ``parent``: the chunk before it in its chain, as its header says. Raises OSError
        (StoreFull, OtherVersionStored, ENOSPC, EIO, ...) with nothing published."""
        data = memoryview(data).cast("B")
        size = len(data) if length is None else length
        with self._lock:
            while key in self._writing:  # a replacement (more formats) waits for the put in flight
                self._written.wait()
            if not self._index.fits(size):
                raise StorageError(f"a chunk of {size} bytes exceeds the store's whole quota of {self.quota_bytes}")
            victims = self._index.make_room(size, replacing=key, parent=parent)
            if victims is None:
                self._gone.add(key, Loss.EVICTED)  # the quota refused it: a look-up's miss is the quota's
                raise StoreFull(
                    f"quota of {self.quota_bytes} bytes is held by chunks being read or written, and by the chain this chunk continues"
                )
            self._evict(victims)
            old = self._index.entries.get(key)
            where = old.where if old is not None else self._next_dir
            if old is None:
                self._next_dir = (self._next_dir + 1) % len(self.dirs)
            # Reserve the space now, so concurrent puts cannot overshoot the quota together; the pin
            # keeps the reservation from being evicted before the file exists.
            now = self._index.clock()
            entry = Entry(size, now, where, pins=1, stamped=now, parent=parent)
            self._index.add(key, entry)
            self._writing.add(key)
        try:
            self.direct[where] = publish(self.path(key, where), key, data, size, self.direct[where], self.fsync, now)
        except BaseException:
            with self._lock:
                self.write_errors += 1
                self._writing.discard(key)
                self._written.notify_all()
                entry.pins -= 1
                if self._index.entries.get(key) is entry:
                    self._index.remove(key)
            raise
        with self._lock:
            self.bytes_written += size
            self._writing.discard(key)
            self._written.notify_all()
            entry.pins -= 1

    def discard(self, key: str) -> None:
        """Delete a chunk found bad now (a reader that has it open keeps reading the old file, as POSIX
        allows); a look-up's miss of it is ``failed_verification``."""
        with self._lock:
            entry = self._index.remove(key)
            self._gone.add(key, Loss.FAILED_VERIFICATION)
        if entry is not None:
            self.path(key, entry.where).unlink(missing_ok=True)
        else:
            for i in range(len(self.dirs)):
                self.path(key, i).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._index.entries)

    def stats(self) -> dict:
        with self._lock:
            return {
                "chunks": len(self._index),
                "used_bytes": self._index.used_bytes,
                "quota_bytes": self._index.quota_bytes,
                "bytes_written": self.bytes_written,
                "write_errors": self.write_errors,
                "evictions": self.evictions,
                "dropped_at_start": self.dropped_at_start,
                "other_version_at_start": self.other_version_at_start,
                "direct_io": list(self.direct),
            }

    # ---- internals (called with the lock held) ------------------------------------------------------
    def _lookup(self, key: str) -> Entry | None:
        if key in self._writing:
            return None  # not published yet
        entry = self._index.entries.get(key)
        if entry is None:
            entry = self._adopt(key)
        elif self._index.expired(entry):
            self._evict([(key, self._index.remove(key))])
            return None
        return entry

    def _use(self, key: str) -> None:
        """Count a use of an indexed chunk; have the stamper set its file time, when the last one set is stale."""
        entry = self._index.touch(key)
        if entry.last_used - entry.stamped < self._stamp_s:
            return
        entry.stamped = entry.last_used
        self._stamps.note(self.path(key, entry.where), entry.last_used)

    def _forget(self, key: str, entry: Entry) -> None:
        """Drop ``entry`` from the index if it is still ``key``'s: its file vanished or changed behind the store's back."""
        with self._lock:
            if self._index.entries.get(key) is entry:
                self._index.remove(key)
                self._gone.add(key, Loss.EVICTED)

    def _adopt(self, key: str) -> Entry | None:
        """A chunk published by another process (or another store object) over the same directories."""
        if not CHUNK_KEY.fullmatch(key):
            return None
        for i in range(len(self.dirs)):
            try:
                st = self.path(key, i).stat()
            except OSError:
                continue
            victims = self._index.make_room(st.st_size) if self._index.fits(st.st_size) else None
            if victims is None:
                return None  # it would break the quota: leave it unserved
            self._evict(victims)
            entry = Entry(st.st_size, self._index.clock(), i)
            self._index.add(key, entry)
            return entry
        return None

    def _evict(self, victims: list[tuple[str, Entry]]) -> None:
        for key, entry in victims:
            self.evictions += 1
            self.path(key, entry.where).unlink(missing_ok=True)
            self._gone.add(key, Loss.EVICTED)

    available = True  # a directory that fails raises on the read itself

    def gone(self, key: str) -> Loss | None:
        """Why this store lost the chunk, if it is one of its latest losses; another node's eviction from a
        shared directory is not known here. A chunk stored again is not lost."""
        with self._lock:
            return None if key in self._index else self._gone.get(key)

    def losses(self) -> list[tuple[str, Loss]]:
        with self._lock:
            return [(key, why) for key, why in self._gone if key not in self._index]

    def follow(self, lost: Callable[[str, Loss], None]) -> None:
        with self._lock:
            self._gone.listeners.append(lost)

    def watch(
        self, stored: Callable[[str, tuple[ChunkLayout, dict]], None], lost: Callable[[str, Loss | None], None]
    ) -> Sight:
        """A private directory has no other writer; a shared one's other nodes write and evict unseen (a scan of
        its directories would be the only way to learn of it)."""
        return Sight.NONE if self.shared else Sight.OWN

    def _unpin(self, entry: Entry) -> None:
        with self._lock:
            entry.pins -= 1
