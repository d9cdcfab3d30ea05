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

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.interface import Engine
from ..errors import InvalidRequestError
from ..planning.plan import RestorePlan
from ..storage.chunk_key import CHUNK_TOKENS, check_namespace, chunk_keys, root_key
from .gpu_prefix_cache import Adoption
from .metrics import ServingMetrics
from ..restore.miss_reasons import first_chunk_miss, lookup_miss
from ..restore.records import GPU_CACHE, PutRestore, SequenceRecord, log_requests
from .restore import restore_prefix
from ..restore.session import Session
from .store_stack import StoreStack
from ..restore.restorable import restorable

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Sequence(Session):
    """Its chain covers the tokens the engine holds, and those of a put in progress."""

    plan: RestorePlan | None  # None: auto, until the first restore chooses it
    restore: bool  # from the store
    adopt: bool  # from the GPU prefix cache (there may be one without a store)
    prompt_tokens: int = 0  # the prompt's length if announced before the first put (see the module doc)
    failed: bool = False  # a put raised part-way: the engine, the chain and the saver may disagree
    windowed: bool = (
        False  # a restore wrote sliding-window layers from their window on: its blocks are not every prefix's state
    )


def _log_restore(uid: int, tokens: int, step: PutRestore) -> None:
    """One line per put that restored: the plan, the tokens restored of the put's and where they were read
    from, and why stored state stopped short, if it did (``-v``; logged only when INFO is on)."""
    restored = step.gpu_tokens + step.tokens
    where = ", ".join(f"{name} {n}" for name, n in {GPU_CACHE: step.gpu_tokens, **step.sources}.items() if n)
    fallback = f"; fell back to recompute: {step.fallback}" if step.fallback else ""
    missed = "".join(f"; {n} stored-prefix tokens missed: {reason}" for reason, n in step.misses.items())
    log.info(
        "sequence %d: restored %d of %d tokens (%s; plan %s), computing %d%s%s",
        uid,
        restored,
        tokens,
        where,
        step.plan or "none",
        tokens - restored,
        fallback,
        missed,
    )


def _restores(allowed: bool, tokens: list[int]) -> bool:
    """Whether a put of ``tokens`` may restore (from the store, or from the GPU prefix cache), if ``allowed``:
    a one-token put (a decode step) never does."""
    return allowed and restorable(len(tokens)) > 0


class ServingEngine:
    """An :class:`~hcache.engine.interface.Engine` served through FastGen's interface over a
    :class:`~hcache.serving.store_stack.StoreStack` built for it (whose config, resolved for this engine's
    model, is documented on :class:`~hcache.config.HCacheConfig`). With the store disabled, nothing is
    restored or saved: the recompute baseline. ``engine_config``: the engine config MII schedules by (it
    reads ``_config.state_manager``).

    With tensor parallelism, every rank runs one of these over its shard of the engine and its own stack,
    and makes the same calls at once: the forward and restore are collective. Each rank stores and reads
    only what it owns (:mod:`hcache.model.tensor_parallel`).
    """

    def __init__(self, engine: Engine, stack: StoreStack, *, engine_config: object = None):
        config, tp = stack.config, stack.tp
        if tp.world_size != config.tensor_parallel:
            raise InvalidRequestError(
                f"the hcache config was resolved for tensor parallelism {config.tensor_parallel}, not {tp.world_size}"
            )
        self.config, self.engine, self.spec, self.tp, self.stack = config, engine, engine.spec, tp, stack
        self.fingerprint = stack.fingerprint
        self._config = engine_config  # the name MII reads
        self.namespace = config.settings.namespace
        self.request_log = Path(config.settings.request_log) if config.settings.request_log is not None else None
        self.metrics = ServingMetrics(stack.store, stack.prefetcher, stack.gpu_cache)
        self.kv_events = None  # the tiers' KV cache events' publisher, set by MII's model server (kv_events)
        self._seqs: dict[int, _Sequence] = {}
        self._announced: dict[int, int] = {}  # uid -> tokens queried before its first put

    # ---- FastGen's interface --------------------------------------------------------------------------
    def open(
        self, uid: int, *, plan: str | RestorePlan | None = None, restore: bool = True, namespace: str | None = None
    ) -> None:
        """Set a new sequence's options before its first ``put`` (a ``put`` of an unknown uid opens it with
        the engine's): ``plan`` overrides the engine's, ``restore=False`` ignores stored state."""
        if uid in self._seqs:
            raise InvalidRequestError(f"sequence {uid} is already open; flush it first")
        namespace = self._namespace(namespace)
        resolved = self.config.policy.request_plan(plan)
        stack = self.stack
        self._seqs[uid] = _Sequence.open(
            stack,
            uid,
            namespace,
            plan=resolved,
            restore=restore and stack.store is not None,
            adopt=restore and stack.gpu_cache is not None,
            prompt_tokens=self._announced.pop(uid, 0),
        )

    def _namespace(self, namespace: object) -> str | None:
        """A request's namespace, checked (a non-empty string: "" is refused, not read as none); None: the
        deployment's (``settings.namespace``; None there too: the chunks every request without one shares).
        A request's own is its ``cache_salt``, under which the KV cache events announce its chunks."""
        if namespace is None:
            return self.namespace
        namespace = check_namespace(namespace, "namespace")
        if self.kv_events is not None:
            self.kv_events.salted(namespace)
        return namespace

    @torch.no_grad()
    def put(
        self, batch_uids: Sequence[int], batch_tokens: Sequence[Sequence[int] | torch.Tensor], do_checks: bool = True
    ) -> torch.Tensor:
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
        began = time.perf_counter()
        try:
            return self._put(batch)
        except BaseException:
            for uid, _ in batch:
                self._seqs[uid].failed = True
            raise
        finally:
            self.metrics.stepped(time.perf_counter() - began, sum(len(tokens) == 1 for _, tokens in batch))

    def _put(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        keys = {uid: self._keys(uid, tokens) for uid, tokens in batch}  # hashed once per put
        if (
            len(batch) > 1 and self.stack.prefetcher is not None
        ):  # later sequences' reads run while earlier ones restore
            for uid, tokens in batch:
                if _restores(self._seqs[uid].restore, tokens):
                    self.stack.prefetcher.prefetch(keys[uid])
        adoptions = self._match(batch, keys)
        try:
            requests = []
            for (uid, tokens), adoption in zip(batch, adoptions):
                step, held = PutRestore(), len(self._seqs[uid].chain.tail)
                n = self._adopt(uid, tokens, adoption, step) if adoption is not None else 0
                n += self._restore(uid, tokens[n:], step, keys[uid][(held + n) // CHUNK_TOKENS :])
                if n or step.plan or step.misses:  # adopted, or the store was tried
                    self._seqs[uid].record.add(step)
                    self.metrics.add(step)
                if (n or step.misses) and log.isEnabledFor(logging.INFO):
                    _log_restore(uid, len(tokens), step)
                requests.append((uid, tokens[n:]))
        finally:
            for adoption in adoptions:
                if adoption is not None:
                    self.stack.gpu_cache.unpin(adoption)
        for uid, tokens in requests:  # before the forward: the saver keys the chunks it completes
            self._seqs[uid].chain.extend(tokens)
        logits = self.engine.step(requests, self.stack.capture)
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
        if self.stack.gpu_cache is None:
            return [None] * len(batch)
        adoptions = []
        for uid, tokens in batch:
            seq = self._seqs[uid]
            aligned = seq.chain.tail + tokens
            found = None
            if _restores(seq.adopt, tokens):
                found = self.stack.gpu_cache.match(
                    aligned, keys[uid], seq.chain.key, len(seq.chain.tail), restorable(len(aligned))
                )
            adoptions.append(found)
        needed = sum(self.engine.query(uid, len(tokens), 1 << 30)[1] for uid, tokens in batch)
        if not self.stack.gpu_cache.make_room(needed):
            for adoption in adoptions:
                if adoption is not None:
                    self.stack.gpu_cache.truncate(adoption, 0)
            self.stack.gpu_cache.make_room(needed)  # if it still fails, the engine says the cache is full
        return adoptions

    def _adopt(self, uid: int, tokens: list[int], adoption: Adoption, step: PutRestore) -> int:
        """Copy what the GPU prefix cache holds of ``tokens`` into the sequence; how many tokens that is."""
        n = self.tp.min(adoption.tokens)  # every rank adopts alike
        if n < adoption.tokens:
            self.stack.gpu_cache.truncate(adoption, n)
        if not n:
            return 0
        seq, start = self._seqs[uid], time.perf_counter()
        self.stack.gpu_cache.adopt(uid, adoption, tokens[:n])
        partial = self.stack.gpu_cache.take_partial(adoption) if self.stack.capture is not None else None
        if partial is not None:  # the chunk it ends in is still saved, from its rows computed before
            self.stack.saver.resume(uid, *partial)
        seq.chain.extend(tokens[:n])
        step.gpu_tokens, step.gpu_bytes = n, n * self.spec.kv_bytes_per_token
        step.lossy = adoption.lossy
        step.restore_s += time.perf_counter() - start
        return n

    def _restore(self, uid: int, tokens: list[int], step: PutRestore, keys: list[str]) -> int:
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
            if not history:  # nothing stored of it: every full chunk is a miss
                missed = min(len(keys) * CHUNK_TOKENS, restorable(len(aligned))) - len(held)
                step.misses = first_chunk_miss(
                    self.stack.anchors,
                    seq.label,
                    seq.chain,
                    aligned,
                    {lookup_miss(self.stack.store, keys[0]): missed},
                )
                return 0
            seq.plan = self.config.policy.plan_for(None, history)
        plan = seq.plan
        hidden = self.stack.prefetcher.hidden(keys)
        outcome = restore_prefix(
            self.engine,
            self.stack.store,
            uid,
            aligned,
            keys,
            self.fingerprint,
            plan,
            self.stack.copier,
            self.tp,
            held=len(held),
            limit=restorable(len(aligned)),
            window=self.stack.window,
            states=self.stack.states,
        )
        outcome.record(step, plan)
        seq.windowed = seq.windowed or outcome.windowed
        step.hidden_s = hidden
        if not outcome.tokens:
            step.misses = first_chunk_miss(self.stack.anchors, seq.label, seq.chain, aligned, step.misses)
        step.restore_s += time.perf_counter() - start
        seq.chain.extend(tokens[: outcome.tokens])
        return outcome.tokens

    def _history(self, uid: int, seq: _Sequence, keys: list[str]) -> int:
        """The restored history the auto plan is chosen for (the module doc gives the rule): the tokens
        covered by the leading chunks of ``keys`` present in the store, or, when all are and the prompt's
        announced length goes further, up to that prompt's last full chunk."""
        n = self.tp.min(self.stack.store.stored_prefix(keys))  # every rank must pick the same plan
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
        if self.stack.prefetcher is None:
            return 0
        root = root_key(self.fingerprint, self._namespace(namespace))
        keys = chunk_keys(list(tokens), root)
        cached = 0
        while self.stack.gpu_cache is not None and cached < len(keys) and keys[cached] in self.stack.gpu_cache:
            cached += 1
        return self.stack.prefetcher.prefetch(keys[cached:])

    @property
    def free_blocks(self) -> torch.Tensor:
        """Free blocks, counting those the GPU prefix cache could give up (each put evicts what it needs)."""
        if self.stack.gpu_cache is None:
            return self.engine.free_blocks
        return torch.as_tensor(self.engine.free_blocks) + self.stack.gpu_cache.evictable_blocks

    def get_remaining_block_capacity(self, uid: int) -> int:
        return self.engine.get_remaining_block_capacity(uid)

    def is_open(self, uid: int) -> bool:
        """Whether ``uid`` has been opened (or put) and not flushed since."""
        return uid in self._seqs

    def record(self, uid: int) -> SequenceRecord:
        """What an open sequence has cost so far."""
        return self._seqs[uid].record

    def reply(self, uid: int) -> dict | None:
        """What a response tells its client of sequence ``uid``'s restore (:meth:`SequenceRecord.reply`), or
        None if it is not open. Read from a server thread while the loop runs: the restore's counts are
        written by the puts of the prompt, before its first token is out."""
        seq = self._seqs.get(uid)
        return seq.record.reply() if seq is not None else None

    def flush(self, uid: int) -> None:
        """Finish a sequence: wait until its full chunks are stored (so a returning conversation finds them),
        then hand its KV blocks to the GPU prefix cache, if there is one, or free them."""
        seq = self._seqs.pop(uid, None)
        self._announced.pop(uid, None)
        # A shorter prefix of a windowed sequence's blocks would attend to sliding-window rows never written.
        keep = self.stack.gpu_cache is not None and seq is not None and not seq.failed and not seq.windowed
        try:
            partial = seq.close(self.stack, keep_partial=keep, anchored=not seq.failed) if seq is not None else None
            if keep:
                seen = self.engine.seen_tokens(uid)
                self.stack.gpu_cache.keep(self.engine.detach(uid), seq.chain, seen, partial, lossy=seq.record.lossy)
        finally:  # a save that failed must not keep the sequence's KV blocks
            self.engine.flush(uid)  # nothing left to free once detached
        self.metrics.sequences += seq is not None
        if seq is not None and self.request_log is not None and self.tp.rank == 0:  # ranks restore alike
            log_requests(self.request_log, [({"uid": uid}, seq.record)])

    def close(self) -> None:
        """Close the store stack (:meth:`StoreStack.close`), then the KV cache events' publisher, which tells
        the last write-backs; the engine serves no more requests."""
        try:
            self.stack.close()
        finally:
            if self.kv_events is not None:
                self.kv_events.close()

    def __enter__(self) -> "ServingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
