"""A disk store's uses, recorded in its chunk files' times, from which a restart rebuilds the LRU order and
the TTL. A look-up must not wait for a file-system call per chunk, so the times are set by a thread of the
store's own: a use is noted (the latest per chunk), and the thread sets every noted time, until none is left."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..machine import helper_threads


def set_time(path: Path, when: float) -> None:
    """Set a chunk file's time to ``when``, its last use."""
    try:
        os.utime(path, (when, when))
    except OSError:
        pass  # evicted or replaced meanwhile: a replacement's time is as recent


class UseStamps:
    def __init__(self):
        self._lock = threading.Lock()
        self._noted: dict[Path, float] = {}
        self._running = False  # a task is queued or running
        self._thread = helper_threads.executor(1, "hcache-stamp")

    def note(self, path: Path, when: float) -> None:
        """Have the file at ``path`` stamped ``when``, soon."""
        with self._lock:
            self._noted[path] = when
            if self._running:
                return
            self._running = True
        try:
            self._thread.submit(self._set)
        except RuntimeError:  # shut down: the use is not recorded on disk
            with self._lock:
                self._running = False

    def flush(self) -> None:
        """Set every time noted so far, now: on this thread where the store's takes no more work (a store
        closed as the interpreter exits)."""
        try:
            self._thread.submit(self._set).result()
        except RuntimeError:
            self._set()

    def shutdown(self) -> None:
        """Stop the thread; times noted after this are not set."""
        self._thread.shutdown(wait=False)

    def _set(self) -> None:
        while True:
            with self._lock:
                noted, self._noted = self._noted, {}
                if not noted:
                    self._running = False
                    return
            for path, when in noted.items():
                set_time(path, when)
