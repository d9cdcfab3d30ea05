"""The two-stage saver (§4.2.2 of the paper): a forward pass's per-layer rows become chunks in the host tier
without stalling the forward pass.

Stage 1, on the forward's thread. When a batch begins, every chunk its rows reach gets a host-pool slot
(:meth:`~hcache.storage.host_tier.HostTier.create`: it waits, counted, only while the pool is full of
chunks still being written back). Each layer's rows are held back in a buffer the saver keeps (one copy:
the engine may reuse its own in the next layer; rows made for the saver, K/V copied out of the engine's
cache, are kept as they are and stacked into it at once), up to :data:`RUN_BYTES` of them, and then each sequence's
rows of that run of layers go to its chunk in one strided copy, all sequences' in one batched call: at a
decode step, where each sequence computes a row, copying a layer at a time would cost a call per sequence
and layer. An engine that keeps rows of its own until a sequence ends (vLLM's paged cache holds every K/V
row of a running request) need not hand them over at all: a batch names those formats ``later``, and the
chunks it fills have their rows of them read out of the engine once, every layer's together, when the batch
ends; a decode step that fills no chunk then costs nothing per layer. On a CPU the rows go straight into
the chunks' slots. On a GPU they go into a device copy of the chunk's image instead (on the compute stream),
and a chunk crosses to its pinned slot once, whole, when its last row is in: one copy on a save stream that
the forward never waits for, where copying each batch's rows would make one small PCIe copy per sequence
and run at every decode step.

Stage 2, bookkeeping. Once a batch's copies have landed (at once on a CPU, or when no chunk crossed to the
host; after the save stream's event on a GPU, on a stage-2 thread), every chunk whose 64 rows are all there
is published: restorable from memory at once, written back to every store tier (disk, shared stores) in the
background. Only full chunks are stored; a finished sequence's
trailing partial chunk is dropped, and a chunk some of whose rows were restored rather than computed never
fills (it is stored already): its slot goes back as soon as that is known. A stored chunk is immutable.

A chunk's key comes from the sequence's key chain, which the serving engine owns: the saver reads it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..machine import helper_threads
from ..engine.ragged import Segment
from ..ops import device_copy
from ..storage.chunk import ChunkLayout
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain
from ..storage.host_tier import HostTier
from ..storage.stored_state import STATE, TensorSpec
from .chunk_rows import Chunk, Piece, SavedSequence, copy_rows, copy_state, split, unstage

log = logging.getLogger(__name__)

PartialChunk = Chunk  # a finished sequence's trailing chunk, kept to be resumed (see ``ChunkSaver.close``)

# Rows of one format a batch holds back before copying them to their chunks. A layer's rows larger than
# half of it (a long prefill's) are copied as they come: there a copy per layer costs little more.
RUN_BYTES = 8 << 20


@dataclass
class _Run:
    """One format's rows of the layers handed over since its last copy: ``rows[k]`` are ``layers[k]``'s, or,
    where the saver keeps the tensors it is handed, ``kept[k]`` is, stacked into ``rows`` when the run is
    copied."""

    layers: list[int]
    rows: torch.Tensor  # [room, T, *row], a view of the saver's buffer for the format
    kept: list[torch.Tensor] | None  # None: each layer's rows copied into ``rows`` as they come


@dataclass
class _Batch:
    pieces: list[Piece]
    dead: list[Chunk]  # chunks that can no longer fill: given back once this batch's copies have landed
    later: frozenset[str]  # formats not handed over: read for the chunks the batch fills when it ends
    delivered: set[tuple[int, str]] = field(default_factory=set)  # (layer, format) the forward handed over
    vouchers: list[torch.Tensor] = field(default_factory=list)  # given by ``vouch``
    runs: dict[str, _Run] = field(default_factory=dict)  # by format: rows held back, not yet in their chunks


class ChunkSaver:
    """``tensors``: every ``(layer, format, row shape, dtype)`` the engine hands over. ``stores(chunk_index,
    layer, format, end)``: whether this saver stores that tensor of a sequence's chunk, which it asks when the
    chunk's first rows arrive, in a forward that computes the sequence up to position ``end`` (a
    tensor-parallel rank stores the hidden states of only some chunks; a sliding-window layer only the chunks
    near the end, :mod:`hcache.planning.window`); a chunk is published with what it stores, even nothing, so
    that its key and tokens are on record. ``stage``: stage chunks on the rows' device and copy each to the host
    once, when full (None: when the rows are on a GPU). ``value(chunk_index)``: what keeping a sequence's
    chunk in the host pool saves, given to the tier with it (:meth:`HostTier.publish`; opaque here)."""

    def __init__(
        self,
        tier: HostTier,
        fingerprint: str,
        tensors: list[TensorSpec],
        *,
        stores: Callable[[int, int, str, int], bool] = lambda chunk, layer, fmt, end: True,
        stage: bool | None = None,
        value: Callable[[int], float | None] = lambda chunk: None,
    ):
        self.tier, self.fingerprint, self.stores, self.stage, self.value = tier, fingerprint, stores, stage, value
        self.chunks_published = 0
        self._tensors = [TensorSpec(*t) for t in tensors]
        self._layouts: dict[frozenset[tuple[int, str]], ChunkLayout] = {}
        self._names = {(layer, fmt) for layer, fmt, *_ in tensors if fmt != STATE}  # rows, handed over by layer
        self._layers = {
            fmt: sorted(layer for layer, f in self._names if f == fmt) for _, fmt in self._names
        }  # storing each format
        self._seqs: dict[int, SavedSequence] = {}
        self._batch: _Batch | None = None
        self._lock = threading.Lock()
        self._stage2: ThreadPoolExecutor | None = None  # made on the first GPU batch
        self._save_stream = None
        self._events: list = []  # GPU: fired events, for the next batches to record
        self._flags: list[torch.Tensor] = []  # GPU: pinned bools, read by stage 2, for the next batches' vouchers
        self._buffers: dict[tuple[str, torch.device], torch.Tensor] = {}  # RUN_BYTES for each format's runs, made once

    @property
    def stalls(self) -> int:
        """Times stage 1 waited for room in the pool (back-pressure on the forward pass)."""
        return self.tier.saver_stalls.count

    @property
    def stall_seconds(self) -> float:
        return self.tier.saver_stalls.seconds

    @property
    def save_errors(self) -> int:
        """Chunks not written to disk, and chunks not saved for want of room in the pool."""
        return self.tier.write_errors + self.tier.unsaved

    def open(self, uid: int, chain: KeyChain) -> None:
        """Start saving sequence ``uid``, whose chunk keys ``chain`` gives."""
        self._seqs[uid] = SavedSequence(uid, chain)

    def close(self, uid: int, keep_partial: bool = False) -> PartialChunk | None:
        """Wait until every full chunk of ``uid`` is published, then forget ``uid``; its partial chunks are
        given back. With ``keep_partial``, its trailing partial chunk, if every row of it so far was computed
        and has landed, is returned instead: a sequence that goes on with the same tokens may :meth:`resume`
        it, so the chunk is still saved when its first rows were not computed again; or
        :meth:`drop_partial` gives it back."""
        self._abort_unfinished_batch()
        seq = self._seqs.pop(uid, None)
        if seq is None:
            return None
        for f in seq.in_flight:
            f.result()
        kept = None
        if keep_partial and not seq.broken:
            last = seq.chunks.get(len(seq.chain.chunks))
            if last is not None and last.image is not None and 0 < last.filled == last.expected == len(seq.chain.tail):
                kept = seq.chunks.pop(last.index)
        self._give_back(list(seq.chunks.values()))
        seq.chunks.clear()
        return kept

    def resume(self, uid: int, partial: PartialChunk, rows: int) -> None:
        """Continue ``partial`` (from :meth:`close`) in sequence ``uid``, whose chunk at the same index begins
        with the same first ``rows`` tokens, after the same chunks: the rows ``uid`` computes next fill it
        from ``rows`` on. Whatever ``uid`` had of that chunk is given back."""
        seq = self._seqs.get(uid)
        if seq is None or not 0 < rows <= partial.filled:
            self.drop_partial(partial)
            return
        partial.expected = partial.filled = rows
        old = seq.chunks.pop(partial.index, None)
        seq.chunks[partial.index] = partial
        self._give_back([old] if old is not None else [])

    def drop_partial(self, partial: PartialChunk) -> None:
        self._give_back([partial])

    def shutdown(self) -> None:
        """Drain, drop every open sequence and stop the stage-2 thread."""
        for uid in list(self._seqs):
            self.close(uid)
        if self._stage2 is not None:
            self._stage2.shutdown(wait=True)

    # ---- stage 1: called by the engine's forward ------------------------------------------------------
    def begin_batch(self, segments: list[Segment], later: Collection[str] = ()) -> None:
        """Give every chunk the batch's rows reach a slot. A chunk whose next computed rows do not start
        where its last ones ended had rows restored in between: it never fills, so its slot goes back.
        ``later``: formats the engine does not hand over by layer (:meth:`end_batch` reads them)."""
        self._abort_unfinished_batch()
        pieces, dead = [], []
        for s in segments:
            seq = self._seqs.get(s.uid)
            if seq is None:
                continue
            for c in list(seq.chunks.values()):  # stopped short of this segment: the rest was restored
                if c.expected < CHUNK_TOKENS and c.index * CHUNK_TOKENS + c.expected < s.start:
                    dead.append(seq.chunks.pop(c.index))
            for index, offset, row, n in split(s.start, s.row, s.length):
                chunk = seq.chunks.get(index)
                if chunk is not None and chunk.expected != offset:
                    dead.append(seq.chunks.pop(index))
                    chunk = None
                if chunk is None:
                    image = (
                        self.tier.create(self._layout(index, s.start + s.length), self.fingerprint)
                        if offset == 0
                        else None
                    )
                    chunk = seq.chunks[index] = Chunk(index, image, expected=offset)
                chunk.expected = offset + n
                pieces.append(Piece(seq, chunk, offset, row, n))
        self._batch = _Batch(pieces, dead, frozenset(later)) if pieces or dead else None

    def on_layer(self, layer: int, rows: dict[str, torch.Tensor], keep: Collection[str] = ()) -> None:
        """Layer ``layer``'s rows of the batch by format, each ``[T, *row]``; copied (on the current stream)
        before this returns, into the format's run or straight to the chunks: the engine may reuse them next.
        ``keep``: formats whose tensors were made for the saver (nobody else writes them), held as they are
        until their run is copied, with the run's other kept tensors in one call: at a decode step a layer's
        copy costs more in calls than in bytes."""
        batch = self._batch
        if batch is None:
            return
        for fmt, t in rows.items():
            batch.delivered.add((layer, fmt))
            run, kept = batch.runs.get(fmt), fmt in keep
            if run is not None and (
                len(run.layers) == len(run.rows)
                or (run.kept is not None) != kept
                or (run.rows.shape[1:], run.rows.dtype, run.rows.device) != (t.shape, t.dtype, t.device)
            ):
                self._flush(batch, fmt)
                run = None
            if run is None:
                room = min(
                    RUN_BYTES // max(t.nbytes, 1), len(self._layers.get(fmt, ()))
                )  # a run never holds more layers
                if room < 2:
                    self._copy(batch.pieces, (layer,), fmt, t[None])
                    continue
                buffer = self._buffers.get((fmt, t.device))
                if buffer is None:
                    buffer = self._buffers[(fmt, t.device)] = torch.empty(RUN_BYTES, dtype=torch.uint8, device=t.device)
                run = batch.runs[fmt] = _Run(
                    [], buffer[: room * t.nbytes].view(t.dtype).view(room, *t.shape), [] if kept else None
                )
            if kept:
                run.kept.append(t)
            else:
                run.rows[len(run.layers)].copy_(t)
            run.layers.append(layer)

    def keep_state(self, uid: int, chunk: int, layer: int, rows: torch.Tensor) -> None:
        """Recurrent layer ``layer``'s state after chunk ``chunk`` of ``uid`` (``[64, w]``, :data:`STATE`), which
        the chunk, being filled by this batch, stores where its layout has it (``stores`` asked); copied before
        this returns. A chunk whose layout has a state publishes only with it."""
        seq = self._seqs.get(uid)
        c = seq.chunks.get(chunk) if seq is not None and self._batch is not None else None
        if c is None or c.image is None or (layer, STATE) not in c.image.layout.entries:
            return
        stage = device_copy.uses_streams(rows.device) if self.stage is None else self.stage
        copy_state(c, layer, STATE, rows, stage=stage, fingerprint=self.fingerprint)

    def vouch(self, held: torch.Tensor) -> None:
        """The batch's rows hold only if ``held`` (a bool on their device) does: a chunk they reach publishes
        only if it does. Read once the chunk fills and its rows have landed, not now: on a GPU, reading it
        here would wait for the forward."""
        if self._batch is not None:
            self._batch.vouchers.append(held)

    def _flush(self, batch: _Batch, fmt: str) -> None:
        run = batch.runs.pop(fmt)
        rows = run.rows[: len(run.layers)]
        if run.kept is not None:
            torch.stack(run.kept, out=rows)
        self._copy(batch.pieces, tuple(run.layers), fmt, rows)

    def end_batch(self, read: Callable[[list[Segment]], dict[str, torch.Tensor]] | None = None) -> None:
        """``read(segments)``: where the batch named formats ``later``, the engine's rows of them for
        ``segments`` (whole chunks, rows one after another), by format, ``[layers, T, *row]`` for every layer
        that stores the format, in order."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        if batch.later and read is None:  # its chunks never fill: they are given back when their sequences close
            raise ValueError(f"a batch that named {sorted(batch.later)} later must end with a read of them")
        for fmt in list(batch.runs):
            self._flush(batch, fmt)
        names = {name for name in self._names if name[1] not in batch.later}
        if batch.pieces and batch.delivered != names:  # a capture that skipped a layer: its rows are not all there
            log.error(
                "saver: a forward pass handed over %d of %d layer tensors; its chunks are not saved",
                len(batch.delivered & names),
                len(names),
            )
            for p in batch.pieces:
                p.seq.broken = True
        if batch.later:
            self._read_later(batch, read)
        if batch.vouchers:  # only where the engine vouches (vLLM's H): no work a step otherwise
            for chunk in {id(p.chunk): p.chunk for p in batch.pieces}.values():
                chunk.vouchers += batch.vouchers
        filled = {
            id(p.chunk): p for p in batch.pieces if p.chunk.expected == CHUNK_TOKENS and not p.seq.broken
        }.values()
        full = [p.chunk for p in filled if p.chunk.staged is not None]
        checks = list({id(v): v for p in filled for v in p.chunk.vouchers}.values())
        if not full and not checks:
            self._land(batch)
            return
        device = full[0].staged.data.device if full else checks[0].device
        if not device_copy.uses_streams(device):
            if checks and not torch.stack(checks).all():
                self._refuse(filled)
            unstage(full)
            self._land(batch)
            return
        # The whole chunks cross to their pinned slots on the save stream, which the forward never waits for.
        if self._save_stream is None:
            self._save_stream = torch.cuda.Stream(device)
            self._stage2 = helper_threads.executor(1, "hcache-saver")
        self._save_stream.wait_stream(torch.cuda.current_stream(device))
        flag = None
        with torch.cuda.stream(self._save_stream):
            for c in full:
                c.staged.data.record_stream(self._save_stream)  # its memory is reused only once the copy is done
            unstage(full)
            if checks:  # read by stage 2 once landed: no wait for the forward here
                flag = (
                    self._flags.pop()
                    if self._flags
                    else torch.empty((), dtype=torch.bool, pin_memory=device.type == "cuda")
                )
                flag.copy_(torch.stack(checks).all(), non_blocking=True)
        landed = self._events.pop() if self._events else torch.cuda.Event()
        landed.record(self._save_stream)
        future = self._stage2.submit(self._land_when, landed, batch, flag, list(filled))
        for seq in {id(p.seq): p.seq for p in batch.pieces}.values():
            seq.in_flight = [f for f in seq.in_flight if not f.done()] + [future]

    def _read_later(self, batch: _Batch, read: Callable[[list[Segment]], dict[str, torch.Tensor]]) -> None:
        """The ``later`` rows of each chunk this batch filled, read in one call and copied in like a run."""
        filled = [
            p for p in batch.pieces if p.offset + p.n == CHUNK_TOKENS and p.chunk.image is not None and not p.seq.broken
        ]
        if not filled:
            return
        pieces = [Piece(p.seq, p.chunk, 0, k * CHUNK_TOKENS, CHUNK_TOKENS) for k, p in enumerate(filled)]
        rows = read([Segment(p.seq.uid, p.chunk.index * CHUNK_TOKENS, CHUNK_TOKENS, p.row) for p in pieces])
        for fmt in batch.later:
            self._copy(pieces, tuple(self._layers[fmt]), fmt, rows[fmt])

    def _abort_unfinished_batch(self) -> None:
        """A batch that began but never ended (its forward raised) publishes nothing; nor do its sequences."""
        batch, self._batch = self._batch, None
        if batch is not None:
            for p in batch.pieces:
                p.seq.broken = True
            self._give_back(batch.dead)

    # ---- the copies and stage 2 -----------------------------------------------------------------------
    def _copy(self, pieces: list[Piece], layers: tuple[int, ...], fmt: str, src: torch.Tensor) -> None:
        stage = device_copy.uses_streams(src.device) if self.stage is None else self.stage
        copy_rows(pieces, layers, fmt, src, stage=stage, fingerprint=self.fingerprint)

    def _land_when(
        self, landed: torch.cuda.Event, batch: _Batch, flag: torch.Tensor | None, filled: list[Piece]
    ) -> None:
        try:
            landed.synchronize()
            self._events.append(landed)  # reused by a later batch: it has fired
            if flag is not None:
                held = bool(flag)
                self._flags.append(flag)
                if not held:
                    self._refuse(filled)
            self._land(batch)
        except Exception:
            log.exception("saver: copying a batch's rows failed; its chunks are not saved")
            for p in batch.pieces:
                p.seq.broken = True

    @staticmethod
    def _refuse(filled) -> None:
        """Chunks filled with rows that a voucher says were not all the engine's: their sequences publish
        nothing more (a row of another token in a chunk would be served as this one's)."""
        log.error("saver: a batch's rows were not all where the engine placed its tokens; their chunks are not saved")
        for p in filled:
            p.seq.broken = True

    def _land(self, batch: _Batch) -> None:
        """The batch's rows are in their slots: count them, publish every chunk now complete, and give back
        the slots of chunks that can no longer fill."""
        with self._lock:
            for p in batch.pieces:
                chunk = p.chunk
                chunk.filled += p.n
                if chunk.filled < CHUNK_TOKENS or p.seq.broken or p.seq.chunks.get(chunk.index) is not chunk:
                    continue
                del p.seq.chunks[chunk.index]
                if chunk.image is not None and not _has_states(chunk):  # never a prefix without its state
                    log.error("saver: chunk %d of sequence %d filled without its state", chunk.index, p.seq.uid)
                    batch.dead.append(chunk)
                    continue
                if chunk.image is not None:
                    key, tokens = p.seq.chain.chunk(chunk.index)  # keyed before the forward
                    self.tier.publish(
                        chunk.image, key, tokens, self.value(chunk.index), p.seq.chain.parent(chunk.index)
                    )
                    self.chunks_published += 1
        self._give_back(batch.dead)

    def _give_back(self, chunks: list[Chunk]) -> None:
        """Return unpublished chunks' slots, once no copy into them can still be running."""
        chunks = [c for c in chunks if c.image is not None]
        if not chunks:
            return
        if self._save_stream is not None:
            self._save_stream.synchronize()
        with self._lock:
            for c in chunks:
                if c.image is not None:
                    self.tier.abandon(c.image)
                    c.image = c.staged = None

    def _layout(self, index: int, end: int) -> ChunkLayout:
        stored = [t for t in self._tensors if self.stores(index, t.layer, t.fmt, end)]
        names = frozenset((layer, fmt) for layer, fmt, *_ in stored)
        if names not in self._layouts:
            self._layouts[names] = ChunkLayout.plan(stored, self.fingerprint)
        return self._layouts[names]


def _has_states(chunk: Chunk) -> bool:
    """Whether every state the chunk's layout holds was kept (:meth:`ChunkSaver.keep_state`)."""
    return all(layer in chunk.states for layer, fmt in chunk.image.layout.entries if fmt == STATE)
