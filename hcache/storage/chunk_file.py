"""One chunk file published atomically: written to a temporary name, flushed to the device and renamed into
place, so a chunk name never refers to a torn file whenever the writer dies; and never over a chunk file of
another layout version (another hcache's), which is left alone."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from . import direct_io as dio
from .chunk import ChunkInvalid, ChunkOtherVersion, read_header
from .store_dir import DIR_MODE
from .use_stamps import set_time


class OtherVersionStored(OSError):
    """A chunk file of another layout version (another hcache's) holds the key: left alone, not replaced."""

    def __init__(self, message: str):
        super().__init__(errno.EEXIST, message)


def publish(path: Path, key: str, data: memoryview, size: int, direct: bool, fsync: bool, stamp: float) -> bool:
    """``data[:size]`` as chunk ``key``'s file at ``path``, its time ``stamp`` (the store's clock, which a
    restart reads back). ``direct``: whether O_DIRECT may be tried; returns whether it may be next time.
    Raises OSError (:class:`OtherVersionStored`, ENOSPC, EIO, ...) with nothing published."""
    tmp = path.with_name(f".{key}.{uuid.uuid4().hex}.tmp")
    try:
        _refuse_other_version(path, key)
        path.parent.mkdir(mode=DIR_MODE, exist_ok=True)
        direct = dio.write_file(tmp, data, size, direct, fsync)
        os.replace(tmp, path)  # the data is on the device first, so a crash never leaves a torn chunk
        set_time(path, stamp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return direct


def _refuse_other_version(path: Path, key: str) -> None:
    """Raise :class:`OtherVersionStored` if ``path`` holds a chunk of another layout version; a file of this
    version, damaged or not, or none, may be replaced."""
    try:
        with open(path, "rb") as f:
            read_header(f, key, os.fstat(f.fileno()).st_size)
    except ChunkOtherVersion as exc:
        raise OtherVersionStored(f"{exc}: left alone, not replaced") from None
    except (OSError, ChunkInvalid):
        pass
