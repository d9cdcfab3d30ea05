"""The two-stage saver (§4.2.2 of the paper): turns a forward pass's per-layer rows into stored chunks
without stalling the forward pass.

Stage 1, on the forward's thread (:meth:`ChunkSaver.on_layer`): one copy per layer per batch of the whole
batch's rows into a host staging ring. On a GPU the copy runs on a dedicated stream, and the compute
stream waits on its event before the next layer's first kernel, so the engine's buffer is not reused
before it is read. When the ring is full, stage 1 waits and counts a stall; it never drops rows.

Stage 2, a pool of host threads (8 by default): scatter each sequence's rows into that sequence's 64-token
chunk buffers, free the ring region, and encode and store every chunk that is full. Only full chunks are
stored; the trailing partial chunk of a finished sequence is dropped and gets prefilled again by the next
request (exact, at most 63 tokens of recompute), so a stored chunk is immutable once written.

A store error (ENOSPC, EIO, a full quota) degrades saving: the chunk is skipped with a warning and a
count, and serving goes on; the next request recomputes what is missing. :meth:`close` waits until a
sequence's chunks are published, so the next request sees them.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import StorageError
from ..ragged import Segment
from .chunk import Chunk, encode
from .chunk_key import CHUNK_TOKENS, KeyChain
from .chunk_store import ChunkStore
from .staging_ring import Region, StagingRing

log = logging.getLogger(__name__)

DEFAULT_THREADS = 8
DEFAULT_STAGING_BYTES = 64 << 20


@dataclass
class _ChunkBuffer:
    rows: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # [64, row bytes] per (layer, format)
    kinds: dict[tuple[int, str], tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)  # row shape, dtype
    filled: dict[tuple[int, str], int] = field(default_factory=dict)
    done: bool = False


@dataclass
class _Sequence:
    chain: KeyChain  # from the last keyed chunk (or the stored prefix's last chunk, or the chain root)
    first_chunk: int = 0  # the sequence's index of the chain's next chunk when saving (re)started
    batches: list["_Batch"] = field(default_factory=list)
    keyed: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # chunk index -> key, tokens
    n_keyed: int = 0
    rows_seen: int = 0  # tokens whose rows stage 1 has taken
    chunks: dict[int, _ChunkBuffer] = field(default_factory=dict)
    broken: bool = False  # a forward pass failed mid-batch: its rows are incomplete, publish nothing more
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Placement:
    seq: _Sequence
    row: int  # first row of the segment in the batch
    pos: int  # its first token's position in the sequence
    length: int


class _Batch:
    """One forward pass's snapshots: sealed when every layer is scattered and the batch has ended."""

    def __init__(self, placements: list[_Placement]):
        self.placements = placements
        self.layout: set[tuple[int, str]] = set()
        self.pending = 1  # the end of the batch, plus one per stage-2 task
        self.staged: list = []  # snapshots not yet handed to stage 2: (layer, {format: (region, rows)}, event)
        self.sealed = threading.Event()
        self.lock = threading.Lock()


class ChunkSaver:
    """``threads``: stage-2 pool size. ``staging_bytes``: the ring's size; a larger ring absorbs longer
    bursts before back-pressure. ``stores(chunk_index, format)``: whether this saver stores that format's
    rows of a sequence's chunk (a tensor-parallel rank stores the hidden states of only some chunks); a
    chunk is published with what it stores, even nothing, so that its key and tokens are on record."""

    def __init__(
        self,
        store: ChunkStore,
        fingerprint: str,
        *,
        threads: int = DEFAULT_THREADS,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        stores: Callable[[int, str], bool] = lambda chunk, fmt: True,
    ):
        if threads < 1:
            raise ValueError(f"the saver needs at least one thread, not {threads}")
        self.store = store
        self.fingerprint = fingerprint
        self.stores = stores
        self.chunks_written = 0
        self.chunks_deduplicated = 0
        self.save_errors = 0
        self._staging_bytes = staging_bytes
        self._ring: StagingRing | None = None  # made on first use, pinned if the rows come from a GPU
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hcache-saver")
        self._counts = threading.Lock()
        self._seqs: dict[int, _Sequence] = {}
        self._batch: _Batch | None = None
        self._copy_stream = None

    @property
    def stalls(self) -> int:
        """Times stage 1 waited for the ring (back-pressure on the forward pass)."""
        return self._ring.stalls if self._ring else 0

    @property
    def stall_seconds(self) -> float:
        return self._ring.stall_s if self._ring else 0.0

    def open(self, uid: int, parent_key: str, first_chunk: int = 0) -> None:
        """Start saving sequence ``uid`` whose first ``first_chunk`` chunks, up to the chunk ``parent_key``,
        are already stored. Opening it again (after a restore skipped past stored chunks) restarts the chain
        there; batches still in flight keep publishing, and :meth:`close` still waits for them."""
        old = self._seqs.get(uid)
        self._seqs[uid] = _Sequence(KeyChain(parent_key), first_chunk, batches=old.batches if old is not None else [])

    def add_tokens(self, uid: int, tokens: list[int]) -> None:
        """Tokens about to be processed for ``uid``; their rows arrive with the next batch."""
        seq = self._seqs[uid]
        for key, chunk_tokens in seq.chain.extend(tokens):
            with seq.lock:
                seq.keyed[seq.n_keyed] = (key, chunk_tokens)
            seq.n_keyed += 1

    def skip(self, uid: int, tokens: list[int]) -> None:
        """Tokens of ``uid`` that are already stored and whose rows will never come (a restore ended inside
        their chunk): they extend the chain, so later chunks get their keys, and the chunk they fall in,
        lacking rows, is never published again."""
        self.add_tokens(uid, tokens)
        self._seqs[uid].rows_seen += len(tokens)

    def close(self, uid: int) -> None:
        """Wait until every full chunk of ``uid`` is published, then forget ``uid``; rows of its trailing
        partial chunk are dropped."""
        self._abort_unfinished_batch()
        seq = self._seqs.pop(uid, None)
        if seq is not None:
            for batch in seq.batches:
                batch.sealed.wait()

    def shutdown(self) -> None:
        """Drain, drop every open sequence and stop the threads."""
        for uid in list(self._seqs):
            self.close(uid)
        self._pool.shutdown(wait=True)

    # ---- the capture side: called by the engine's forward ------------------------------------------
    def begin_batch(self, segments: list[Segment]) -> None:
        self._abort_unfinished_batch()
        placements = []
        for s in segments:
            seq = self._seqs.get(s.uid)
            if seq is not None:
                placements.append(_Placement(seq, s.row, seq.rows_seen, s.length))
                seq.rows_seen += s.length
        self._batch = _Batch(placements) if placements else None
        if self._batch is not None:
            for p in placements:
                p.seq.batches = [b for b in p.seq.batches if not b.sealed.is_set()] + [self._batch]

    def on_layer(self, layer: int, rows: dict[str, torch.Tensor]) -> None:
        """Stage 1: snapshot this layer's rows of the whole batch. Stage 2 gets a batch's snapshots in one
        hand-over at its end (one thread wake-up per step, not per layer: on a small CPU, waking threads
        every layer disturbs the forward's own threads), or earlier if the ring fills."""
        batch = self._batch
        if batch is None or not rows:
            return
        snapshots, event = {}, None
        ring = self._staging(next(iter(rows.values())))
        for fmt, t in rows.items():
            region, host = ring.snapshot(t, before_wait=lambda: self._hand_over(batch))
            if t.is_cuda:
                event = self._copy_async(host, t)
            else:
                host.copy_(t)
            snapshots[fmt] = (region, host)
            batch.layout.add((layer, fmt))
        batch.staged.append((layer, snapshots, event))

    def end_batch(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            self._hand_over(batch, ends_batch=True)

    def _abort_unfinished_batch(self) -> None:
        """A batch that began but never ended (its forward raised) publishes nothing; nor do its sequences."""
        if self._batch is not None:
            for p in self._batch.placements:
                p.seq.broken = True
            self.end_batch()

    def _hand_over(self, batch: _Batch, ends_batch: bool = False) -> None:
        staged, batch.staged = batch.staged, []
        if staged:
            with batch.lock:
                batch.pending += 1
        if staged or ends_batch:
            self._pool.submit(self._scatter, batch, staged, ends_batch)

    # ---- stage 1 helpers ------------------------------------------------------------------------------
    def _staging(self, t: torch.Tensor) -> StagingRing:
        if self._ring is None:
            self._ring = StagingRing(self._staging_bytes, pin_memory=t.is_cuda)
        return self._ring

    def _copy_async(self, host: torch.Tensor, t: torch.Tensor):
        compute = torch.cuda.current_stream(t.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(t.device)
        self._copy_stream.wait_stream(compute)  # the rows are ready
        with torch.cuda.stream(self._copy_stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        t.record_stream(self._copy_stream)
        compute.wait_event(event)  # the next layer's first kernel waits before the engine reuses t
        return event

    # ---- stage 2: the pool's threads -------------------------------------------------------------------
    def _scatter(self, batch: _Batch, staged: list[tuple[int, dict[str, tuple[Region | None, torch.Tensor]], object]], ends_batch: bool) -> None:
        try:
            for layer, snapshots, event in staged:
                if event is not None:
                    event.synchronize()
                for fmt, (_, host) in snapshots.items():
                    self._scatter_rows(batch, (layer, fmt), host)
        except Exception:
            log.exception("saver: scattering a batch failed; the affected chunks are not saved")
            self._count_error()
        finally:
            for _, snapshots, _ in staged:
                for region, _ in snapshots.values():
                    self._ring.release(region)
            if staged:
                self._finish_part(batch)
            if ends_batch:
                self._finish_part(batch)

    def _scatter_rows(self, batch: _Batch, name: tuple[int, str], host: torch.Tensor) -> None:
        src = host.view(host.shape[0], -1).view(torch.uint8).numpy()  # rows as bytes: any dtype, no copy
        for p in batch.placements:
            pos, row, left = p.pos, p.row, p.length
            while left:
                index, offset = divmod(pos, CHUNK_TOKENS)
                n = min(left, CHUNK_TOKENS - offset)
                with p.seq.lock:
                    buf = p.seq.chunks.setdefault(index, _ChunkBuffer())  # kept even if empty: it is published
                    dst = buf.rows.get(name)
                    if dst is None and self.stores(p.seq.first_chunk + index, name[1]):
                        dst = buf.rows[name] = np.empty((CHUNK_TOKENS, src.shape[1]), dtype=np.uint8)
                        buf.kinds[name] = (tuple(host.shape[1:]), host.dtype)
                if dst is not None:
                    dst[offset : offset + n] = src[row : row + n]
                    with p.seq.lock:
                        buf.filled[name] = buf.filled.get(name, 0) + n
                pos, row, left = pos + n, row + n, left - n

    def _finish_part(self, batch: _Batch) -> None:
        with batch.lock:
            batch.pending -= 1
            last = batch.pending == 0
        if last:
            try:
                self._seal(batch)
            except Exception:
                log.exception("saver: publishing a batch's chunks failed")
                self._count_error()
            finally:
                batch.sealed.set()

    def _seal(self, batch: _Batch) -> None:
        """Publish every chunk this batch touched that is now full. Batches finish out of order, so the
        one that fills a chunk's last rows is not always the last to finish; whichever is, publishes it."""
        for p in batch.placements:
            ready = []
            if p.seq.broken:
                continue
            with p.seq.lock:
                for index in range(p.pos // CHUNK_TOKENS, -(-(p.pos + p.length) // CHUNK_TOKENS)):
                    buf = p.seq.chunks.get(index)
                    if buf is None or buf.done or index not in p.seq.keyed:
                        continue
                    layout = {name for name in batch.layout if self.stores(p.seq.first_chunk + index, name[1])}
                    if set(buf.filled) == layout and all(n == CHUNK_TOKENS for n in buf.filled.values()):
                        buf.done = True
                        del p.seq.chunks[index]
                        ready.append((p.seq.keyed.pop(index), buf))
            for (key, tokens), buf in ready:
                self._publish(key, tokens, buf)

    def _publish(self, key: str, tokens: list[int], buf: _ChunkBuffer) -> None:
        if self.store.contains(key):
            with self._counts:
                self.chunks_deduplicated += 1
            return
        tensors = {
            name: torch.from_numpy(rows).view(buf.kinds[name][1]).view(CHUNK_TOKENS, *buf.kinds[name][0])
            for name, rows in buf.rows.items()
        }
        try:
            self.store.put(key, encode(Chunk(key, tokens, self.fingerprint, tensors)))
        except (OSError, StorageError) as exc:  # ENOSPC, EIO, a full quota: saving degrades, serving goes on
            errors = self._count_error()
            if errors == 1 or errors % 100 == 0:
                log.warning("saver: could not save chunk %s (%s); %d chunk(s) not saved so far", key, exc, errors)
            return
        with self._counts:
            self.chunks_written += 1

    def _count_error(self) -> int:
        with self._counts:
            self.save_errors += 1
            return self.save_errors
