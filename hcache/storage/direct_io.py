"""Whole-file I/O with O_DIRECT where the filesystem allows it, buffered I/O where it does not.

O_DIRECT bypasses the page cache, so a restore reads at the device's speed without evicting the host's
working set, and a save does not fill the page cache with state that is read back rarely. It needs the
buffer address, the file offset and the length aligned to the device's block. The callers hand over
host-pool slots, which are page-aligned and a whole number of pages long, so a chunk moves with one
request and no bounce buffer; a buffer that is not aligned goes through a private aligned copy.
Filesystems without O_DIRECT (tmpfs on older kernels, some network filesystems) answer EINVAL; those use
plain buffered I/O. Files are created 0600 whatever the umask: a chunk holds a conversation's token ids.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

from .host_pool import PAGE as ALIGN
from .host_pool import round_up as _round_up

FILE_MODE = 0o600
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _private_buffer(size: int) -> mmap.mmap:
    """Page-aligned anonymous memory that a forked child does not share (Python's default is MAP_SHARED)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _aligned(view: memoryview) -> bool:
    address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else None
    return address is not None and address % ALIGN == 0 and len(view) % ALIGN == 0


def open_fd(path: str | os.PathLike, flags: int, direct: bool) -> tuple[int, bool]:
    """``os.open`` with O_DIRECT when asked and allowed; returns the fd and whether it is direct."""
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, FILE_MODE), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, FILE_MODE), False


def supports_direct(directory: Path) -> bool:
    """Whether files in ``directory`` can be written and read with O_DIRECT (probed with a real block)."""
    probe = directory / f".direct-probe-{os.getpid()}"
    try:
        fd, direct = open_fd(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, True)
        try:
            if direct:
                buf = _private_buffer(ALIGN)
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


def write_file(path: Path, data: memoryview, length: int, direct: bool, sync: bool) -> bool:
    """Create ``path`` holding ``data[:length]``; returns whether it was written with O_DIRECT.

    A direct write covers whole blocks: from an aligned buffer it writes the padded length in place and
    truncates the file to ``length``."""
    data = memoryview(data).cast("B")
    fd, direct = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, direct)
    try:
        if direct:
            padded = _round_up(length) or ALIGN
            if len(data) >= padded and _aligned(data[:padded]):
                _write_all(fd, data[:padded])
            else:
                buf = _private_buffer(padded)
                buf[:length] = data[:length]
                _write_all(fd, memoryview(buf))
            os.ftruncate(fd, length)
        else:
            _write_all(fd, data[:length])
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


class LengthChanged(OSError):
    """A file is not the length its reader was told: replaced, or damaged, since it was looked up."""

    def __init__(self, path: Path, length: int, actual: int):
        super().__init__(errno.EIO, f"{path} is {actual} bytes, not the {length} looked up")
        self.actual = actual


def read_file(path: Path, out: memoryview, length: int, direct: bool) -> None:
    """Read the whole ``length``-byte file into ``out`` with one request where it can (``out`` holds at least
    ``length`` rounded up to a block); raises FileNotFoundError if it is gone, :class:`LengthChanged` if it
    is no longer that long, OSError if it cannot be read."""
    out = memoryview(out).cast("B")
    fd, direct = open_fd(
        path, os.O_RDONLY, direct and len(out) >= _round_up(length) and _aligned(out[: _round_up(length)])
    )
    try:
        actual = os.fstat(fd).st_size
        if actual != length:  # not the file asked for
            raise LengthChanged(path, length, actual)
        want = _round_up(length) if direct else length
        done = 0
        while done < length:
            n = os.preadv(fd, [out[done:want]], done)
            if n == 0:
                raise OSError(errno.EIO, f"{path}: {done} of {length} bytes")
            done += n
    finally:
        os.close(fd)
