"""Restore a stored token prefix into an engine's KV cache, layer by layer, by a :class:`RestorePlan`: the
restore core's pipeline (:func:`~hcache.restore.layers.restore_layers`) writing through the engine's
restore primitives (:class:`EngineTarget`), as vLLM's loads write through their paged target.

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

import logging

import torch

from ..engine.interface import Engine, RestorePrimitives
from ..model.tensor_parallel import SINGLE, TPGroup
from ..planning.checkpoints import StateRule
from ..planning.plan import Method, RestorePlan
from ..planning.window import WindowRule
from ..restore.layers import StoredRows, restore_layers
from ..restore.reads import LayerJob, layer_jobs, reads
from ..restore.records import MissReason
from ..restore.stored_prefix import RestoreOutcome, StoredPrefix
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.host_tier import HostTier
from ..storage.image_rows import ImageRows
from ..transfer.copier import Copier

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
    states: StateRule | None = None,
) -> RestoreOutcome:
    """Restore the longest verified prefix of ``keys`` into sequence ``uid``, after the tokens it holds.

    ``tokens`` start at a chunk boundary, and ``keys`` are the chain keys of their full chunks. The
    sequence already holds the first ``held`` of them (``held < 64``: it ends inside the first chunk), and
    at most the first ``limit`` are wanted; so a sequence can be restored in steps, as its prompt arrives
    in parts, and a chunk can be restored in part. ``window``: the rule by which sliding-window layers
    were saved and are read (the store stack's; by default, the engine's model's windows); ``states``: the
    rule by which recurrent layers' states were kept (the store stack's; by default, at every chunk's end).

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
    recompute = plan.count(Method.RE)
    # A recurrent layer's state moves on with every token it is run over: its RE layers run over the verified
    # prefix alone, once it is known, where attention layers' run ahead, over what the look-up found.
    stateful = any(engine.spec.is_recurrent(layer) for layer in range(recompute))
    with StoredPrefix(tier, keys, first) as prefix:
        try:
            prefix.fetch(present)
            agreed = tp.min(present)  # a prefix that one rank lacks is no prefix at all
            engine.begin_restore(uid, end(agreed) - held)
            copier.follow()  # the copies wait for the blocks' allocation, not for the RE layers queued next
            if agreed and recompute and not stateful:
                engine.recompute_layers(uid, tokens[held : end(agreed)], recompute)
            prefix.verify(
                tokens, fingerprint, plan, engine.spec, rule, lambda m: base + end(m), tp, count=agreed, states=states
            )
            if stateful and prefix.images:
                engine.recompute_layers(uid, tokens[held : end(len(prefix.images))], recompute)
            if agreed < present:
                prefix.short(_elsewhere(agreed), MissReason.OTHER_RANK)
            n = len(prefix.images)
            jobs = layer_jobs(plan, rule, first, base + held, base + end(n), n, tp, agreed)
            if n or tp.world_size > 1:  # with TP, the other ranks still gather this rank's rows of the H layers
                filler = (
                    torch.zeros(CHUNK_TOKENS, engine.spec.hidden_size, dtype=engine.spec.torch_dtype)
                    if tp.world_size > 1
                    else None
                )
                # one gather a layer where copies run on a GPU's streams; a CPU copies chunks straight into
                # its cache (a gather there costs a pass over the rows, and a fresh buffer's page faults)
                shared = ImageRows.of(prefix.images, copier.device) if filler is None and copier.cuda else None
                dtype = engine.spec.torch_dtype
                rows = StoredRows(prefix.images, first, base + end(n), copier, dtype, shared=shared, filler=filler)
                restore_layers(jobs, rows, EngineTarget(engine, uid, base + held), copier, tp, agreed)
            restored = tp.min(n)
            if restored < n:
                prefix.short(_elsewhere(restored), MissReason.OTHER_RANK)
            engine.end_restore(uid, tokens[held : end(restored)])
            windowed = any(job.chunks.start for job in jobs if rule.window(job.layer) is not None)
            return prefix.outcome(
                engine.spec,
                reads(jobs),
                restored,
                base + held,
                base + end(restored),
                end(len(keys)) - end(restored),
                windowed,
            )
        finally:
            copier.drain()  # no copy may still read a slot the prefix gives back


class EngineTarget:
    """The restore core's target for an engine's cache, the reference engine's or FastGen's, written through
    its restore primitives: sequence ``uid``'s rows from position ``start`` on."""

    def __init__(self, engine: RestorePrimitives, uid: int, start: int):
        self.engine, self.uid, self.start = engine, uid, start

    def write_kv(self, job: LayerJob, rows: StoredRows) -> None:
        self.engine.restore_kv(self.uid, job.layer, rows.kv(job), job.begin - self.start)

    def write_hidden(self, job: LayerJob, hidden: torch.Tensor) -> None:
        self.engine.restore_from_hidden(self.uid, job.layer, hidden, job.begin - self.start)

    def write_state(self, job: LayerJob, rows: torch.Tensor) -> None:
        self.engine.restore_state(self.uid, job.layer, rows)


def _elsewhere(n: int) -> str:
    reason = f"another tensor-parallel rank's stored state ends at token {n * CHUNK_TOKENS}"
    log.info("%s; recomputing from there", reason)
    return reason
