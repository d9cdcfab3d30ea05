"""Memory another process can map: a memfd, mapped shared. Its pages come on first touch, as anonymous
memory's do, and /dev/shm's size does not bound them."""

from __future__ import annotations

import mmap
import os

import torch


def memfd(nbytes: int, name: str) -> int:
    """A memfd of ``nbytes``, closed on exec: a child gets it only where it is passed (``Popen``'s
    ``pass_fds``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def mapping(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)


def mapped(fd: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of ``fd``, mapped shared, as a uint8 tensor (which keeps the mapping)."""
    return torch.frombuffer(mapping(fd, nbytes), dtype=torch.uint8)
