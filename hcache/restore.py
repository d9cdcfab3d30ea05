"""Restore a stored token prefix into an engine's KV cache, layer by layer, by a :class:`RestorePlan`.

Stored state is never trusted: a chunk that is missing, unreadable, saved by another model, for other
tokens, or that fails its checksum ends the usable prefix there. Tokens past that point are prefilled
from scratch, which is exact. A chunk found bad half-way through the layers is still safe: the prefill
of the remaining tokens rewrites every layer's K/V from that position on.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
import torch

from .engine.interface import Engine
from .layer_prefetch import LayerPrefetcher, ReaderPool
from .model_spec import ModelSpec
from .plan import Method, RestorePlan
from .storage.chunk import ChunkInvalid, ChunkReader
from .storage.chunk_key import CHUNK_TOKENS
from .storage.chunk_store import ChunkStore
from .tensor_parallel import SINGLE, TPGroup

log = logging.getLogger(__name__)


@dataclass
class RestoreOutcome:
    tokens: int  # tokens whose KV is now in the cache, after those the sequence held
    bytes_read: int
    fallback: str | None  # why stored state stopped short of what the lookup found, if it did


def row_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The per-token shape of each stored format."""
    return {Method.H.value: (spec.hidden_size,), Method.KV.value: (2, spec.num_kv_heads, spec.head_size)}


def restore_prefix(
    engine: Engine,
    store: ChunkStore,
    uid: int,
    tokens: list[int],
    keys: list[str],
    fingerprint: str,
    plan: RestorePlan,
    pool: ReaderPool | None = None,
    tp: TPGroup = SINGLE,
    *,
    held: int = 0,
    limit: int | None = None,
) -> RestoreOutcome:
    """Restore the longest verified prefix of ``keys`` into sequence ``uid``, after the tokens it holds.

    ``tokens`` start at a chunk boundary, and ``keys`` are the chain keys of their full chunks. The
    sequence already holds the first ``held`` of them (``held < 64``: it ends inside the first chunk), and
    at most the first ``limit`` are wanted; so a sequence can be restored in steps, as its prompt arrives
    in parts, and a chunk can be restored in part.

    With a ``pool`` the stored layers are read ahead, while the RE layers and earlier layers compute;
    without one each layer is read just before it is restored. Both give the same cache.

    With tensor parallelism every rank of ``tp`` calls this at once, with its engine shard, and ``keys``
    and ``fingerprint`` of its own chunks: the ranks agree on the prefix, and an H layer's rows are
    gathered from the ranks that store them (:class:`~hcache.tensor_parallel.TPGroup`)."""
    limit = len(keys) * CHUNK_TOKENS if limit is None else limit
    keys = keys[: -(-limit // CHUNK_TOKENS)]

    def end(chunks: int) -> int:  # where a restore of that many chunks stops in ``tokens``
        return max(held, min(chunks * CHUNK_TOKENS, limit))

    with ExitStack() as files:
        first = engine.seen_tokens(uid) // CHUNK_TOKENS  # with TP, which rank stores a chunk's H depends on it
        readers, fallback = _open_prefix(store, files, keys, tokens, fingerprint, plan, tp, first)
        n = agreed = tp.min(len(readers))  # a prefix that one rank lacks is no prefix at all
        if agreed < len(readers):
            fallback = fallback or _elsewhere(agreed)
        engine.begin_restore(uid, end(n) - held)
        jobs = [(layer, m.value) for layer, m in enumerate(plan.layers) if m is not Method.RE] if n else []
        spec = engine.spec
        hidden_chunks = tp.hidden_chunks(n, first)
        chunk_readers = {Method.H.value: [readers[j] for j in hidden_chunks], Method.KV.value: readers[:n]}
        with LayerPrefetcher(chunk_readers, jobs, row_shapes(spec), getattr(torch, spec.dtype), engine.device, pool) as ahead:
            if n and plan.count(Method.RE):
                engine.recompute_layers(uid, tokens[held : end(n)], plan.count(Method.RE))
            for got in ahead:
                if got.bad is not None:
                    i, exc = got.bad
                    j = hidden_chunks[i] if got.fmt == Method.H.value else i
                    if j < n:
                        fallback, n = _reject(store, readers[j].key, j, exc), j
                if n == 0 and tp.world_size == 1:
                    break  # with TP, other ranks still gather this rank's rows of the H layers left
                # Rows past another rank's bad chunk are garbage; the agreement below ends the prefix there.
                if got.fmt == Method.H.value:
                    rows = tp.gather_hidden(got.rows, agreed, first)[held : end(n)]  # collective: every rank gathers
                    if len(rows):
                        engine.restore_from_hidden(uid, got.layer, rows)
                else:
                    rows = got.rows[held : end(n)]
                    if len(rows):
                        engine.restore_kv(uid, got.layer, rows[:, 0], rows[:, 1])
        restored = tp.min(n)
        if restored < n:
            fallback = fallback or _elsewhere(restored)
        engine.end_restore(uid, tokens[held : end(restored)])
        return RestoreOutcome(end(restored) - held, sum(r.bytes_read for r in readers), fallback)


def _elsewhere(n: int) -> str:
    reason = f"another tensor-parallel rank's stored state ends at token {n * CHUNK_TOKENS}"
    log.info("%s; recomputing from there", reason)
    return reason


def _open_prefix(
    store: ChunkStore, files: ExitStack, keys: list[str], tokens: list[int], fingerprint: str, plan: RestorePlan,
    tp: TPGroup, first: int,
) -> tuple[list[ChunkReader], str | None]:
    stored = {(layer, m.stored_format) for layer, m in enumerate(plan.layers) if m is not Method.RE}
    readers: list[ChunkReader] = []
    for j, key in enumerate(keys):
        try:
            file = store.open(key)
        except OSError as exc:
            return readers, _reject(store, key, j, exc)
        if file is None:
            return readers, None  # the stored prefix simply ends here
        files.enter_context(file)
        try:
            reader = ChunkReader.open(file, key, tokens[j * CHUNK_TOKENS : (j + 1) * CHUNK_TOKENS], fingerprint)
        except ChunkInvalid as exc:
            return readers, _reject(store, key, j, exc)
        missing = {(layer, fmt) for layer, fmt in stored if tp.stores(first + j, fmt)} - set(reader.entries)
        if missing:
            reason = f"chunk {key} was saved without {sorted({f for _, f in missing})} state that plan {plan} needs"
            log.info("%s; recomputing from token %d", reason, j * CHUNK_TOKENS)
            return readers, reason
        readers.append(reader)
    return readers, None


def _reject(store: ChunkStore, key: str, index: int, exc: ChunkInvalid | OSError) -> str:
    """Log and say why the prefix ends here. A chunk proven bad is dropped, so the prefill that follows can
    save a good one; one that could not be read (an I/O error, perhaps passing) is kept."""
    if isinstance(exc, OSError):
        reason = f"chunk {key}: cannot read ({exc})"
        log.warning("%s; recomputing from token %d", reason, index * CHUNK_TOKENS)
        return reason
    log.warning("%s; discarding it and recomputing from token %d", exc, index * CHUNK_TOKENS)
    try:
        store.discard(key)
    except OSError as err:  # it stays unusable either way: it fails verification on every read
        log.warning("could not discard chunk %s: %s", key, err)
    return str(exc)
