"""The host tier: chunks held in host-pool slots, in front of the stores below it (the local disk, a
shared server or filesystem), which are tried in order.

- **Save.** The saver lays a chunk out in a slot (:meth:`HostTier.create`) and writes its rows there; when
  the chunk is complete it is published (:meth:`HostTier.publish`): restorable from memory at once, and
  written back to every store by writer threads, straight from the slot. A chain reaches each store in
  order: a chunk's write-back waits for that of the chunk it continues, so a store's quota keeps a chain's
  start whichever writer is quicker, and no store holds a chunk before the one it continues.
- **Restore.** :meth:`HostTier.fetch` serves a chunk in the pool at once; a miss is read from the first
  store that has it by a reader thread with one request into a new slot, and its checksums are verified
  then, once: a chunk in the pool is trusted from then on. A chunk found in a lower store is promoted: it
  stays in the pool and is written back to the stores above the one it came from.
- **Recency.** The pool hits a restore's look-up finds are passed down to the stores as uses
  (:mod:`.uses`), so that their LRU order and TTL do not evict the most used chunks first.
- **Capacity.** The pool is bounded; a chunk that nobody references is evicted to make room (it is in the
  stores already, or its write failed and it is simply lost): the least recently used, or with
  ``eviction="cost"`` the least valuable per byte and idle second, by the value its publisher gave it
  (:mod:`.eviction`). A referenced slot (a restore reads it, a write-back writes it, the saver fills it) is
  never evicted or reused. When the pool is full of
  chunks still being written back, the saver and loads wait for them (each counted apart: the saver's
  stalls hold up the forward pass, a load's a restore or a prefetch); when nothing in flight can free room,
  a chunk being saved is not saved and one being loaded is not loaded (the restore ends there), both
  counted, and serving goes on. The recency order is the stores' own :class:`~.lru_index.LruIndex`.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from ..machine import helper_threads
from ..defaults import DEFAULT_READERS
from .chunk import ChunkImage, ChunkInvalid, ChunkLayout
from .chunk_store import ChunkStore, Loss
from .eviction import Values
from .host_pool import HostPool, Slot
from .lru_index import Entry, LruIndex
from .residency import HOST, Followers, Residency, pool_changes
from .stored_chains import follow_stores
from .stored_state import Source
from .uses import Uses
from .write_back import DEFAULT_WRITERS, WriteBacks


class HostPoolFull(OSError):
    """A chunk cannot be loaded: the pool is held by chunks in use. It is kept in its store; the prefix ends."""

    def __init__(self, message: str):
        super().__init__(errno.ENOMEM, message)


@dataclass
class Stalls:
    """Waits for room in the pool by one kind of caller: how many, and how long in all."""

    count: int = 0
    seconds: float = 0.0


def _referenced(entry: Entry) -> bool:
    return entry.where.slot.refs > 0


class HostTier:
    """``stores``: the tiers below the pool, nearest first; ``readers``: threads that load chunks from them
    (0: load inline, on the caller's thread); ``writers``: threads that write chunks back; ``eviction``:
    the :mod:`.eviction` policy that makes room in the pool."""

    def __init__(
        self,
        stores: Sequence[ChunkStore],
        pool: HostPool,
        *,
        readers: int = DEFAULT_READERS,
        writers: int = DEFAULT_WRITERS,
        eviction: str = "lru",
    ):
        if readers < 0 or writers < 1:
            raise ValueError(f"a host tier needs readers >= 0 and writers >= 1, not {readers} and {writers}")
        if not stores:
            raise ValueError("a host tier needs at least one store below it")
        self.stores, self.pool = list(stores), pool
        self.hits = self.misses = self.evictions = self.unsaved = self.bytes_loaded = 0
        self.saver_stalls, self.loader_stalls = Stalls(), Stalls()  # waits for room by :meth:`create`, by loads
        self._cond = threading.Condition()
        self._index = LruIndex(pinned=_referenced, policy=eviction)  # published chunks (entries' ``where``: the image)
        self._values = Values()  # what publishers said keeping each chunk saves
        self._loading: dict[str, Future] = {}
        self._readers = helper_threads.executor(readers, "hcache-load") if readers else None
        self._writers = helper_threads.executor(writers, "hcache-writeback")
        self._uses = Uses(self.stores, self._writers, self._cond)
        current = lambda image: self._image(image.key) is image  # noqa: E731
        self._tell = Followers()
        self._write_backs = WriteBacks(pool, self._writers, self._cond, self._uses, current, self._drop_ref, self._tell)
        for store in self.stores:
            store.follow(lambda key, why, kind=store.kind: self._tell(Residency(key, kind, False, why=why)))

    def watch(self, changed: Callable[[str, Loss | None], None]) -> None:
        """Call ``changed(key, None)`` whenever a chunk enters the pool (saved here or loaded from a store)
        and ``changed(key, Loss.FAILED_VERIFICATION)`` when one is discarded from every tier as bad, so that
        a process that does not own the tier can keep an index of what it serves; first, the chunks the
        stores lost lately (at start-up too), with why. A chunk evicted from the pool alone is not reported:
        its stores still hold it. Called with a lock held: it must only note the change."""
        with self._cond:
            for store in self.stores:
                for key, why in store.losses():
                    changed(key, why)
            self._tell.add(pool_changes(changed))

    def follow(self, tell: Callable[[Residency], None]) -> None:
        """Call ``tell`` with each change of where a chunk is held, first with what the local disk and the
        pool hold now (call it at start-up, before serving); a shared store's changes as it tells them, and
        none where they go unseen (:func:`~.stored_chains.follow_stores`). With a lock held: only note it."""

        def told(change: Residency) -> None:  # from a store's watch, on its thread
            with self._cond:
                tell(change)

        own = {HOST, *follow_stores(self.stores, tell, told)}
        with self._cond:
            for entry in self._index.entries.values():
                tell(Residency.entered(HOST, entry.where))
            self._tell.add(lambda change: change.tier in own and tell(change))

    @property
    def eviction(self) -> str:
        return self._index.policy

    @property
    def write_errors(self) -> int:
        """Writes a store below refused (the chunk stays in the pool)."""
        return self._write_backs.errors

    # ---- lookups --------------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.stored_prefix([key]) == 1

    def stored_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored in some tier: one batched look-up per store."""
        with self._cond:
            n = next((i for i, key in enumerate(keys) if key not in self._index), len(keys))
            self._uses.note(keys[:n])
        missing = list(keys[n:])
        for store in self.stores:
            if not missing:
                break
            missing = [key for key, hit in zip(missing, store.contains_many(missing)) if not hit]
        gaps = set(missing)
        return next((i for i, key in enumerate(keys) if key in gaps), len(keys))

    def keys(self) -> list[str]:
        with self._cond:
            found = set(self._index.entries)
        for store in self.stores:
            found.update(store.keys())
        return sorted(found)

    def resident(self, key: str) -> bool:
        """Whether the chunk is in host memory now."""
        with self._cond:
            return key in self._index

    def hold(self, key: str) -> ChunkImage | None:
        """The chunk if it is in host memory now, referenced for the caller (who must :meth:`release` it), so
        that it stays: a pin, which reads no store and counts no hit."""
        with self._cond:
            image = self._image(key)
            if image is not None:
                self.pool.ref(image.slot)
            return image

    # ---- restore side ---------------------------------------------------------------------------------
    def fetch(self, key: str) -> Future:
        """The chunk, referenced for the caller (who must :meth:`release` it), or None if it is not stored.
        The future raises :class:`ChunkInvalid` for a chunk that fails its checks (it is then discarded)
        and OSError for one that could not be read (it is kept: that proves nothing about it)."""
        with self._cond:
            image = self._image(key)
            if image is not None:
                self.hits += 1
                self._index.touch(key)
                self.pool.ref(image.slot)
                done: Future = Future()
                done.set_result(image)
                return done
            self.misses += 1
            first = self._loading.get(key)
            if first is None:
                first = self._loading[key] = Future()  # registered before it runs: a second fetch waits on it
                return self._run(first, self._load, key)
        return self._run(Future(), self._share, key, first)

    def release(self, image: ChunkImage) -> None:
        with self._cond:
            self._drop_ref(image)
            self._cond.notify_all()

    def _run(self, future: Future, fn, *args) -> Future:
        """Resolve ``future`` with ``fn(*args)`` on a reader thread (inline without readers)."""

        def task() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

        if self._readers is None:
            task()
            return future
        try:
            self._readers.submit(task)
        except RuntimeError as exc:  # shut down: nobody may wait on this future forever
            with self._cond:
                if self._loading.get(args[0]) is future:
                    del self._loading[args[0]]
            future.set_exception(exc)
        return future

    def _load(self, key: str) -> ChunkImage | None:
        """Load ``key`` from the first store that serves it whole. A copy that fails its checks is discarded
        from its store, and one that cannot be read is kept; either way the next store is tried, and its
        copy, once verified, is promoted over the bad one. The last failure is raised if no store serves it."""
        taken: list[Slot] = []

        def take(size: int) -> memoryview:
            if taken:  # the store asks again (its file changed length): it reads into the new slot
                self._free_unpublished(taken)
                taken.clear()
            slot = self._alloc(size, self.loader_stalls)
            if slot is None:
                raise HostPoolFull(
                    f"the host pool ({self.pool.capacity} bytes) is held by chunks in use; raise host_bytes"
                )
            taken.append(slot)
            return self.pool.buffer(slot)

        image, failure = None, None
        try:
            for found, store in enumerate(self.stores):
                try:
                    size = store.read_into(key, take)
                    if size is not None:
                        image = ChunkImage.parse(self.pool.view(taken[0]), key, size, slot=taken[0])
                        image.source = store.kind
                        break
                except HostPoolFull:
                    raise
                except (ChunkInvalid, OSError) as exc:
                    failure = exc
                    if isinstance(exc, ChunkInvalid) and exc.discard:
                        store.discard(key)  # not the pool's copy: one published meanwhile is not this one
                self._free_unpublished(taken)
                taken.clear()
        except BaseException:
            self._free_unpublished(taken)
            with self._cond:
                self._loading.pop(key, None)
            raise
        with self._cond:
            self._loading.pop(key, None)
            if image is None:
                if failure is not None:
                    raise failure
                return None
            self.bytes_loaded += size
            if key in self._index:  # published meanwhile: serve that copy
                self._free_unpublished(taken)
                image = self._image(key)
                self.pool.ref(image.slot)
                return image
            self._add(key, image)
            if found:  # promote it into the stores above the one that had it
                self.pool.ref(image.slot)
                self._write_backs.start(image, self.stores[:found])
        return image

    def take_source(self, image: ChunkImage) -> str:
        """Where a restore that reads ``image`` got it, and from now on ``host`` for the next one: ``host``
        if it was in the pool already (saved here, or read by an earlier restore), else the kind of the
        store it was read from, for this restore or by a prefetch ahead of it. Each restore that reads the
        chunk calls this once: the first is credited with the store's read, the later ones with the pool."""
        with self._cond:
            found, image.source = image.source, Source.HOST.value
        return found

    def _share(self, key: str, first: Future) -> ChunkImage | None:
        """A second fetch of a chunk being loaded: wait for that load, then take a reference of one's own."""
        if first.result() is None:
            return None
        with self._cond:
            image = self._image(key)
            if image is None:
                return None  # evicted or discarded meanwhile: the prefix ends here, which is safe
            self.pool.ref(image.slot)
            return image

    # ---- save side ------------------------------------------------------------------------------------
    def create(self, layout: ChunkLayout, fingerprint: str) -> ChunkImage | None:
        """An empty chunk image in a new slot, referenced for the caller (:meth:`publish` or :meth:`abandon`
        it), or None when the pool cannot hold it even after every write-back in flight has finished."""
        slot = self._alloc(layout.nbytes, self.saver_stalls)
        if slot is None:
            with self._cond:
                self.unsaved += 1
            return None
        return ChunkImage(self.pool.view(slot), layout, fingerprint, slot=slot)

    def abandon(self, image: ChunkImage) -> None:
        """Give back an image that will not be published."""
        self._free_unpublished([image.slot])

    def publish(
        self, image: ChunkImage, key: str, tokens: list[int], value: float | None = None, parent: str = ""
    ) -> None:
        """Name a complete chunk and make it restorable now; write it back to the stores in the background.
        ``value``: what keeping it in the pool saves (``eviction="cost"``), remembered for when it is loaded again;
        ``parent``: the key of the chunk before it in its chain (its stores keep that one at least as long).
        The caller's reference passes to the write-back, which writes its header. A chunk already held
        with every tensor this one has is kept, and this one given back; one held with fewer (saved by
        another plan) is replaced, in the pool now and in each store by the write-back."""
        image.key, image.tokens, image.parent = key, list(tokens), parent
        with self._cond:
            if value is not None:
                self._values.set(key, value)
            if self._keeps(key, image):
                return
            old = self._index.remove(key)
            if old is not None and old.where.slot.refs == 0:
                self.pool.free(old.where.slot)
            self._add(key, image)
            self._write_backs.start(image, self.stores, seal=True)

    def _keeps(self, key: str, image: ChunkImage) -> bool:
        """With the lock held: whether the pool holds ``key`` with every tensor ``image`` has (then
        ``image`` is given back)."""
        held = self._image(key)
        if held is None or not held.names >= image.names:
            return False
        self._index.touch(key)
        self._drop_ref(image)
        return True

    def flush(self) -> None:
        """Wait until every published chunk has been written back to every store (or has failed to be),
        and every use noted has been passed down."""
        with self._cond:
            while self._write_backs.in_flight or self._uses.queued:
                self._cond.wait()

    # ---- capacity -------------------------------------------------------------------------------------
    def _image(self, key: str) -> ChunkImage | None:
        """With the lock held: the published chunk ``key`` in the pool, or None."""
        entry = self._index.entries.get(key)
        return None if entry is None else entry.where

    def _add(self, key: str, image: ChunkImage) -> None:
        """With the lock held: publish ``image`` in the pool as the most recently used chunk."""
        self._index.add(key, Entry(image.slot.nbytes, self._index.clock(), image, value=self._values.get(key)))
        self._tell(Residency.entered(HOST, image))

    def _alloc(self, nbytes: int, stalls: Stalls) -> Slot | None:
        """A new slot, evicting unreferenced chunks by the policy to make room, and waiting for
        write-backs in flight while nothing else can (each wait counted in ``stalls``); None if even
        they cannot free enough."""
        began = None
        with self._cond:
            while True:
                slot = self.pool.alloc(nbytes)
                if slot is not None:
                    break
                victim = self._index.pop_victim()
                if victim is not None:
                    self.pool.free(victim[1].where.slot)
                    self.evictions += 1
                    self._tell(Residency(victim[0], HOST, False))
                    continue
                if not self._write_backs.in_flight:
                    break
                if began is None:
                    began = time.perf_counter()
                    stalls.count += 1
                self._cond.wait()
            if began is not None:
                stalls.seconds += time.perf_counter() - began
            return slot

    def _drop_ref(self, image: ChunkImage) -> None:
        """Called with the lock held. The last reference to a chunk discarded or replaced meanwhile frees it."""
        if self.pool.unref(image.slot) == 0 and self._image(image.key) is not image:
            self.pool.free(image.slot)

    def _free_unpublished(self, slots: list[Slot]) -> None:
        with self._cond:  # reentrant: a Condition's default lock is an RLock
            for slot in slots:
                self.pool.unref(slot)
                self.pool.free(slot)
            self._cond.notify_all()

    def discard(self, key: str) -> None:
        """Forget a chunk found bad, in memory and in every store (a restore reading it keeps its slot until
        it releases it)."""
        with self._cond:
            entry = self._index.remove(key)
            if entry is not None and entry.where.slot.refs == 0:
                self.pool.free(entry.where.slot)
            self._tell(Residency(key, HOST, False, why=Loss.FAILED_VERIFICATION))
        for store in self.stores:
            store.discard(key)

    def drop_resident(self) -> int:
        """Evict every chunk nobody references (the next restore of them reads a store); how many."""
        with self._cond:
            idle = self._index.remove_unpinned()
            for key, entry in idle:
                self.pool.free(entry.where.slot)
                self._tell(Residency(key, HOST, False))
            self._cond.notify_all()
            return len(idle)

    def stats(self) -> dict:
        with self._cond:
            return {
                "resident_chunks": len(self._index),
                "pool_used_bytes": self.pool.used_bytes,
                "pool_capacity_bytes": self.pool.capacity,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "saver_stalls": self.saver_stalls.count,
                "saver_stall_seconds": self.saver_stalls.seconds,
                "loader_stalls": self.loader_stalls.count,
                "loader_stall_seconds": self.loader_stalls.seconds,
                "unsaved": self.unsaved,
                "write_errors": self.write_errors,
                "bytes_loaded": self.bytes_loaded,
                "stores": [store.stats() for store in self.stores],
            }

    def close(self) -> None:
        """Finish every write-back, stop the threads and close the stores."""
        self.flush()
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        for store in self.stores:
            store.close()
