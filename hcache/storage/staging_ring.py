"""The saver's stage-1 staging ring: one fixed host buffer (pinned when the rows come from a GPU).

Stage 1 takes a region at the head for each layer's snapshot; stage-2 threads free regions in any order,
and the space is reused from the tail once every older region is free. When the ring is full, ``alloc``
waits (back-pressure on the forward pass) and counts the stall: nothing is dropped.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

_ALIGN = 64  # keeps every view aligned for any dtype, and regions on cache lines


class Region:
    __slots__ = ("start", "size", "free")

    def __init__(self, start: int, size: int):
        self.start, self.size, self.free = start, size, False


class StagingRing:
    def __init__(self, capacity_bytes: int, pin_memory: bool = False):
        if capacity_bytes < _ALIGN:
            raise ValueError(f"staging ring of {capacity_bytes} bytes is too small")
        self.capacity = capacity_bytes
        self.stalls = 0
        self.stall_s = 0.0
        self.oversize = 0  # snapshots larger than the whole ring, given their own buffer
        self._pin = pin_memory
        self._buf: torch.Tensor | None = None  # allocated on first use: a store that never saves costs nothing
        self._cond = threading.Condition()
        self._live: deque[Region] = deque()
        self._head = 0

    def snapshot(self, t: torch.Tensor, before_wait: Callable[[], None] = lambda: None) -> tuple[Region | None, torch.Tensor]:
        """A host tensor shaped like ``t`` to copy it into, and its region (None for a one-off buffer).
        ``before_wait`` runs (without the ring's lock) when the ring is full, before waiting: the caller
        hands what it has staged to whoever frees regions."""
        nbytes = t.numel() * t.element_size()
        size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN or _ALIGN
        if size > self.capacity:
            self.oversize += 1
            return None, torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        with self._cond:
            if self._buf is None:
                self._buf = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self._pin)
            full = self._place(size) is None
        if full:
            before_wait()
        with self._cond:
            if (start := self._place(size)) is None:
                self.stalls += 1
                began = time.perf_counter()
                while (start := self._place(size)) is None:
                    self._cond.wait()
                self.stall_s += time.perf_counter() - began
            region = Region(start, size)
            self._live.append(region)
            self._head = start + size
        return region, self._buf[start : start + nbytes].view(t.dtype).view(t.shape)

    def release(self, region: Region | None) -> None:
        if region is None:
            return
        with self._cond:
            region.free = True
            while self._live and self._live[0].free:
                self._live.popleft()
            if not self._live:
                self._head = 0
            self._cond.notify_all()

    def _place(self, size: int) -> int | None:
        """Where a region of ``size`` fits, or None. Strict comparisons keep a full ring distinct from an
        empty one: the head never catches up with the tail."""
        if not self._live:
            return 0
        tail = self._live[0].start
        if self._head > tail:  # used: [tail, head); free: [head, capacity) and [0, tail)
            if self._head + size <= self.capacity:
                return self._head
            return 0 if size < tail else None
        return self._head if self._head + size < tail else None  # wrapped: free is [head, tail)
