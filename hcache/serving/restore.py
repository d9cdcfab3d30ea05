"""Restore a stored token prefix into an engine's KV cache, layer by layer, by a :class:`RestorePlan`.

The chunks are fetched, verified and accounted for as every restore's are
(:class:`~hcache.restore.stored_prefix.StoredPrefix`): the usable prefix ends at the first chunk that is
missing or bad, and tokens past it are prefilled from scratch, which is exact. A chunk found bad half-way
through the layers is still safe: the prefill of the remaining tokens rewrites every layer's K/V from that
position on.

Each chunk's tensors say how they are encoded: the model's dtype, or 8-bit codes with a scale tensor
beside them (:mod:`hcache.storage.stored_state`), whatever this runtime saves; a restore may span both kinds. Codes
cross to the device as stored and are dequantised there: KV inside the copy into the paged cache, H just
before its K/V GEMM.
"""
from __future__ import annotations

import itertools
import logging

import torch

from ..engine.interface import Engine
from ..model.tensor_parallel import SINGLE, TPGroup
from ..ops.quant import QuantRows
from ..planning.plan import Method, RestorePlan
from ..planning.window import WindowRule
from ..storage.chunk import ChunkImage
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.host_tier import HostTier
from ..storage.stored_state import decode_rows, stored_rows
from ..storage.tp_ownership import shared_chunks
from ..transfer.copier import Copier
from ..transfer.scratch import Scratch
from ..restore.records import MissReason
from ..restore.stored_prefix import RestoreOutcome, StoredPrefix

log = logging.getLogger(__name__)


def restore_prefix(
    engine: Engine,
    tier: HostTier,
    uid: int,
    tokens: list[int],
    keys: list[str],
    fingerprint: str,
    plan: RestorePlan,
    copier: Copier,
    tp: TPGroup = SINGLE,
    *,
    held: int = 0,
    limit: int | None = None,
    window: WindowRule | None = None,
) -> RestoreOutcome:
    """Restore the longest verified prefix of ``keys`` into sequence ``uid``, after the tokens it holds.

    ``tokens`` start at a chunk boundary, and ``keys`` are the chain keys of their full chunks. The
    sequence already holds the first ``held`` of them (``held < 64``: it ends inside the first chunk), and
    at most the first ``limit`` are wanted; so a sequence can be restored in steps, as its prompt arrives
    in parts, and a chunk can be restored in part. ``window``: the rule by which sliding-window layers
    were saved and are read (the store stack's; by default, the engine's model's windows).

    The chunks are fetched into the host pool first (from disk on the tier's reader threads, while the RE
    layers compute); then each stored layer is copied from the pool, ``copier.depth`` layers ahead of the
    compute that consumes it.

    With tensor parallelism every rank of ``tp`` calls this at once, with its engine shard, and ``keys``
    and ``fingerprint`` of its own chunks: the ranks agree on the prefix, and an H layer's rows are
    gathered from the ranks that store them (:class:`~hcache.model.tensor_parallel.TPGroup`)."""
    limit = len(keys) * CHUNK_TOKENS if limit is None else limit
    rule = window or WindowRule(engine.spec, engine.block_size)
    keys = keys[: -(-limit // CHUNK_TOKENS)]

    def end(chunks: int) -> int:  # where a restore of that many chunks stops in ``tokens``
        return max(held, min(chunks * CHUNK_TOKENS, limit))

    first = engine.seen_tokens(uid) // CHUNK_TOKENS  # with TP, which rank stores a chunk's H depends on it
    base = first * CHUNK_TOKENS  # where ``tokens`` start in the sequence
    present = tier.stored_prefix(keys)
    with StoredPrefix(tier, keys, first) as prefix:
        try:
            prefix.fetch(present)
            agreed = tp.min(present)  # a prefix that one rank lacks is no prefix at all
            engine.begin_restore(uid, end(agreed) - held)
            copier.follow()  # the copies wait for the blocks' allocation, not for the RE layers queued next
            if agreed and plan.count(Method.RE):
                engine.recompute_layers(uid, tokens[held : end(agreed)], plan.count(Method.RE))
            prefix.verify(tokens, fingerprint, plan, engine.spec, rule, lambda m: base + end(m), tp, count=agreed)
            if agreed < present:
                prefix.short(_elsewhere(agreed), MissReason.OTHER_RANK)
            images = prefix.images
            n = len(images)
            jobs = [(layer, m.value) for layer, m in enumerate(plan.layers) if m is not Method.RE] if agreed else []
            # Chunks each layer reads: all of them, or a sliding-window layer's last window (at TP > 1 only on
            # vLLM's path, which restores no H: ``resolve`` refuses sliding-window models to the DeepSpeed path's TP).
            reads = {
                (layer, fmt): range(max(0, rule.first_read(layer, base + end(n)) - first), n)
                if fmt == Method.KV.value or tp.world_size == 1 else _reading(tp, fmt, n, agreed, first)
                for layer, fmt in jobs
            }  # fmt: skip
            if n or tp.world_size > 1:  # with TP, the other ranks still gather this rank's rows of the H layers
                _restore_layers(engine, copier, tp, uid, images, jobs, reads, held, end(n), agreed, first)
            restored = tp.min(n)
            if restored < n:
                prefix.short(_elsewhere(restored), MissReason.OTHER_RANK)
            engine.end_restore(uid, tokens[held : end(restored)])
            windowed = any(chunks.start for (layer, _), chunks in reads.items() if rule.window(layer) is not None)
            return prefix.outcome(engine.spec, reads, restored, base + held, base + end(restored), end(len(keys)) - end(restored), windowed)
        finally:
            copier.drain()  # no copy may still read a slot the prefix gives back


def _reading(tp: TPGroup, fmt: str, n: int, agreed: int, first: int) -> range:
    """The chunks whose ``fmt`` rows this rank reads."""
    return shared_chunks(tp.rank, tp.world_size, agreed if tp.world_size > 1 else n, first) if fmt == Method.H.value else range(n)


def _restore_layers(
    engine: Engine, copier: Copier, tp: TPGroup, uid: int, images: list[ChunkImage], jobs: list[tuple[int, str]],
    reads: dict[tuple[int, str], range], held: int, stop: int, agreed: int, first: int,
) -> None:
    """Each stored layer's rows from the pool into the engine, from the chunks it ``reads``: KV copied into
    the paged cache, H copied to the device and projected. Copies run ``copier.depth`` layers ahead of the
    compute. A layer that reads from chunk ``j`` on writes from that chunk's first row (or ``held``) on."""
    n, spec = len(images), engine.spec
    dtype = spec.torch_dtype
    filler = torch.zeros(CHUNK_TOKENS, spec.hidden_size, dtype=dtype) if tp.world_size > 1 else None  # TP only

    def origin(layer: int, fmt: str) -> int:  # where the layer's rows begin: its first chunk read (H with TP: all, gathered)
        return reads[(layer, fmt)].start * CHUNK_TOKENS if tp.world_size == 1 or fmt == Method.KV.value else 0

    def stage(job: tuple[int, str]) -> list:
        layer, fmt = job
        if fmt == Method.H.value:  # rows past another rank's bad chunk are garbage: the agreement ends the prefix there
            parts = [stored_rows(images[j], layer, fmt) if j < n else filler for j in reads[(layer, fmt)]]
            return gather_runs(copier, parts)
        chunks = reads[(layer, fmt)]
        if chunks:  # one call for the layer: the rows from ``held`` (or its first chunk) to ``stop`` in the last
            parts = [stored_rows(images[j], layer, fmt) for j in chunks]
            parts[-1] = parts[-1][: stop - (n - 1) * CHUNK_TOKENS]
            if chunks.start == 0:
                parts[0] = parts[0][held:]
            engine.restore_kv(uid, layer, parts, max(held, origin(layer, fmt)) - held)
        return []

    def finish(job: tuple[int, str], runs: list, done) -> None:
        layer, fmt = job
        if fmt != Method.H.value:
            return
        copier.wait(done, *run_tensors(runs))
        pieces = [decode_rows(run, dtype) for run in runs]
        if len(pieces) == 1:  # a layer stored in one encoding: its gathered rows as they are
            rows = pieces[0]
        else:  # none (a TP rank with no chunk's H), or chunks stored in several encodings
            rows = torch.cat(pieces) if pieces else torch.empty(0, spec.hidden_size, dtype=dtype, device=engine.device)
        rows = tp.gather_in_turn(rows, agreed, CHUNK_TOKENS, first)  # collective: every rank gathers
        base = origin(layer, fmt)
        rows = rows[max(held, base) - base : stop - base]
        if len(rows):
            engine.restore_from_hidden(uid, layer, rows, max(held, base) - held)

    last = copier.pipeline(jobs, stage, finish)
    copier.wait(last)  # the KV copies land before anything reads the cache


def gather_runs(copier: Copier, parts: list[torch.Tensor | QuantRows], scratch: Scratch | None = None) -> list[torch.Tensor | QuantRows]:
    """H rows of consecutive chunks on the device, one gather per run of chunks stored alike (one run,
    unless the chunks were saved in different encodings): lossless rows, or codes and scales (in
    ``scratch``'s buffers, if given: :meth:`Copier.gather`)."""
    runs = [list(run) for _, run in itertools.groupby(parts, lambda p: (type(p), (p.codes if isinstance(p, QuantRows) else p).dtype))]
    return [
        QuantRows(copier.gather([p.codes for p in run], scratch), copier.gather([p.scale for p in run], scratch))
        if isinstance(run[0], QuantRows) else copier.gather(run, scratch)
        for run in runs
    ]  # fmt: skip


def run_tensors(runs: list[torch.Tensor | QuantRows]) -> list[torch.Tensor]:
    """The device tensors :func:`gather_runs` made: what a stream that reads them must keep alive."""
    return [t for run in runs for t in ((run.codes, run.scale) if isinstance(run, QuantRows) else (run,))]


def _elsewhere(n: int) -> str:
    reason = f"another tensor-parallel rank's stored state ends at token {n * CHUNK_TOKENS}"
    log.info("%s; recomputing from there", reason)
    return reason
