"""One process per store directory, unless every process opens it as shared.

A private store's index, quota and LRU order live in the process that opened it. A second process on the
same directory would count the quota alone, delete the first one's temporary files at start-up, and evict
by stale file times. So the first process to open a directory takes an exclusive ``flock`` on its
``hcache-store.lock`` (the kernel drops it when the process dies, however it dies), and any other process
is refused with a clear error. A shared store (several nodes over one filesystem) takes the lock shared:
any number of shared openers, and no private one while they hold it. Store objects within one process
share the lock (in one mode), so only the first of them may delete temporary files at start-up: the others'
writes may be in flight. A forked child does not inherit its parent's lock.
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

_held: dict[Path, list] = {}  # directory -> [fd, store objects using it, shared]
_mutex = threading.Lock()
# Releases asked for and not yet done. A store's release may run from its finalizer, which the garbage
# collector can call in a thread that holds _mutex already (inside acquire): a release never waits for the
# mutex, its holder does the releases as it lets go.
_releases: list[Path] = []


def acquire(directory: Path, shared: bool = False) -> tuple[Callable[[], None], bool]:
    """Hold ``directory`` for this process (``shared``: along with other shared holders); returns the
    release (call it once) and whether no other store object of this process holds it."""
    key = directory.resolve()
    try:
        with _mutex:
            _drop_released()
            return _hold(key, directory, shared)
    finally:
        _settle()


def _hold(key: Path, directory: Path, shared: bool) -> tuple[Callable[[], None], bool]:
    """The hold, under _mutex."""
    entry = _held.get(key)
    if entry is None:
        fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "shared"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StorageError(f"cannot lock the store directory {directory}: {exc}") from exc
            raise StorageError(
                f"the store directory {directory} is in use by another process (pid {holder}); give each "
                "process (each MII replica) a directory of its own, or open it as shared in every one"
            ) from None
        os.ftruncate(fd, 0)  # a shared store names no holder
        if not shared:
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        entry = _held[key] = [fd, 0, shared]
    elif entry[2] != shared:
        raise StorageError(
            f"the store directory {directory} is open here as {'shared' if entry[2] else 'private'} already"
        )
    entry[1] += 1
    return functools.partial(_release, key), entry[1] == 1


def _release(key: Path) -> None:
    _releases.append(key)
    _settle()


def _settle() -> None:
    """Do the releases asked for, unless another holds _mutex: it does them as it lets go."""
    while _releases and _mutex.acquire(blocking=False):
        try:
            _drop_released()
        finally:
            _mutex.release()


def _drop_released() -> None:
    while _releases:
        key = _releases.pop()
        entry = _held.get(key)
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] == 0:
            os.close(entry[0])  # drops the lock
            del _held[key]


def _forget_in_child() -> None:
    """A child's copies of the parent's lock fds: closing them leaves the parent's locks held."""
    global _mutex
    _mutex = threading.Lock()
    _releases.clear()
    for fd, *_ in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)
