"""Loads into a paged KV cache: a request's whole stored prefix read, verified and written into its blocks on
a thread of its own, while the engine holds the request back (vLLM's ``load_kv_async``) and keeps stepping
the others, or, for a small one, while the step that computes the request waits (:meth:`Loader.wait`). It needs torch and hcache's store stack, not vLLM: vLLM's
worker (:mod:`hcache.vllm.worker`) drives it, and ``hcache bench paged`` times it on its own.

A load fetches its chunks into the host pool (on the store's reader threads), verifies them as every
restore does (:class:`~hcache.restore.stored_prefix.StoredPrefix`), and writes each layer's K/V into the paged
cache by the request's plan: the stored K/V rows (KV) or K/V rebuilt from the stored hidden states with
the layer's own weights (H: the engine's ``rebuild``; vLLM's is :mod:`hcache.vllm.hidden`). Rows cross to
the cache's device as stored (8-bit codes with their scales), one gather per layer, and are decoded there.
On a GPU the loader's copies run on the copier's side stream, a few layers ahead of the H rebuilds, which
run on a stream of the loader's own after each copy's event (as every restore is pipelined:
:meth:`~hcache.transfer.copier.Copier.pipeline`); the load is reported done only once both streams have
finished, so the request's first forward reads complete blocks; the step's stream is never synchronised. The blocks of what fell short (a chunk gone, unreadable or bad) are load
errors, which the engine recomputes: nothing unverified is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import replace

import torch

from ..machine import helper_threads
from ..ops.paged_kv import block_slots
from ..planning.plan import Method, RestorePlan
from ..restore.layers import StoredRows, restore_layers
from ..restore.reads import LayerJob, layer_jobs, reads
from ..restore.records import MissReason, PutRestore, SequenceRecord
from ..restore.stored_prefix import StoredPrefix
from ..serving.store_stack import StoreStack
from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from ..storage.image_rows import ImageRows
from ..transfer.scratch import Scratch
from .copy_process import CopyProcess, ProcessGone
from .load_job import LoadJob
from .target import PagedLayer, PagedTarget, StateLayer

log = logging.getLogger(__name__)


# vLLM's null block: a sliding-window group holds it for the positions before the window, and nothing is
# written there.
NULL_BLOCK = 0


class Loader:
    """``layers``: the paged cache's layers, whose tensors hold blocks of ``kernel_block`` tokens (the
    engine's blocks, of ``block_sizes[group]`` in each KV cache group, may be split into several; a
    sliding-window layer reads its window by the stack's rule); ``rebuild(layer, hidden, positions)``:
    K/V rows from hidden states (None where no layer restores by H); ``lost(key, reason)``: told of a chunk
    a load found gone (evicted or deleted since it was offered, or its tier down), so it is not offered again;
    ``plan``: a fixed plan for every load (by default, the stack's for each load's length); ``movable``:
    whether the caches may be moved onto memory a load process maps (the engine's layers hold the very
    tensors in ``layers``, which are moved in place), else a CPU's loads run on the loader's thread;
    ``states``: the recurrent layers, whose state at a load's end is written by the loader's thread."""

    def __init__(
        self,
        stack: StoreStack,
        block_sizes: tuple[int, ...],
        kernel_block: int,
        layers: list[PagedLayer],
        rebuild: Callable | None = None,
        lost: Callable = lambda key, reason: None,
        plan: RestorePlan | None = None,
        movable: bool = True,
        states: tuple[StateLayer, ...] = (),
    ):
        self.states = {layer.index: layer for layer in states}
        self.stack, self.config, self.block_sizes, self.kernel_block = stack, stack.config, block_sizes, kernel_block
        self.layers, self.rebuild, self.lost, self.plan = layers, rebuild, lost, plan
        self._thread = helper_threads.executor(1, "hcache-paged-load")
        copier = stack.copier
        self._stream = (
            torch.cuda.Stream(copier.device) if copier is not None and copier.cuda else None
        )  # H's rebuilds, off the step's stream
        # a CPU's staged rows, in buffers kept from load to load (:mod:`~hcache.transfer.scratch`); a GPU's come from torch's caching allocator
        self._scratch = Scratch(copier.depth) if copier is not None and not copier.cuda else None
        self._inflight: dict[str, tuple[LoadJob, Future]] = {}
        self._process: CopyProcess | None = (
            None  # a CPU's KV writes, out of the engine's GIL, where the host pool is shareable
        )
        pool = stack.store.pool if stack.store is not None else None
        if movable and self._scratch is not None and pool is not None and pool.fd is not None:
            try:
                self._process = CopyProcess(layers, pool.fd, pool.capacity, kernel_block, copier.depth)
            except (RuntimeError, OSError) as e:
                log.warning("hcache: no load process (%s); loads run on a thread of the worker", e)

    def submit(self, job: LoadJob, record: SequenceRecord) -> None:
        self._inflight[job.req_id] = job, self._thread.submit(self._load, job, record)

    def loading(self, req_id: str) -> bool:
        return req_id in self._inflight

    def finished(self, wait: float = 0.0) -> dict[str, set[int]]:
        """The loads done since the last call, each with the blocks it could not load (empty: all loaded).
        ``wait``: seconds to wait for one to finish, if none has (0: do not wait)."""
        if wait > 0 and self._inflight:
            futures.wait(
                [future for _, future in self._inflight.values()], timeout=wait, return_when=futures.FIRST_COMPLETED
            )
        return {req_id: self._take(req_id) for req_id, (_, future) in list(self._inflight.items()) if future.done()}

    def wait(self, req_ids: list[str]) -> dict[str, set[int]]:
        """The loads of ``req_ids`` (a step's in-step loads), once they are done, as :meth:`finished` gives
        them; other loads go on."""
        futures.wait([self._inflight[req_id][1] for req_id in req_ids if req_id in self._inflight])
        return {req_id: self._take(req_id) for req_id in req_ids if req_id in self._inflight}

    def _take(self, req_id: str) -> set[int]:
        """A done load's blocks it could not load, no longer in flight."""
        job, future = self._inflight.pop(req_id)
        try:
            return future.result()
        except Exception:  # a bug, not a bad chunk: nothing it wrote is trusted
            log.exception("hcache: loading request %s failed; it is recomputed", req_id)
            return self._blocks(job, job.start)

    def _blocks(self, job: LoadJob, end: int) -> set[int]:
        """The blocks of ``job``'s positions from ``end`` on: not loaded (of its first group: vLLM takes a
        hybrid model's failed loads by request, not by block)."""
        size = self.block_sizes[0]
        return set(job.block_ids[0][end // size : -(-job.end // size)])

    def _load(self, job: LoadJob, record: SequenceRecord) -> set[int]:
        began = time.perf_counter()
        store, fingerprint = self.stack.store, self.stack.fingerprint
        first = job.start // CHUNK_TOKENS
        keys = chunk_keys(job.tokens[: job.end], root_key(fingerprint, job.namespace))[first:]
        plan = self.plan or self.config.policy.plan_for(self.config.plan, job.end - job.start)

        def reach(m: int) -> int:  # where a load of ``m`` chunks ends
            return max(job.start, min(job.end, (first + m) * CHUNK_TOKENS))

        spec = self.config.spec
        with StoredPrefix(store, keys, first) as prefix:
            prefix.fetch(len(keys))
            prefix.verify(
                job.tokens[first * CHUNK_TOKENS :],
                fingerprint,
                plan,
                spec,
                self.stack.window,
                reach,
                states=self.stack.states,
            )
            n = len(prefix.images)
            end = reach(n)
            if end < job.end and prefix.why_short() in (MissReason.EVICTED, MissReason.TIER_UNAVAILABLE):
                self.lost(keys[n], prefix.miss)
            jobs = layer_jobs(plan, self.stack.window, first, job.start, end, n)
            if end > job.start:
                self._write(job, prefix.images, first, end, plan, jobs)
            step = PutRestore()
            prefix.outcome(spec, reads(jobs), n, job.start, end, job.end - end).record(step, plan)
            step.restore_s = time.perf_counter() - began
            record.add(step)
            return self._blocks(job, end) if end < job.end else set()

    @torch.inference_mode()  # vLLM's caches are inference tensors; grad mode is per thread
    def _write(self, job: LoadJob, images: list, first: int, end: int, plan: RestorePlan, jobs: list[LayerJob]) -> None:
        """Each layer's K/V of positions ``[job.start, end)`` into the cache (a sliding-window layer's from
        the first chunk it reads on, and from the first position its group holds in a real block), by the
        restore core's pipeline (:func:`~hcache.restore.layers.restore_layers`): a layer's rows gathered
        from the pool in one call on the copier's side stream (on a GPU, one kernel reading the pinned
        slots in place, or, where it cannot, a DMA per chunk), KV decoded and scattered there too, while
        the layers before it that restore by H are decoded, rebuilt and scattered on the loader's own
        stream, each after its copy's event. This thread then waits for both streams (the step's stream
        never does): the pool's slots are released after this, and the load reported done. On a CPU with a
        load process, that process writes the KV layers meanwhile (:mod:`~hcache.paged.copy_process`), and
        this thread waits for it too."""
        copier = self.stack.copier
        slots = {}  # by group: the first position held in a real block, and the blocks and offsets from there to ``end``
        windowed = {
            layer.group for layer in self.layers if self.config.spec.window(layer.index) is not None
        }  # groups holding null blocks
        for g in {layer.group for layer in self.layers}:
            size = self.block_sizes[g]
            real = range(job.start // size, -(-end // size))
            held = next((b for b in real if job.block_ids[g][b] != NULL_BLOCK), None) if g in windowed else real.start
            held = end if held is None else max(job.start, held * size)
            slots[g] = held, *block_slots([(job.block_ids[g], held, end)], size, self.kernel_block)
        layers = {layer.index: layer for layer in self.layers}
        jobs = [j for j in jobs if j.state and j.layer in self.states] + [
            j
            for j in (
                replace(j, begin=max(j.begin, slots[layers[j.layer].group][0])) for j in jobs if j.layer in layers
            )
            if j.begin < end
        ]
        state_blocks = {  # the block that holds a recurrent group's state at ``end``
            s.group: job.block_ids[s.group][(end - 1) // self.block_sizes[s.group]] for s in self.states.values()
        }
        if NULL_BLOCK in state_blocks.values():  # vLLM holds no state there: nothing is written, it recomputes
            raise RuntimeError(f"vLLM holds no block for the recurrent state at token {end}")
        shared = ImageRows.of(images, copier.device)
        kv = [j for j in jobs if j.method is not Method.H and not j.state]
        process = (
            self._process if kv and self._scratch is not None and shared is not None and self._in_pool(shared) else None
        )
        dtype = self.layers[0].cache.dtype
        rows = StoredRows(images, first, end, copier, dtype, self._scratch, shared)
        sent = False  # the KV layers to the load process, the H layers here, at once
        try:
            if process is not None:
                try:
                    process.submit(PagedTarget.message(shared, slots, first, end, kv))
                    sent, jobs = True, [j for j in jobs if j.method is Method.H or j.state]
                except ProcessGone:  # gone since the last load: nothing of this one was sent, this thread writes it
                    self._lose_process()
            if self._scratch is not None:
                self._scratch.rewind()  # the last load's jobs are done: a load of few layers uses few slots
            # H's positions and every job's places in the caches, on this stream before the side stream follows it
            positions = torch.arange(job.start, end, device=copier.device) if Method.H in plan.layers else None
            target = PagedTarget(
                layers,
                slots,
                jobs,
                end,
                self.kernel_block,
                self.rebuild,
                positions,
                job.start,
                self.states,
                state_blocks,
            )
            copier.follow()  # both streams after the kernels queued so far: the blocks may have been another request's
            if self._stream is None:
                restore_layers(jobs, rows, target, copier)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(copier.device))
                with torch.cuda.stream(self._stream):
                    restore_layers(jobs, rows, target, copier)
                self._stream.synchronize()
            copier.drain()
        finally:
            if sent:
                self._wait_process()

    def _in_pool(self, shared: ImageRows) -> bool:
        """Whether ``shared``'s rows are in the host pool, which the load process maps (the offsets it is
        sent are into that)."""
        return shared.base.untyped_storage().data_ptr() == self.stack.store.pool.arena.untyped_storage().data_ptr()

    def _wait_process(self) -> None:
        """Wait for the load process's writes; if it is gone, load on this thread from now on (this load's
        blocks are load errors: what it wrote is not known)."""
        try:
            self._process.wait()
        except ProcessGone:
            self._lose_process()
            raise

    def _lose_process(self) -> None:
        log.warning(
            "hcache: the load process ended (exit code %s); loads run on a thread of the worker from now on",
            self._process.returncode(),
        )
        self._process.close()
        self._process = None

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        if self._process is not None:
            self._process.close()
