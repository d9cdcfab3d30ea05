"""One process per store directory.

A store's index, quota and LRU order live in the process that opened it. A second process on the same
directory would count the quota alone, delete the first one's temporary files at start-up, and evict by
stale file times. So the first process to open a directory takes an exclusive ``flock`` on its
``hcache-store.lock`` (the kernel drops it when the process dies, however it dies), and any other process
is refused with a clear error. Store objects within one process share the lock; a forked child does not
inherit its parent's.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import StorageError

LOCK_NAME = "hcache-store.lock"

_held: dict[Path, list[int]] = {}  # directory -> [fd, store objects using it]
_mutex = threading.Lock()


def acquire(directory: Path) -> Callable[[], None]:
    """Hold ``directory`` for this process; returns the release (call it once)."""
    key = directory.resolve()
    with _mutex:
        entry = _held.get(key)
        if entry is None:
            fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise StorageError(f"cannot lock the store directory {directory}: {exc}") from exc
                raise StorageError(
                    f"the store directory {directory} is in use by another process (pid {holder}); give each "
                    "process (each MII replica) a directory of its own"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            entry = _held[key] = [fd, 0]
        entry[1] += 1
    return functools.partial(_release, key)


def _release(key: Path) -> None:
    with _mutex:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            os.close(entry[0])  # drops the lock
            del _held[key]


def _forget_in_child() -> None:
    """A child's copies of the parent's lock fds: closing them leaves the parent's locks held."""
    global _mutex
    _mutex = threading.Lock()
    for fd, _ in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)
