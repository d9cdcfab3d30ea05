"""Reusable host buffers for the rows a pipeline stages on a CPU. A fresh tensor a layer slowed the engine's
own threads too, not only the one that made it (a spot check: far more from a thread of the engine's
process than from a process apart), likely because glibc hands a freed block of megabytes back to the
kernel, the next layer's faults it in again, and each unmapping interrupts the process's other cores. So
rows staged on a CPU go into buffers kept from one load to the next."""

from __future__ import annotations

import math

import torch

ALIGN = 64  # bytes: any dtype's view may start there
MAX_VIEWS = 64  # kept for each buffer


class Scratch:
    """``slots`` buffers taken in turn, one a job (:meth:`next_job`), each job's tensors packed into its
    slot's buffer, which grows to the largest job's and is kept. A pipeline holds at most
    :attr:`~hcache.transfer.copier.Copier.depth` jobs staged, so with that many slots a job's tensors are
    reused only after its ``finish``. One thread's: tensors taken are overwritten ``slots`` jobs later."""

    def __init__(self, slots: int):
        self._buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(max(1, slots))]
        self._views: list[dict[tuple, torch.Tensor]] = [{} for _ in self._buffers]  # each buffer's views, made once
        self._slot, self._used = -1, 0

    def rewind(self) -> None:
        """The next job takes the first slot again: every job before has finished (a pipeline's end)."""
        self._slot = -1

    def next_job(self) -> None:
        self._slot, self._used = (self._slot + 1) % len(self._buffers), 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the current job's slot: a view made once for each place, shape and dtype
        (a view is an op, and every op a helper thread calls hands the GIL to the engine's thread)."""
        begin = -(-self._used // ALIGN) * ALIGN
        end = begin + math.prod(shape) * dtype.itemsize
        views = self._views[self._slot]
        if end > len(self._buffers[self._slot]):  # grown: the job's tensors taken before keep the old buffer alive
            self._buffers[self._slot] = torch.empty(end, dtype=torch.uint8)
            views.clear()
        self._used = end
        view = views.get((begin, shape, dtype))
        if view is None:
            if len(views) >= MAX_VIEWS:  # loads of ever new lengths
                views.clear()
            view = views[(begin, shape, dtype)] = self._buffers[self._slot][begin:end].view(dtype).view(shape)
        return view
