"""One host arena for every chunk in host memory: allocated once, pinned when a GPU is used, page-aligned.

A slot is a page-aligned extent of the arena, indexed and refcounted. It holds one chunk's file image,
so the disk reads and writes a chunk with one O_DIRECT request straight into or out of its slot, and a
GPU copies a chunk's layer with one DMA from it (pinned memory). Extents are placed first-fit and
coalesced on free; the chunks of one runtime all have one size, so the arena does not fragment in
practice. Who may free a slot (and when) is the owner's policy: the pool only refuses to free a slot
that is still referenced.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref

import torch

from .shared_memory import mapping, memfd

PAGE = 4096


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context, and in the GPU's address
# space, so a kernel reads a slot in place (:func:`~hcache.ops.device_copy.host_alias`)
_HOST_REGISTER_FLAGS = 1 | 2


def _register(owner: object, memory: mmap.mmap, arena: torch.Tensor) -> None:
    """Page-lock ``arena`` (``memory``'s pages) for DMA to the GPU, and map them for its kernels, while
    ``owner`` lives (unregistering does not free it). A forked child does not inherit the mapping: a
    copy-on-write page of the parent would move away from under the DMA that the registration points at."""
    memory.madvise(mmap.MADV_DONTFORK)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(arena.data_ptr(), arena.numel(), _HOST_REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cannot pin a host pool of {arena.numel()} bytes (cudaHostRegister error {int(err)})")
    weakref.finalize(owner, cudart.cudaHostUnregister, arena.data_ptr())


class Slot:
    __slots__ = ("index", "start", "nbytes", "refs")

    def __init__(self, index: int, start: int, nbytes: int):
        self.index, self.start, self.nbytes, self.refs = index, start, nbytes, 1


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Python < 3.13 lacks the name; Linux's value on x86 and arm


class HostPool:
    """``capacity_bytes`` of host memory (rounded down to pages). ``pin``: page-locked, for DMA to a GPU;
    ``shareable``: on a memfd (:attr:`fd`), which another process may map, to read and write the same
    pages (``mmap(fd, capacity, MAP_SHARED)``).

    Thread-safe. A new slot holds one reference; :meth:`ref` and :meth:`unref` count the others, and
    :meth:`free` returns an unreferenced slot's pages."""

    def __init__(self, capacity_bytes: int, pin: bool = False, shareable: bool = False):
        capacity = capacity_bytes // PAGE * PAGE
        if capacity <= 0:
            raise ValueError(f"a host pool needs at least one page ({PAGE} bytes), not {capacity_bytes}")
        self.capacity, self.pinned = capacity, pin
        self.fd: int | None = None
        if shareable:
            self.fd = memfd(capacity, "hcache-host-pool")
            weakref.finalize(self, os.close, self.fd)
            self._memory = mapping(self.fd, capacity)
        else:
            # Private (a forked child gets its own copy, unless the pool is pinned), page-aligned, and not charged against the commit limit
            # until touched (MAP_NORESERVE): a 4 GiB pool costs nothing unused, and a process holding several can
            # still fork.
            self._memory = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self.arena = torch.frombuffer(self._memory, dtype=torch.uint8)
        if pin:  # registered in place: torch's pinned allocator would round the size up to a power of two
            _register(self, self._memory, self.arena)
        self._lock = threading.Lock()
        self._free: list[list[int]] = [[0, capacity]]  # [start, length], sorted by start, coalesced
        self._slots: list[Slot | None] = []
        self._unused: list[int] = []  # indices of freed table entries
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> Slot | None:
        """A slot of at least ``nbytes`` (rounded up to pages), or None if no free extent is that large."""
        size = round_up(max(nbytes, 1))
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[i]
                    else:
                        self._free[i] = [start + size, length - size]
                    index = self._unused.pop() if self._unused else len(self._slots)
                    slot = Slot(index, start, size)
                    if index == len(self._slots):
                        self._slots.append(slot)
                    else:
                        self._slots[index] = slot
                    self.used_bytes += size
                    return slot
        return None

    def ref(self, slot: Slot) -> None:
        with self._lock:
            if self._slots[slot.index] is not slot:
                raise RuntimeError(f"slot {slot.index} has been freed")
            slot.refs += 1

    def unref(self, slot: Slot) -> int:
        """Drop one reference; the count left."""
        with self._lock:
            if slot.refs <= 0:
                raise RuntimeError(f"slot {slot.index} has no reference to drop")
            slot.refs -= 1
            return slot.refs

    def free(self, slot: Slot) -> None:
        """Return an unreferenced slot's pages to the arena."""
        with self._lock:
            if slot.refs != 0 or self._slots[slot.index] is not slot:
                raise RuntimeError(f"slot {slot.index} is referenced ({slot.refs}) or already freed")
            self._slots[slot.index] = None
            self._unused.append(slot.index)
            self.used_bytes -= slot.nbytes
            starts = [s for s, _ in self._free]
            i = bisect.bisect(starts, slot.start)
            self._free.insert(i, [slot.start, slot.nbytes])
            if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
                self._free[i][1] += self._free.pop(i + 1)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1][1] += self._free.pop(i)[1]

    def view(self, slot: Slot, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """The slot's bytes ``[offset, offset + nbytes)`` as a uint8 tensor (no copy)."""
        end = slot.nbytes if nbytes is None else offset + nbytes
        if not 0 <= offset <= end <= slot.nbytes:
            raise ValueError(f"bytes [{offset}, {end}) are outside slot {slot.index} of {slot.nbytes} bytes")
        return self.arena[slot.start + offset : slot.start + end]

    def buffer(self, slot: Slot) -> memoryview:
        """The whole slot as a writable buffer, for ``preadv``/``pwrite``; page-aligned, a whole number of pages."""
        return memoryview(self.view(slot).numpy())

    @property
    def free_extents(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def live_slots(self) -> int:
        with self._lock:
            return sum(s is not None for s in self._slots)
