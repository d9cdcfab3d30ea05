"""Aligned file I/O: O_DIRECT where the filesystem allows it, buffered I/O where it does not.

O_DIRECT bypasses the page cache, so a restore reads at the device's speed without evicting the host's
working set, and a save does not fill the page cache with state that is read back rarely. It needs the
buffer address, the file offset and the length aligned to the device's block; an anonymous mmap gives a
page-aligned buffer, and byte ranges are served from the covering aligned range. Filesystems without
O_DIRECT (tmpfs on older kernels, some network filesystems) answer EINVAL; those use plain buffered I/O.
"""
from __future__ import annotations

import errno
import io
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
_MIN_WINDOW = 1 << 20  # a read pulls in at least this much: the header and the first layers come in one request


class _BufferPool:
    """Page-aligned buffers for reuse across files and threads (at most ``keep`` are held idle)."""

    def __init__(self, keep: int = 32):
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._keep = keep

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    return self._free.pop(i)
        return mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


_WINDOWS = _BufferPool()


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def open_fd(path: str | os.PathLike, flags: int, direct: bool, mode: int = 0o644) -> tuple[int, bool]:
    """``os.open`` with O_DIRECT when asked and allowed; returns the fd and whether it is direct."""
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def supports_direct(directory: Path) -> bool:
    """Whether files in ``directory`` can be written and read with O_DIRECT (probed with a real block)."""
    probe = directory / f".direct-probe-{os.getpid()}"
    try:
        fd, direct = open_fd(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, True)
        try:
            if direct:
                buf = mmap.mmap(-1, ALIGN)
                os.pwrite(fd, buf, 0)
                os.preadv(fd, [buf], 0)
            return direct
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return False
        finally:
            os.close(fd)
    finally:
        probe.unlink(missing_ok=True)


def write_file(path: Path, data: bytes | memoryview, direct: bool, sync: bool) -> bool:
    """Create ``path`` holding ``data``; returns whether it was written with O_DIRECT.

    A direct write covers whole blocks, so the file is padded and then truncated to its real length.
    """
    fd, direct = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, direct)
    try:
        if direct:
            buf = mmap.mmap(-1, _round_up(len(data)) or ALIGN)  # unmapped when collected
            buf[: len(data)] = data
            _write_all(fd, memoryview(buf))
            os.ftruncate(fd, len(data))
        else:
            _write_all(fd, memoryview(data).cast("B"))
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)
    return direct


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], done)
        if n == 0:
            raise OSError(errno.EIO, "short write")
        done += n


class AlignedReader(io.RawIOBase):
    """A seekable read-only file over an fd, safe to use from one thread while others use their own.

    Reads use ``pread`` (no shared file offset). With O_DIRECT a read fetches the covering aligned range,
    at least ``_MIN_WINDOW`` bytes, into a page-aligned buffer that is kept as a read-ahead window: the
    header and the next layers cost one device request. Windows come from a pool and go back to it on
    close: a fresh buffer per read costs more in page faults than the read itself. ``on_close`` runs once, when the file is closed
    (the store unpins the chunk there).
    """

    def __init__(self, fd: int, direct: bool, on_close: Callable[[], None] = lambda: None):
        super().__init__()
        self._fd, self.direct, self._on_close = fd, direct, on_close
        self._size = os.fstat(fd).st_size
        self._pos = 0
        self._window: mmap.mmap | None = None
        self._window_start = self._window_len = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        if n == 0:
            return 0
        if not self.direct:
            got = os.preadv(self._fd, [view[:n]], self._pos)
        else:
            got = self._read_direct(view[:n])
        self._pos += got
        return got

    def _read_direct(self, out: memoryview) -> int:
        self._fill(self._pos, len(out))
        begin = self._pos - self._window_start
        got = max(0, min(len(out), self._window_len - begin))
        out[:got] = memoryview(self._window)[begin : begin + got]
        return got

    def _fill(self, offset: int, n: int) -> None:
        """Make the window cover ``[offset, offset + n)`` with one aligned request of at least the window size."""
        if self._window_start <= offset and offset + n <= self._window_start + self._window_len:
            return
        start = offset - offset % ALIGN
        length = _round_up(max(offset + n - start, _MIN_WINDOW))
        if self._window is None or len(self._window) < length:
            if self._window is not None:
                _WINDOWS.give(self._window)
            self._window = _WINDOWS.take(length)
        self._window_start = start
        self._window_len = os.preadv(self._fd, [memoryview(self._window)[:length]], start)

    def close(self) -> None:
        if self.closed:
            return
        try:
            os.close(self._fd)
            if self._window is not None:
                _WINDOWS.give(self._window)
                self._window = None
        finally:
            super().close()
            self._on_close()
