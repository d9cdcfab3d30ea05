"""hcache's serving engine: FastGen's engine interface over either engine, with restore before prefill and
save during the forward.

MII's batching loop calls ``put``/``query``/``flush``/``free_blocks`` as it would on FastGen's
``InferenceEngineV2``, and never learns that part of a prompt came from the store. On each ``put``, the
stored prefix of a sequence's new tokens is restored by the plan (§5 of the paper: a restore phase before
prefill), and only the rest goes through the forward, where every layer's state is captured for the saver.
A long prompt that Dynamic SplitFuse splits over several puts is restored in steps, one per put.

The auto plan is chosen once per sequence, at its first restore, for the restored history: the stored
prefix of what has arrived, found by key lookups. When a prompt arrives in pieces and every full chunk that
has arrived is stored, the stored run may go on past them; if the prompt's length was announced (MII asks
``query`` for the whole prompt's capacity before its first put), the plan is chosen as if the run went on to
the prompt's last full chunk, which is exact for a returning conversation whose new turn is under a chunk,
and otherwise overestimates by its new tokens. Every later piece restores by that plan, so a prompt restores
by the same plan in pieces as in one put.

With ``gpu_cache=True``, finished sequences' chunks stay in spare KV blocks (:mod:`hcache.serving.gpu_prefix_cache`):
a put first adopts what that cache holds of its prefix, then restores what follows from the store. The
cached blocks count as free in ``free_blocks``, and each put first evicts as many as its tokens need.
Requests known before they run can :meth:`ServingEngine.prefetch` their stored chunks into the host pool
(:mod:`hcache.storage.prefetch`); a put of several sequences does so for all of them before restoring the first.
Counters are in ``metrics`` (:mod:`hcache.serving.metrics`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import ResolvedConfig
from ..engine.interface import Engine
from ..engine.ragged import Segment
from ..errors import InvalidRequestError
from ..model.tensor_parallel import SINGLE, TPGroup
from ..ops.quant import base_format, quantise, scale_format
from ..planning.plan import Method, RestorePlan
from ..storage.chunk import ChunkLayout
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain, chunk_keys, root_key
from ..storage.prefetch import Prefetcher
from ..transfer.copier import Copier
from ..transfer.saver import ChunkSaver
from .gpu_prefix_cache import Adoption, GpuPrefixCache
from .metrics import ServingMetrics
from .restore import restore_prefix, stored_tensors

log = logging.getLogger(__name__)


@dataclass
class RestoreStep:
    """One put's restore: the plan it followed, how many tokens it restored from the store, how many it
    adopted from the GPU prefix cache before, and the seconds of its disk reads that prefetch ran ahead."""

    plan: str
    tokens: int
    gpu_tokens: int = 0
    hidden_s: float = 0.0


@dataclass
class SequenceRecord:
    """What one sequence cost, summed over its puts: tokens restored (from the GPU prefix cache or the store)
    and run through the forward."""

    restored_tokens: int = 0
    gpu_tokens: int = 0  # of restored_tokens, adopted from the GPU prefix cache
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of restored_tokens, read from the host pool and stores, by tier
    computed_tokens: int = 0
    bytes_read: int = 0
    restore_s: float = 0.0
    prefetch_hidden_s: float = 0.0  # seconds of its restores' disk reads that prefetch ran ahead of them
    plan: str = ""  # the plan its restores follow; "" until one is tried
    fallback: str | None = None  # why stored state was used only in part, if it was
    lossy: bool = False  # restored state stored in 8 bits, or adopted from a sequence that restored such: not bit-identical to recompute
    restores: list[RestoreStep] = field(default_factory=list)  # one per put that restored tokens


@dataclass
class _Sequence:
    plan: RestorePlan | None  # None: auto, until the first restore chooses it
    restore: bool  # from the store
    adopt: bool  # from the GPU prefix cache (there may be one without a store)
    chain: KeyChain  # over the tokens the engine holds, and those of a put in progress; the saver reads it
    prompt_tokens: int = 0  # the prompt's length if announced before the first put (see the module doc)
    failed: bool = False  # a put raised part-way: the engine, the chain and the saver may disagree
    record: SequenceRecord = field(default_factory=SequenceRecord)


class _SaveCapture:
    """Feeds the engine's per-layer rows to the saver, in the formats chosen for each layer, quantised on
    the rows' device for the formats stored in an 8-bit encoding (codes and scales as two stored tensors)."""

    def __init__(self, saver: ChunkSaver, formats: list[frozenset[str]], encodings: dict[str, torch.dtype]):
        self.saver, self.formats, self.encodings = saver, formats, encodings

    def begin_batch(self, segments: list[Segment]) -> None:
        self.saver.begin_batch(segments)

    def on_layer(self, layer: int, hidden: torch.Tensor, kv: Callable[[], torch.Tensor]) -> None:
        rows = {}
        if Method.H.value in self.formats[layer]:
            rows[Method.H.value] = hidden
        if Method.KV.value in self.formats[layer]:
            rows[Method.KV.value] = kv()  # [T, 2, n_kv, head]: the stored KV layout
        for fmt, encoding in self.encodings.items():
            if fmt in rows:
                encoded = quantise(rows[fmt], encoding)
                rows[fmt], rows[scale_format(fmt)] = encoded.codes, encoded.scale
        self.saver.on_layer(layer, rows)

    def end_batch(self) -> None:
        self.saver.end_batch()


def _log_restore(uid: int, tokens: int, restored: int, step: RestoreStep, record: SequenceRecord,
                 tiers_before: dict[str, int], fallback_before: str | None) -> None:
    """One line per put that restored: the plan, the tokens restored of the put's and where they were read
    from, and why stored state stopped short, if it did (``-v``; logged only when INFO is on)."""
    tiers = Counter(record.tier_tokens)
    tiers.subtract(tiers_before)
    by_tier = {"gpu_cache": step.gpu_tokens, **tiers}
    where = ", ".join(f"{name} {n}" for name, n in by_tier.items() if n)
    fallback = record.fallback if record.fallback is not fallback_before else None  # this put's own, if any
    log.info("sequence %d: restored %d of %d tokens (%s; plan %s), computing %d%s", uid, restored, tokens, where,
             step.plan or "none", tokens - restored, f"; fell back to recompute: {fallback}" if fallback else "")


def _restores(allowed: bool, tokens: list[int]) -> bool:
    """Whether a put of ``tokens`` may restore (from the store, or from the GPU prefix cache), if ``allowed``:
    all but its last token can be restored, so a one-token put (a decode step) never does."""
    return allowed and len(tokens) > 1


class ServingEngine:
    """An :class:`~hcache.engine.interface.Engine` served through FastGen's interface, with a chunk store,
    by a :class:`~hcache.config.ResolvedConfig` (resolved for this engine's model; the settings are
    documented on :class:`~hcache.config.HCacheConfig`). With the store disabled, nothing is restored or
    saved: the recompute baseline. ``engine_config``: the engine config MII schedules by (it reads
    ``_config.state_manager``).

    With tensor parallelism, every rank of ``tp`` runs one of these over its shard of the engine, with the
    whole model's ``fingerprint``, and makes the same calls at once: the forward and restore are collective.
    Each rank stores and reads only what it owns (:mod:`hcache.model.tensor_parallel`).
    """

    def __init__(
        self, engine: Engine, fingerprint: str, config: ResolvedConfig, *, tp: TPGroup = SINGLE, engine_config: object = None
    ):
        config.check_engine(engine.spec)
        if tp.world_size != config.tensor_parallel:
            raise InvalidRequestError(
                f"the hcache config was resolved for tensor parallelism {config.tensor_parallel}, not {tp.world_size}"
            )
        settings = config.settings
        self.config, self.engine, self.spec, self.tp = config, engine, engine.spec, tp
        self.fingerprint = tp.fingerprint(fingerprint)
        self._config = engine_config  # the name MII reads
        self.profile, self.plan, self.save_formats = config.profile, config.plan, list(config.save_formats)
        self.namespace = settings.namespace
        self.request_log = Path(settings.request_log) if settings.request_log is not None else None
        self.store = self.saver = self._capture = self.copier = None
        if config.stored:
            self.copier = Copier(engine.device)
            tensors = stored_tensors(self.spec, self.save_formats, config.encodings)
            config.store.check(ChunkLayout.plan(tensors, self.fingerprint).nbytes)
            self.store = config.store.open_store(
                config.store_dirs(tp.rank),
                {"fingerprint": self.fingerprint, "dtype": self.spec.dtype},
                pin=engine.device.type == "cuda",
                readers=settings.readers,
            )
            self.saver = ChunkSaver(self.store, self.fingerprint, tensors, stores=lambda c, f: tp.stores(c, base_format(f)))
            if any(self.save_formats):
                self._capture = _SaveCapture(self.saver, self.save_formats, config.encodings)
        self.prefetcher = Prefetcher(self.store) if self.store is not None else None
        drop = self.saver.drop_partial if self.saver is not None else (lambda partial: None)
        self.gpu_cache = GpuPrefixCache(engine, drop) if settings.gpu_cache else None
        self.metrics = ServingMetrics(self.store, self.prefetcher, self.gpu_cache)
        self._seqs: dict[int, _Sequence] = {}
        self._announced: dict[int, int] = {}  # uid -> tokens queried before its first put

    def resolve_plan(self, plan: str | RestorePlan | None) -> RestorePlan | None:
        """A request's plan: a fixed plan, or None for the profile's plan per history length."""
        return self.config.request_plan(plan)

    def plan_for(self, plan: RestorePlan | None, history: int) -> RestorePlan:
        return self.config.plan_for(plan, history)

    # ---- FastGen's interface --------------------------------------------------------------------------
    def open(
        self, uid: int, *, plan: str | RestorePlan | None = None, restore: bool = True, namespace: str | None = None
    ) -> None:
        """Set a new sequence's options before its first ``put`` (a ``put`` of an unknown uid opens it with
        the engine's): ``plan`` overrides the engine's, ``restore=False`` ignores stored state."""
        if uid in self._seqs:
            raise InvalidRequestError(f"sequence {uid} is already open; flush it first")
        root = root_key(self.fingerprint, namespace if namespace is not None else self.namespace)
        resolved = self.plan if plan is None else self.resolve_plan(plan)
        chain = KeyChain(root)
        self._seqs[uid] = _Sequence(
            resolved, restore and self.store is not None, restore and self.gpu_cache is not None, chain, self._announced.pop(uid, 0)
        )
        if self._capture is not None:
            self.saver.open(uid, chain)

    @torch.no_grad()
    def put(self, batch_uids: Sequence[int], batch_tokens: Sequence[Sequence[int] | torch.Tensor], do_checks: bool = True) -> torch.Tensor:
        """Append tokens to sequences; next-token logits ``[len(batch_uids), vocab]``. The stored prefix of each
        sequence's new tokens is restored first, and only the rest is run (and saved). Capacity is checked
        by the engine's block allocation whatever ``do_checks`` says.

        A put that raises (a full KV cache, say) leaves its sequences unusable until they are flushed: part
        of it may have happened. Their chunks completed by earlier puts are still saved; the chain may have
        taken the failed put's tokens, but their rows never come, so no chunk they touch is published (and a
        forward that raised part-way publishes nothing, see the saver)."""
        batch = []
        for uid, tokens in zip(batch_uids, batch_tokens):
            tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
            if not tokens:
                raise InvalidRequestError(f"sequence {uid}: no tokens to process")
            if uid not in self._seqs:
                self.open(uid)
            elif self._seqs[uid].failed:
                raise InvalidRequestError(f"sequence {uid}: an earlier put failed part-way; flush it and start again")
            batch.append((uid, tokens))
        try:
            return self._put(batch)
        except BaseException:
            for uid, _ in batch:
                self._seqs[uid].failed = True
            raise

    def _put(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        keys = {uid: self._keys(uid, tokens) for uid, tokens in batch}  # hashed once per put
        if len(batch) > 1 and self.prefetcher is not None:  # later sequences' reads run while earlier ones restore
            for uid, tokens in batch:
                if _restores(self._seqs[uid].restore, tokens):
                    self.prefetcher.prefetch(keys[uid])
        adoptions = self._match(batch, keys)
        verbose = log.isEnabledFor(logging.INFO)
        try:
            requests = []
            for (uid, tokens), adoption in zip(batch, adoptions):
                step, held, record = RestoreStep("", 0), len(self._seqs[uid].chain.tail), self._seqs[uid].record
                before = (dict(record.tier_tokens), record.fallback) if verbose else None
                n = self._adopt(uid, tokens, adoption, step) if adoption is not None else 0
                n += self._restore(uid, tokens[n:], step, keys[uid][(held + n) // CHUNK_TOKENS :])
                if n:
                    record.restores.append(step)
                    if verbose:
                        _log_restore(uid, len(tokens), n, step, record, *before)
                requests.append((uid, tokens[n:]))
        finally:
            for adoption in adoptions:
                if adoption is not None:
                    self.gpu_cache.unpin(adoption)
        for uid, tokens in requests:  # before the forward: the saver keys the chunks it completes
            self._seqs[uid].chain.extend(tokens)
        logits = self.engine.step(requests, self._capture)
        for uid, tokens in requests:
            self._seqs[uid].record.computed_tokens += len(tokens)
        return logits

    def _keys(self, uid: int, tokens: list[int]) -> list[str]:
        """The keys of the full chunks that a put of ``tokens`` reaches, from the chunk the sequence ends in;
        none for a put that cannot restore (a decode step: no hashing on the decode path)."""
        seq = self._seqs[uid]
        if not _restores(seq.restore or seq.adopt, tokens):
            return []
        return chunk_keys(seq.chain.tail + tokens, seq.chain.key)

    def _match(self, batch: list[tuple[int, list[int]]], keys: dict[int, list[str]]) -> list[Adoption | None]:
        """What each sequence adopts from the GPU prefix cache (pinned), after evicting enough of the rest for
        the batch's new tokens; if pinned entries stand in the way, the batch adopts nothing (and restores)."""
        if self.gpu_cache is None:
            return [None] * len(batch)
        adoptions = []
        for uid, tokens in batch:
            seq = self._seqs[uid]
            aligned = seq.chain.tail + tokens
            found = None
            if _restores(seq.adopt, tokens):
                found = self.gpu_cache.match(aligned, keys[uid], seq.chain.key, len(seq.chain.tail), len(aligned) - 1)
            adoptions.append(found)
        needed = sum(self.engine.query(uid, len(tokens), 1 << 30)[1] for uid, tokens in batch)
        if not self.gpu_cache.make_room(needed):
            for adoption in adoptions:
                if adoption is not None:
                    self.gpu_cache.truncate(adoption, 0)
            self.gpu_cache.make_room(needed)  # if it still fails, the engine says the cache is full
        return adoptions

    def _adopt(self, uid: int, tokens: list[int], adoption: Adoption, step: RestoreStep) -> int:
        """Copy what the GPU prefix cache holds of ``tokens`` into the sequence; how many tokens that is."""
        n = self.tp.min(adoption.tokens)  # every rank adopts alike
        if n < adoption.tokens:
            self.gpu_cache.truncate(adoption, n)
        if not n:
            return 0
        seq, start = self._seqs[uid], time.perf_counter()
        self.gpu_cache.adopt(uid, adoption, tokens[:n])
        partial = self.gpu_cache.take_partial(adoption) if self._capture is not None else None
        if partial is not None:  # the chunk it ends in is still saved, from its rows computed before
            self.saver.resume(uid, *partial)
        seq.chain.extend(tokens[:n])
        record = seq.record
        record.restored_tokens += n
        record.gpu_tokens += n
        record.lossy = record.lossy or adoption.lossy
        record.restore_s += time.perf_counter() - start
        step.gpu_tokens = n
        self.metrics.restored_tokens["gpu_cache"] += n
        self.metrics.bytes_read["gpu"] += n * self.spec.num_layers * self.spec.kv_bytes_per_token_layer
        return n

    def _restore(self, uid: int, tokens: list[int], step: RestoreStep, keys: list[str]) -> int:
        """Restore what the store holds of ``tokens``, all but the last (its logits are the answer); how many
        were restored. Chunks are keyed by whole 64-token blocks, so the lookup starts at the chunk the
        sequence ends in, whose first tokens it holds already: ``keys`` are those chunks' keys."""
        seq = self._seqs[uid]
        if not _restores(seq.restore, tokens):
            return 0
        held = seq.chain.tail
        aligned = held + tokens
        if not keys:
            return 0
        start = time.perf_counter()
        if seq.plan is None:  # auto, at the first restore (a fixed plan spares the lookups)
            history = self._history(uid, seq, keys)
            if not history:
                return 0
            seq.plan = self.plan_for(None, history)
        plan = seq.plan
        hidden = self.prefetcher.hidden(keys)
        outcome = restore_prefix(
            self.engine, self.store, uid, aligned, keys, self.fingerprint, plan, self.copier, self.tp,
            held=len(held), limit=len(aligned) - 1,
        )  # fmt: skip
        record = seq.record
        record.restored_tokens += outcome.tokens
        record.tier_tokens = dict(Counter(record.tier_tokens) + Counter(outcome.sources))
        record.bytes_read += outcome.bytes_read
        record.restore_s += time.perf_counter() - start
        record.prefetch_hidden_s += hidden
        record.plan = str(plan)
        record.fallback = outcome.fallback or record.fallback
        record.lossy = record.lossy or outcome.lossy
        step.plan, step.tokens, step.hidden_s = record.plan, outcome.tokens, hidden
        metrics = self.metrics
        metrics.restored_tokens.update(outcome.sources)
        metrics.bytes_read["host"] += outcome.bytes_read
        metrics.prefetch_hidden_s += hidden
        metrics.fallbacks += outcome.fallback is not None
        for m in plan.layers:
            metrics.restored_layer_tokens[m.value] += outcome.tokens
        seq.chain.extend(tokens[: outcome.tokens])
        return outcome.tokens

    def _history(self, uid: int, seq: _Sequence, keys: list[str]) -> int:
        """The restored history the auto plan is chosen for (the module doc gives the rule): the tokens
        covered by the leading chunks of ``keys`` present in the store, or, when all are and the prompt's
        announced length goes further, up to that prompt's last full chunk."""
        n = self.tp.min(self.store.stored_prefix(keys))  # every rank must pick the same plan
        if n < len(keys):
            return n * CHUNK_TOKENS
        first = self.engine.seen_tokens(uid) // CHUNK_TOKENS  # the chunk ``keys`` start at
        return max(n, seq.prompt_tokens // CHUNK_TOKENS - first) * CHUNK_TOKENS

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int) -> tuple[int, int]:
        """FastGen's capacity query. Asked of a sequence not yet put, it also announces the prompt's length,
        which the auto plan uses when the prompt then arrives in pieces."""
        if uid not in self._seqs:
            self._announced[uid] = max(self._announced.get(uid, 0), max_request_tokens)
        return self.engine.query(uid, max_request_tokens, max_request_blocks)

    def prefetch(self, tokens: Sequence[int], namespace: str | None = None) -> int:
        """Look-ahead: start reading into the host pool the stored chunks of a prompt that waits to run
        (those after what the GPU prefix cache holds of it); how many loads started."""
        if self.prefetcher is None:
            return 0
        root = root_key(self.fingerprint, namespace if namespace is not None else self.namespace)
        keys = chunk_keys(list(tokens), root)
        cached = 0
        while self.gpu_cache is not None and cached < len(keys) and keys[cached] in self.gpu_cache:
            cached += 1
        return self.prefetcher.prefetch(keys[cached:])

    @property
    def free_blocks(self) -> torch.Tensor:
        """Free blocks, counting those the GPU prefix cache could give up (each put evicts what it needs)."""
        if self.gpu_cache is None:
            return self.engine.free_blocks
        return torch.as_tensor(self.engine.free_blocks) + self.gpu_cache.evictable_blocks

    def get_remaining_block_capacity(self, uid: int) -> int:
        return self.engine.get_remaining_block_capacity(uid)

    def is_open(self, uid: int) -> bool:
        """Whether ``uid`` has been opened (or put) and not flushed since."""
        return uid in self._seqs

    def record(self, uid: int) -> SequenceRecord:
        """What an open sequence has cost so far."""
        return self._seqs[uid].record

    def flush(self, uid: int) -> None:
        """Finish a sequence: wait until its full chunks are stored (so a returning conversation finds them),
        then hand its KV blocks to the GPU prefix cache, if there is one, or free them."""
        seq = self._seqs.pop(uid, None)
        self._announced.pop(uid, None)
        keep = self.gpu_cache is not None and seq is not None and not seq.failed
        try:
            partial = self.saver.close(uid, keep_partial=keep) if self.saver is not None else None
            if keep:
                seen = self.engine.seen_tokens(uid)
                self.gpu_cache.keep(self.engine.detach(uid), seq.chain, seen, partial, lossy=seq.record.lossy)
        finally:  # a save that failed must not keep the sequence's KV blocks
            self.engine.flush(uid)  # nothing left to free once detached
        self.metrics.sequences += seq is not None
        if seq is not None and self.request_log is not None and self.tp.rank == 0:  # ranks restore alike
            # 0600 whatever the umask, as the store's files: it holds token counts per conversation
            with os.fdopen(os.open(self.request_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
                f.write(json.dumps({"uid": uid, "time": time.time(), **asdict(seq.record)}) + "\n")

    def close(self) -> None:
        """Drain the saver, write every saved chunk back to disk and stop the store's threads; the engine
        serves no more requests."""
        if self.saver is not None:
            self.saver.shutdown()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> "ServingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

