"""Pool hits passed down to the stores below the host tier as uses (:meth:`ChunkStore.touch`).

A pool hit is a use the stores would never see, and their LRU order and TTL would then evict or expire the
most used chunks first (a system prompt every conversation shares). So the hits a look-up finds are noted
here and passed down in batches on a writer thread: off the restore's path, yet before the puts of any
write-back queued after them (a write-back calls :meth:`Uses.pass_down` first).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Executor

from .chunk_store import ChunkStore


class Uses:
    """Uses noted under the tier's ``cond`` and passed to ``stores`` on ``writers``; ``queued`` counts the
    tasks not finished yet (the tier's flush waits for none), and ``cond`` is notified as each ends."""

    def __init__(self, stores: list[ChunkStore], writers: Executor, cond: threading.Condition):
        self.stores, self.writers, self.cond = stores, writers, cond
        self.queued = 0
        self._keys: dict[str, None] = {}  # not passed down yet, in order
        self._passing = threading.Lock()  # held while uses are passed down

    def note(self, keys: Sequence[str]) -> None:
        """With ``cond`` held: queue pool hits to be passed down."""
        if not keys:
            return
        waiting = bool(self._keys)
        self._keys.update(dict.fromkeys(keys))
        if waiting:
            return  # a task queued already takes these too
        self.queued += 1
        try:
            self.writers.submit(self._task)
        except RuntimeError:  # shut down
            self.queued -= 1
            self._keys.clear()

    def _task(self) -> None:
        try:
            self.pass_down()
        finally:
            with self.cond:
                self.queued -= 1
                self.cond.notify_all()

    def pass_down(self) -> None:
        """Touch every use noted so far in every store. Uses being passed by another thread are passed
        when this returns, so a write-back that calls it first evicts by an order that includes them."""
        with self._passing:
            with self.cond:
                keys, self._keys = list(self._keys), {}
            if keys:
                for store in self.stores:
                    store.touch(keys)
