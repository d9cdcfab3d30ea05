"""Host-to-device copies for a restore: on a GPU they run on one side stream (the copy engines), and per-layer
done events are the contract with the compute stream, which waits on a layer's event and nothing else.

The stream and the events are made once per copier and reused by every restore. With at most ``depth``
layers in flight and ``depth + 1`` events, an event is re-recorded only after the compute stream has been
told to wait on it, if it is ever waited on (CUDA captures an event's state when the wait is enqueued). On
a CPU the copies run inline and there are no events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

from ..ops import device_copy
from .scratch import Scratch

DEFAULT_DEPTH = 4


class Copier:
    def __init__(self, device: torch.device | str, depth: int = DEFAULT_DEPTH):
        self.device = torch.device(device)
        self.depth = max(1, depth)
        self.cuda = device_copy.uses_streams(self.device)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._events = [torch.cuda.Event() for _ in range(self.depth + 1)] if self.cuda else []
        self._next = 0

    def follow(self) -> None:
        """Order later copies after the work queued on the compute stream so far, and nothing queued later:
        call it right after a restore's blocks are allocated (kernels queued earlier may still use them),
        before its RE layers, so the copies overlap those."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    @contextmanager
    def side_stream(self):
        """Copies issued inside run on the side stream (inline on a CPU)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def gather(self, parts: list[torch.Tensor], scratch: Scratch | None = None) -> torch.Tensor:
        """The parts' rows, in order, as one tensor on the device: one batched call, one copy per part (a
        DMA from pinned memory on a GPU). Call inside :meth:`side_stream`. ``scratch``: a CPU's buffers to
        put them in (a new tensor, without)."""
        return device_copy.gather(parts, self.device, None if scratch is None else scratch.empty)

    def done(self) -> torch.cuda.Event | None:
        """An event marking every copy issued so far (None on a CPU)."""
        if self.stream is None:
            return None
        event = self._events[self._next]
        self._next = (self._next + 1) % len(self._events)
        event.record(self.stream)
        return event

    def wait(self, event: torch.cuda.Event | None, *tensors: torch.Tensor) -> None:
        """Make the compute stream wait for ``event``; ``tensors`` made on the side stream are then used by
        the compute stream, so the caching allocator must not hand their memory back to the side stream early."""
        if event is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        for t in tensors:
            t.record_stream(compute)

    def pipeline(self, jobs: Sequence, stage: Callable, finish: Callable) -> torch.cuda.Event | None:
        """A restore's layers, bubble-free: ``stage(job)`` (its copies) runs on the side stream up to
        ``depth`` jobs ahead of ``finish(job, staged, done)``, which runs in order on the caller's stream and
        waits on ``done`` (:meth:`wait`) before it reads what ``stage`` returned. Returns the last job's
        event (None on a CPU, or with no jobs)."""
        ahead: deque = deque()
        last = None
        for i, job in enumerate(jobs):
            while len(ahead) < self.depth and i + len(ahead) < len(jobs):
                with self.side_stream():
                    staged = stage(jobs[i + len(ahead)])
                ahead.append((staged, self.done()))
            staged, last = ahead.popleft()
            finish(job, staged, last)
        return last

    def drain(self) -> None:
        """Block the host until every copy issued has finished: the sources may then be reused."""
        if self.stream is not None:
            self.stream.synchronize()
