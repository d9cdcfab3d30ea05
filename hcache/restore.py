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

log = logging.getLogger(__name__)


@dataclass
class RestoreOutcome:
    tokens: int  # leading tokens whose KV is now in the cache
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
) -> RestoreOutcome:
    """Restore the longest verified prefix of ``keys`` into sequence ``uid``, after the tokens it holds.

    ``tokens`` follow what the sequence holds (all of a new sequence's prompt), and ``keys`` are the chain
    keys of their full chunks: a sequence can be restored in steps, as its prompt arrives in parts.

    With a ``pool`` the stored layers are read ahead, while the RE layers and earlier layers compute;
    without one each layer is read just before it is restored. Both give the same cache."""
    with ExitStack() as files:
        readers, fallback = _open_prefix(store, files, keys, tokens, fingerprint, plan)
        n = len(readers)
        engine.begin_restore(uid, n * CHUNK_TOKENS)
        jobs = [(layer, m.value) for layer, m in enumerate(plan.layers) if m is not Method.RE] if n else []
        spec = engine.spec
        with LayerPrefetcher(readers, jobs, row_shapes(spec), getattr(torch, spec.dtype), engine.device, pool) as ahead:
            if n and plan.count(Method.RE):
                engine.recompute_layers(uid, tokens[: n * CHUNK_TOKENS], plan.count(Method.RE))
            for got in ahead:
                if got.bad is not None and got.bad[0] < n:
                    j, exc = got.bad
                    fallback, n = _reject(store, readers[j].key, j, exc), j
                if n == 0:
                    break
                rows = got.rows[: n * CHUNK_TOKENS]
                if got.fmt == Method.H.value:
                    engine.restore_from_hidden(uid, got.layer, rows)
                else:
                    engine.restore_kv(uid, got.layer, rows[:, 0], rows[:, 1])
        engine.end_restore(uid, tokens[: n * CHUNK_TOKENS])
        return RestoreOutcome(n * CHUNK_TOKENS, sum(r.bytes_read for r in readers), fallback)


def _open_prefix(
    store: ChunkStore, files: ExitStack, keys: list[str], tokens: list[int], fingerprint: str, plan: RestorePlan
) -> tuple[list[ChunkReader], str | None]:
    needed = {(layer, m.stored_format) for layer, m in enumerate(plan.layers) if m is not Method.RE}
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
        missing = needed - set(reader.entries)
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
