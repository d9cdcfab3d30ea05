"""Write-back: chunks published in the host pool written to the stores below it by writer threads, straight
from their slots, each chain in order.

A chunk's write-back waits for every write-back of the chunk it continues (its parent) to end, so a store's
quota keeps a chain's start whichever writer is quicker, and no store holds a chunk before the one it
continues. A store that has the chunk already, with as many formats and a header that agrees, is skipped;
one that refuses it (ENOSPC, EIO, a full quota, a server down) is counted and logged, and serving goes on:
the chunk stays in the pool. Uses noted before a write-back are passed down before its puts (:mod:`.uses`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Executor

from .chunk import ChunkImage
from .chunk_store import ChunkStore
from .host_pool import HostPool
from .residency import Residency
from .uses import Uses

log = logging.getLogger(__name__)

DEFAULT_WRITERS = 2

_Job = tuple[ChunkImage, list[ChunkStore], bool]  # a chunk, the stores to write it to, whether to seal it first


class WriteBacks:
    """Write-backs run on ``writers`` under the tier's ``cond``, which is notified as each ends.
    ``current(image)``: with ``cond`` held, whether ``image`` is still the chunk its key names in the pool
    (one replaced or discarded since is not written: its write would undo that); ``release(image)``: with
    ``cond`` held, give back the reference a write-back held. ``in_flight``: write-backs not ended yet;
    ``errors``: writes a store refused."""

    def __init__(
        self,
        pool: HostPool,
        writers: Executor,
        cond: threading.Condition,
        uses: Uses,
        current: Callable[[ChunkImage], bool],
        release: Callable[[ChunkImage], None],
        tell: Callable[[Residency], None],
    ):
        """``tell``: told when a store holds a chunk, written or found there."""
        self.pool, self.writers, self.cond, self.uses = pool, writers, cond, uses
        self.current, self.release, self.tell = current, release, tell
        self.in_flight = self.errors = 0
        self._writing: Counter[str] = Counter()  # write-backs of each key not ended yet
        self._behind: defaultdict[str, list[_Job]] = defaultdict(list)  # waiting for a key's write-backs

    def start(self, image: ChunkImage, stores: list[ChunkStore], *, seal: bool = False) -> None:
        """With ``cond`` held: hand the caller's reference to ``image`` to a writer thread that writes it
        to ``stores`` (``seal``: first writing its header), once the write-backs of its parent have ended."""
        self.in_flight += 1
        self._writing[image.key] += 1
        job = (image, stores, seal)
        if image.parent in self._writing:
            self._behind[image.parent].append(job)
        else:
            self._submit([job])

    def _submit(self, jobs: list[_Job]) -> None:
        """With ``cond`` held: start write-backs. Once the writers are shut down, each is given up (its chunk
        stays in memory only), and so are those waiting for it."""
        while jobs:
            job = jobs.pop()
            try:
                self.writers.submit(self._write, *job)
            except RuntimeError:
                jobs.extend(self._ended(job[0]))

    def _ended(self, image: ChunkImage) -> list[_Job]:
        """With ``cond`` held: a write-back of ``image`` ended or was given up; the write-backs that waited
        for the last of its key's."""
        self.in_flight -= 1
        self.release(image)
        self.cond.notify_all()
        self._writing[image.key] -= 1
        if self._writing[image.key]:
            return []
        del self._writing[image.key]
        return self._behind.pop(image.key, [])

    def _write(self, image: ChunkImage, stores: list[ChunkStore], seal: bool) -> None:
        try:
            self.uses.pass_down()
            if seal:
                image.seal()  # checksums here, off the saver's path: the rows no longer change
            for store in stores:
                with self.cond:
                    if not self.current(image):
                        return
                held = store.header(image.key)
                try:
                    if held is None or not image.stored_in(*held):  # else that store has it, and its header agrees
                        store.put(image.key, self.pool.buffer(image.slot), image.nbytes, image.parent)
                except Exception as exc:  # ENOSPC, EIO, a full quota, a server down: serving goes on
                    with self.cond:
                        self.errors += 1
                        errors = self.errors
                    if errors == 1 or errors % 100 == 0:
                        log.warning(
                            "could not write chunk %s to %s (%s); %d write(s) failed so far",
                            image.key,
                            _label(store),
                            exc,
                            errors,
                        )
                    continue
                self.tell(Residency.entered(store.kind, image))
        finally:
            with self.cond:
                self._submit(self._ended(image))


def _label(store: ChunkStore) -> str:
    return getattr(store, "name", type(store).__name__)
