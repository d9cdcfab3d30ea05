"""Chunks on a Redis server or cluster, shared by every serving node that points at it.

One chunk is one value: the chunk's whole file image, header and checksums included, so a value read
back is verified like a file (by the host tier, on entry to the pool), and replacing a chunk (healing:
one saved with more formats) swaps it whole, so a reader never mixes layers of two versions. One value
per (chunk, layer) would need a transaction for that, and would scatter a chunk over a cluster's nodes.
``hcache bench storage --tier redis`` measures both layouts raw; on the 2-vCPU development VM a pipeline
of per-layer GETs read 1.19x faster than whole-chunk GETs with 8 threads. Keys are
``<prefix>:<namespace>:<chunk key>``; the chunk key already names the model and the tenant, and the
namespace keeps deployments that share a server apart.

A shared server is allowed to fail. A server that is down, slower than ``timeout_s`` or full makes
lookups and reads misses (serving goes on by recompute) and writes fail (the chunk stays in the tiers
above); each failure is counted, a warning is logged for the first and every 100th, and the store then
leaves the server alone for ``backoff_s`` so that a slow server costs one timeout, not one per chunk.
A value of another type under a chunk's key (a list, say) is no failure of the server: it is a bad chunk,
discarded when read and replaced when written.

What others change on a shared server is seen only where someone follows it (:meth:`RedisChunkStore.watch`,
for the KV cache events): through the server's keyspace notifications (:mod:`.redis_watch`).
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from ..errors import StorageError
from .chunk import ChunkInvalid, ChunkLayout, read_header
from .chunk_store import Loss, LossLog, Sight
from .redis_watch import KeyspaceWatch
from .stored_state import Source

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "redis+cluster")
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_BACKOFF_S = 2.0
_HEADER_PROBE = 64 << 10  # a chunk header is a few KiB: one GETRANGE reads it whole
_HEALTH_CHECK_S = 5.0  # a watch idle this long pings the server: a silent connection is found lost
_WRITES_KEPT = 4096  # headers of this node's latest writes, which its watch then need not read back


class _Unavailable(Exception):
    """The store is backing off after a failure: the call is not made."""


class RedisChunkStore:
    """A :class:`~hcache.storage.chunk_store.ChunkStore` on Redis; build it with :meth:`from_url`.

    ``connect``: makes the client (called lazily, so a server that is down at start-up is a miss, not an
    error); ``watch_connect``: one for :meth:`watch`, which does not retry (None: a cluster). ``ttl_s``:
    values expire after this long unused (each read renews it); None keeps them until the server evicts them
    (run it with ``maxmemory-policy allkeys-lru``)."""

    kind = Source.REDIS.value

    def __init__(
        self,
        connect: Callable[[], redis.Redis | RedisCluster],
        *,
        name: str,
        watch_connect: Callable[[], redis.Redis] | None = None,
        prefix: str = "hcache",
        namespace: str = "default",
        ttl_s: float | None = None,
        backoff_s: float = DEFAULT_BACKOFF_S,
    ):
        if ttl_s is not None and not 0 < ttl_s < math.inf:
            raise StorageError(f"{name}: ttl must be positive and finite, not {ttl_s}")
        if ":" in namespace or not namespace or not prefix:
            raise StorageError(f"{name}: prefix and namespace must be non-empty, and the namespace has no ':'")
        self.name, self.ttl_s, self.backoff_s = name, ttl_s, backoff_s
        self._prefix = f"{prefix}:{namespace}:"
        self._connect, self._watch_connect = connect, watch_connect
        self._client: redis.Redis | RedisCluster | None = None
        self._lock = threading.Lock()
        self._gone: LossLog[Loss] = LossLog()  # chunks this node found bad and deleted (and, watched, others')
        self._watch: KeyspaceWatch | None = None
        self._watchers: list[
            tuple[Callable[[str, tuple[ChunkLayout, dict]], None], Callable[[str, Loss | None], None]]
        ] = []
        self._told: set[str] = set()  # chunks the watchers were told are stored
        self._written: OrderedDict[str, tuple[ChunkLayout, dict]] = OrderedDict()  # this node's latest writes' headers
        self._down_until = 0.0
        self.errors = self.skipped = self.bytes_read = self.bytes_written = 0

    @classmethod
    def from_url(cls, url: str) -> RedisChunkStore:
        """``redis://[user:password@]host:port/db`` (``rediss://`` for TLS) or
        ``redis+cluster://host:port,host:port``, with options ``?prefix=&namespace=&ttl=&timeout=&backoff=``."""
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise StorageError(
                f"not a Redis tier: {url!r} (expected redis://host:port/db or redis+cluster://host:port,...)"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"prefix", "namespace", "ttl", "timeout", "backoff"}
        if unknown:
            raise StorageError(f"{url}: unknown option(s) {sorted(unknown)}")
        try:
            ttl = float(query["ttl"]) if "ttl" in query else None
            timeout = float(query.get("timeout", DEFAULT_TIMEOUT_S))
            backoff = float(query.get("backoff", DEFAULT_BACKOFF_S))
        except ValueError as exc:
            raise StorageError(f"{url}: {exc}") from exc
        if not 0 < timeout < math.inf or not 0 <= backoff < math.inf:
            raise StorageError(f"{url}: timeout must be positive and backoff non-negative, both finite")
        # One retry: a connection the server dropped (it restarted) is re-made; a dead server fails fast.
        common = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1))
        name = parts._replace(query="", netloc=parts.netloc.rpartition("@")[2]).geturl()  # no password in logs
        if parts.scheme == "redis+cluster":
            try:
                nodes = [ClusterNode(h, int(p)) for h, _, p in (n.rpartition(":") for n in parts.netloc.split(","))]
            except ValueError as exc:
                raise StorageError(f"{url}: cluster nodes must be host:port,host:port") from exc

            def connect():
                return RedisCluster(startup_nodes=nodes, **common)

            watch_connect = None
        else:

            def connect(**extra):
                return redis.Redis.from_url(parts._replace(query="").geturl(), **{**common, **extra})

            def watch_connect():
                return connect(retry=Retry(NoBackoff(), 0), health_check_interval=_HEALTH_CHECK_S)

        options = {k: query[k] for k in ("prefix", "namespace") if k in query}
        return cls(connect, name=name, watch_connect=watch_connect, ttl_s=ttl, backoff_s=backoff, **options)

    def ping(self) -> None:
        """Raise StorageError unless the server answers now: for a check at start-up, where a server that
        cannot be reached is a mistake in the configuration, not an outage to serve through."""
        try:
            client = self._connect()
            try:
                client.ping()
            finally:
                client.close()
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            raise StorageError(f"{self.name}: the Redis server cannot be reached ({exc})") from exc

    # ---- the ChunkStore protocol ------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        def call(client):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._prefix + key)
            return [bool(n) for n in pipe.execute()]

        return self._guard("look up", call, [False] * len(keys))

    def pin(self, keys: list[str]) -> list[str | None]:
        """Whether each chunk is stored (its key, else None), in one round trip: the server evicts by its own
        policy (``maxmemory``, TTL), which no client can hold off."""
        return [key if hit else None for key, hit in zip(keys, self.contains_many(keys))]

    def unpin(self, pins: list[str]) -> None:
        pass  # nothing was held

    def touch(self, keys: list[str]) -> None:
        """Uses served by a tier above: each renews its value's TTL, or without one its place in the
        server's LRU order."""

        def call(client):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                if self.ttl_s is None:
                    pipe.touch(self._prefix + key)
                else:
                    pipe.pexpire(self._prefix + key, int(self.ttl_s * 1000))
            pipe.execute()

        self._guard("touch", call, None)

    def read_into(self, key: str, take: Callable[[int], memoryview | None]) -> int | None:
        """GET the chunk and copy it into ``take(size)``; a failure of the server is a miss, and a value of
        another type raises ChunkInvalid (the host tier then discards it)."""

        def call(client):
            name = self._prefix + key
            return client.get(name) if self.ttl_s is None else client.getex(name, px=int(self.ttl_s * 1000))

        value = self._guard("read", call, None)
        if value is None:
            return None
        out = take(len(value))
        if out is None:
            return None
        memoryview(out).cast("B")[: len(value)] = value
        with self._lock:
            self.bytes_read += len(value)
        return len(value)

    def header(self, key: str) -> tuple[ChunkLayout, dict] | None:
        name = self._prefix + key

        def call(client):
            pipe = client.pipeline(transaction=False)
            pipe.strlen(name)
            pipe.getrange(name, 0, _HEADER_PROBE - 1)
            size, head = pipe.execute()
            end = 8 + int.from_bytes(head[:8], "little")
            if len(head) < min(end, size):  # a header longer than the probe: read the rest
                head += client.getrange(name, len(head), end - 1)
            return size, head

        try:
            size, head = self._guard("look up", call, (0, b""))
            return read_header(io.BytesIO(head), key, size) if size else None
        except ChunkInvalid:
            return None

    def put(self, key: str, data: memoryview, length: int | None = None, parent: str = "") -> None:
        """SET the chunk (atomic on the server); raises OSError when the server cannot take it. Redis evicts
        by its own policy, which knows no ``parent``."""
        value = memoryview(data).cast("B")[:length]

        def call(client):
            ttl = None if self.ttl_s is None else int(self.ttl_s * 1000)
            client.set(self._prefix + key, value, px=ttl)
            return True

        self._note_write(key, value)
        if not self._guard("write", call, False, quiet=True):
            with self._lock:
                self._written.pop(key, None)
            raise OSError(f"{self.name}: chunk {key} not written (server unavailable or full)")
        with self._lock:
            self.bytes_written += len(value)
            self._gone.pop(key)

    def discard(self, key: str) -> None:
        self._guard("delete", lambda client: client.delete(self._prefix + key), None)
        with self._lock:
            self._gone.add(key, Loss.FAILED_VERIFICATION)

    def gone(self, key: str) -> Loss | None:
        """A chunk this node found bad and deleted; Redis's own evictions (``maxmemory``, TTL) and other
        nodes' deletions are seen only while watched."""
        with self._lock:
            return self._gone.get(key)

    def losses(self) -> list[tuple[str, Loss]]:
        with self._lock:
            return list(self._gone)

    def follow(self, lost: Callable[[str, Loss], None]) -> None:
        """Only the chunks this node finds bad: a TTL's expiry, or another node's delete, is told by
        :meth:`watch`."""
        with self._lock:
            self._gone.listeners.append(lost)

    def watch(
        self, stored: Callable[[str, tuple[ChunkLayout, dict]], None], lost: Callable[[str, Loss | None], None]
    ) -> Sight:
        """Every node's writes and deletes and the server's expiries and evictions, through its keyspace
        notifications (turned on where they are off). ``lost(key, None)`` for each chunk told stored when the
        watch's connection was lost: it is not known to be stored any more. Not for a cluster (each of its
        nodes notifies apart) or a server that will not notify: nothing is then told (a warning says why)."""
        with self._lock:
            if self._watch is None:
                if self._watch_connect is None:
                    log.warning("%s: a cluster's changes are not followed: its chunks are not told", self.name)
                    return Sight.NONE
                watch = KeyspaceWatch(
                    self._watch_connect,
                    self._prefix,
                    name=self.name,
                    event=self._changed,
                    blind=self._blind,
                    backoff_s=self.backoff_s,
                )
                try:
                    watch.start()
                except StorageError as exc:
                    log.warning("%s; its chunks are not told", exc)
                    return Sight.NONE
                self._watch = watch
            self._watchers.append((stored, lost))
        return Sight.ALL

    def _note_write(self, key: str, value: memoryview) -> None:
        """Keep a watched write's header, so that its notification need not read it back."""
        if self._watch is None:
            return
        try:
            header = read_header(io.BytesIO(value[:_HEADER_PROBE]), key, len(value))
        except ChunkInvalid:
            return  # a header past the probe: read back, as another node's
        with self._lock:
            self._written[key] = header
            while len(self._written) > _WRITES_KEPT:
                self._written.popitem(last=False)

    def _changed(self, key: str, what: str) -> None:
        """A keyspace notification, on the watch's thread."""
        if what == "set":
            with self._lock:
                header = self._written.pop(key, None)
            header = header or self.header(key)
            if header is None:  # gone again, or damaged: a read finds it so
                return
            with self._lock:
                self._told.add(key)
                watchers = list(self._watchers)
            for stored, _ in watchers:
                stored(key, header)
            return
        with self._lock:
            if key not in self._told:
                return
            self._told.discard(key)
            if self._gone.get(key) is None:
                self._gone.add(key, Loss.EVICTED)
            why, watchers = self._gone.get(key), list(self._watchers)
        for _, lost in watchers:
            lost(key, why)

    def _blind(self) -> None:
        with self._lock:
            told, self._told, watchers = self._told, set(), list(self._watchers)
            self._written.clear()
        for key in told:
            for _, lost in watchers:
                lost(key, None)

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        with self._lock:
            return time.monotonic() >= self._down_until

    def keys(self) -> list[str]:
        def call(client):
            cut = len(self._prefix)
            return sorted({k[cut:].decode() for k in client.scan_iter(match=self._prefix + "*", count=1000)})

        return self._guard("list", call, [])

    def stats(self) -> dict:
        with self._lock:
            return {
                "tier": self.name,
                "errors": self.errors,
                "skipped": self.skipped,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
            }

    def close(self) -> None:
        with self._lock:
            client, self._client, watch, self._watch = self._client, None, self._watch, None
        if watch is not None:
            watch.close()
        if client is not None:
            client.close()

    # ---- failures ----------------------------------------------------------------------------------
    def _guard(self, what: str, call, default, *, quiet: bool = False):
        """``call(client)``, or ``default`` when the server fails (counted, logged once per 100) or the
        store is backing off after a failure. ``quiet``: the caller reports the failure itself. Raises
        ChunkInvalid for a value of another type under the key."""
        try:
            return call(self._get_client())
        except _Unavailable:
            return default
        except (redis.RedisError, RedisClusterException, OSError) as exc:
            if isinstance(exc, redis.ResponseError) and "WRONGTYPE" in str(exc):
                raise ChunkInvalid(f"{self.name}: the value under a chunk's key is not a string: {exc}") from exc
            with self._lock:
                self.errors += 1
                errors = self.errors
                self._down_until = time.monotonic() + self.backoff_s
            if not quiet and (errors == 1 or errors % 100 == 0):
                log.warning(
                    "%s: could not %s (%s); %d failure(s) so far, serving goes on without it",
                    self.name,
                    what,
                    exc,
                    errors,
                )
            return default

    def _get_client(self):
        with self._lock:
            if time.monotonic() < self._down_until:
                self.skipped += 1
                raise _Unavailable
            if self._client is None:
                self._client = self._connect()
            return self._client
