"""The two-stage saver (§4.2.2 of the paper): a forward pass's per-layer rows become chunks in the host tier
without stalling the forward pass.

Stage 1, on the forward's thread. When a batch begins, every chunk its rows reach gets a host-pool slot
(:meth:`~hcache.storage.host_tier.HostTier.create`: it waits, counted, only while the pool is full of
chunks still being written back). Each layer's rows then go straight into those slots, one copy per chunk
segment. On a GPU the rows are first copied device to device on the compute stream (microseconds; the
engine may reuse its buffer in the next layer), and the copies into the pinned slots run on a save stream,
so the forward never waits for PCIe.

Stage 2, bookkeeping. Once a batch's copies have landed (at once on a CPU; after the save stream's event on
a GPU, on a stage-2 thread), every chunk whose 64 rows are all there is published: restorable from memory
at once, written back to disk in the background. Only full chunks are stored; a finished sequence's
trailing partial chunk is dropped, and a chunk whose first rows were restored rather than computed never
fills (it is stored already). A stored chunk is immutable.

A chunk's key comes from the sequence's key chain, which the serving engine owns: the saver reads it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..ragged import Segment
from .chunk import ChunkImage, ChunkLayout
from .chunk_key import CHUNK_TOKENS, KeyChain
from .host_tier import HostTier

log = logging.getLogger(__name__)

TensorSpec = tuple[int, str, tuple[int, ...], torch.dtype]  # layer, format, row shape, dtype


@dataclass
class _Chunk:
    image: ChunkImage | None  # None: the pool had no room; this chunk is not saved
    filled: int = 0  # rows that have landed


@dataclass
class _Sequence:
    chain: KeyChain
    chunks: dict[int, _Chunk] = field(default_factory=dict)  # by the chunk's index in the sequence
    in_flight: list[Future] = field(default_factory=list)  # stage-2 work of batches not yet landed (GPU)
    broken: bool = False  # a forward pass failed mid-batch: its rows are incomplete, publish nothing more


@dataclass
class _Placement:
    seq: _Sequence
    row: int  # first row of the segment in the batch
    pos: int  # its first token's position in the sequence
    length: int

    def pieces(self):
        """``(chunk index, offset in the chunk, batch row, rows)`` of each chunk the segment reaches."""
        pos, row, left = self.pos, self.row, self.length
        while left:
            index, offset = divmod(pos, CHUNK_TOKENS)
            n = min(left, CHUNK_TOKENS - offset)
            yield index, offset, row, n
            pos, row, left = pos + n, row + n, left - n


class ChunkSaver:
    """``tensors``: every ``(layer, format, row shape, dtype)`` the engine hands over. ``stores(chunk_index,
    format)``: whether this saver stores that format of a sequence's chunk (a tensor-parallel rank stores
    the hidden states of only some chunks); a chunk is published with what it stores, even nothing, so that
    its key and tokens are on record."""

    def __init__(
        self, tier: HostTier, fingerprint: str, tensors: list[TensorSpec], *, stores: Callable[[int, str], bool] = lambda chunk, fmt: True
    ):  # fmt: skip
        self.tier, self.fingerprint, self.stores = tier, fingerprint, stores
        self.chunks_published = 0
        self._tensors = tensors
        self._layouts: dict[frozenset[str], ChunkLayout] = {}
        self._seqs: dict[int, _Sequence] = {}
        self._batch: list[_Placement] | None = None
        self._staged: list[tuple[int, str, torch.Tensor]] = []  # GPU: (layer, format, device snapshot)
        self._lock = threading.Lock()
        self._stage2: ThreadPoolExecutor | None = None  # made on the first GPU batch
        self._save_stream = None

    @property
    def stalls(self) -> int:
        """Times stage 1 waited for room in the pool (back-pressure on the forward pass)."""
        return self.tier.stalls

    @property
    def stall_seconds(self) -> float:
        return self.tier.stall_s

    @property
    def save_errors(self) -> int:
        """Chunks not written to disk, and chunks not saved for want of room in the pool."""
        return self.tier.write_errors + self.tier.unsaved

    def open(self, uid: int, chain: KeyChain) -> None:
        """Start saving sequence ``uid``, whose chunk keys ``chain`` gives."""
        self._seqs[uid] = _Sequence(chain)

    def close(self, uid: int) -> None:
        """Wait until every full chunk of ``uid`` is published, then forget ``uid``; its partial chunks are
        given back."""
        self._abort_unfinished_batch()
        seq = self._seqs.pop(uid, None)
        if seq is None:
            return
        for f in seq.in_flight:
            f.result()
        with self._lock:
            for c in seq.chunks.values():
                if c.image is not None:
                    self.tier.abandon(c.image)
            seq.chunks.clear()

    def shutdown(self) -> None:
        """Drain, drop every open sequence and stop the stage-2 thread."""
        for uid in list(self._seqs):
            self.close(uid)
        if self._stage2 is not None:
            self._stage2.shutdown(wait=True)

    # ---- stage 1: called by the engine's forward ------------------------------------------------------
    def begin_batch(self, segments: list[Segment]) -> None:
        self._abort_unfinished_batch()
        placements = [_Placement(self._seqs[s.uid], s.row, s.start, s.length) for s in segments if s.uid in self._seqs]
        for p in placements:
            for index, offset, _, _ in p.pieces():
                if index not in p.seq.chunks:  # one that starts mid-chunk was restored, not computed: it never fills
                    image = self.tier.create(self._layout(index), self.fingerprint) if offset == 0 else None
                    p.seq.chunks[index] = _Chunk(image)
        self._batch = placements or None

    def on_layer(self, layer: int, rows: dict[str, torch.Tensor]) -> None:
        if self._batch is None:
            return
        for fmt, t in rows.items():
            if t.is_cuda:
                self._staged.append((layer, fmt, t.clone()))  # on the compute stream: the engine may reuse t
            else:
                self._copy(self._batch, layer, fmt, t)

    def end_batch(self) -> None:
        batch, self._batch = self._batch, None
        staged, self._staged = self._staged, []
        if batch is None:
            return
        if not staged:
            self._land(batch)
            return
        if self._stage2 is None:
            self._stage2 = ThreadPoolExecutor(1, thread_name_prefix="hcache-saver")
            self._save_stream = torch.cuda.Stream(staged[0][2].device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(staged[0][2].device))
        future = self._stage2.submit(self._copy_on_save_stream, batch, staged, ready)
        for p in batch:
            p.seq.in_flight = [f for f in p.seq.in_flight if not f.done()] + [future]

    def _abort_unfinished_batch(self) -> None:
        """A batch that began but never ended (its forward raised) publishes nothing; nor do its sequences."""
        if self._batch is not None:
            for p in self._batch:
                p.seq.broken = True
            self._batch, self._staged = None, []

    # ---- the copies and stage 2 -----------------------------------------------------------------------
    def _copy(self, batch: list[_Placement], layer: int, fmt: str, src: torch.Tensor) -> None:
        for p in batch:
            for index, offset, row, n in p.pieces():
                image = p.seq.chunks[index].image
                if image is not None and image.has(layer, fmt):
                    image.tensor(layer, fmt)[offset : offset + n].copy_(src[row : row + n], non_blocking=True)

    def _copy_on_save_stream(self, batch: list[_Placement], staged: list[tuple[int, str, torch.Tensor]], ready) -> None:
        try:
            with torch.cuda.stream(self._save_stream):
                self._save_stream.wait_event(ready)
                for layer, fmt, snapshot in staged:
                    self._copy(batch, layer, fmt, snapshot)
                landed = torch.cuda.Event()
                landed.record(self._save_stream)
            landed.synchronize()
            self._land(batch)
        except Exception:
            log.exception("saver: copying a batch's rows failed; its chunks are not saved")
            for p in batch:
                p.seq.broken = True

    def _land(self, batch: list[_Placement]) -> None:
        """The batch's rows are in their slots: count them, and publish every chunk now complete."""
        with self._lock:
            for p in batch:
                if p.seq.broken:
                    continue
                for index, _, _, n in p.pieces():
                    chunk = p.seq.chunks[index]
                    chunk.filled += n
                    named = p.seq.chain.chunk(index)
                    if chunk.filled == CHUNK_TOKENS and named is not None:
                        del p.seq.chunks[index]
                        if chunk.image is not None:
                            self.tier.publish(chunk.image, *named)
                            self.chunks_published += 1

    def _layout(self, index: int) -> ChunkLayout:
        stored = [t for t in self._tensors if self.stores(index, t[1])]
        names = frozenset((layer, fmt) for layer, fmt, *_ in stored)
        if names not in self._layouts:
            self._layouts[names] = ChunkLayout.plan(stored, self.fingerprint)
        return self._layouts[names]
