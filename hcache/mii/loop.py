"""MII's batching loop where MII did not expect to run it: on a CPU, idle beside other nodes, and stopping
with state to store. Replacements for MII's and DeepSpeed's attributes, installed by
:mod:`hcache.mii.patches`."""

from __future__ import annotations

import os
import queue

IDLE_WAIT_S = 0.1  # an idle model server waits this long on its request queue at a time (see waiting_when_idle)


# Two things stop MII 0.3's loop on a CPU, neither about the model: it calls ``torch.cuda.synchronize()``
# unconditionally when a pipeline starts, which a CPU-only torch refuses (without CUDA it becomes the no-op it
# would be); and it finds rank 0 by ``current_device() == 0``, while DeepSpeed's CPU accelerator returns
# ``LOCAL_RANK`` as a string, so a launched server thinks it is not rank 0 and answers nothing.
def no_synchronize(_synchronize):
    return lambda device=None: None


def local_rank_as_int(_current_device):
    return lambda: int(os.environ.get("LOCAL_RANK", 0))


def waiting_when_idle(schedule):
    """``MIIAsyncPipeline.schedule_requests``. MII's serving loop polls its request queue without blocking,
    so an idle model server keeps a CPU core busy (several nodes on one machine starve each other). With
    nothing to run, rank 0 now blocks on the queue instead: a request wakes it at once, and a stop is still
    seen within ``IDLE_WAIT_S``. Everything running goes back through that queue after each step, so an
    empty buffer and queue mean idle."""

    def schedule_requests(self) -> None:
        if self.is_rank_0 and not self.buffer:
            try:
                self.buffer.append(self.request_queue.get(timeout=IDLE_WAIT_S))
            except queue.Empty:
                pass
        schedule(self)

    return schedule_requests


def storing_everything(shutdown):
    """``MIIAsyncPipeline.shutdown``. A model server told to stop (MII's terminate) closes its serving engine
    once its batching loop has ended: the saver drains and every chunk saved is written to the stores below,
    Redis included, before the process exits. Otherwise chunks still queued for write-back are left to the
    interpreter's exit."""

    def shutdown_and_store(self) -> None:
        shutdown(self)
        self.inference_engine.close()

    return shutdown_and_store
