"""The scheduler's side of hcache's vLLM connector: how much of a prompt is stored, and what the worker
loads and saves each step.

vLLM asks once per new request how many tokens past its own prefix cache's the connector can load. hcache
keys the prompt's full 64-token chunks as every entry point does (rooted in the model's fingerprint and the
request's ``cache_salt``; with tensor parallelism, each rank's keys, rooted in its own fingerprint), finds
how many can be loaded from the first (:class:`~hcache.vllm.index.StoredIndex`, which the workers keep
told of what their tiers hold; with tensor parallelism, the fewest any rank holds: each rank loads its own
heads, and vLLM recomputes what any rank lacks), and offers those past what vLLM holds, to be loaded
asynchronously: vLLM holds the request back while the worker loads them (:class:`LoadJob`) and keeps
stepping the others. The last prompt token is never offered (:func:`~hcache.restore.stored_prefix.restorable`). Stored-prefix tokens not offered are told to the worker with their reason, for the
request's record.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model.tensor_parallel import TPGroup
from ..paged.loader import LoadJob
from ..restore.stored_prefix import restorable
from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from .index import StoredIndex
from .metadata import HCacheStepMetadata, HCacheWorkerMetadata, RequestStep
from .settings import VllmSetup


@dataclass
class _Tracked:
    request: object  # vllm.v1.request.Request
    computed: int  # vLLM's own prefix-cache hit when the store was asked
    block_ids: list[list[int]] = field(default_factory=list)  # in each KV cache group
    sent: int = 0  # token ids the worker has
    misses: dict[str, int] = field(default_factory=dict)  # to send with the request's first step
    failed: bool = False  # its load fell short: a later look-up is vLLM's retry, which recomputes


class SchedulerSide:
    def __init__(self, setup: VllmSetup):
        self.setup = setup
        config = setup.config
        ranks = [TPGroup(r, config.tensor_parallel) for r in range(config.tensor_parallel)]
        self._fingerprints = [tp.fingerprint(setup.fingerprint) for tp in ranks]  # each rank's keys are rooted in its own
        dirs = [d for tp in ranks for d in config.store_dirs(tp.rank) or []]
        self.index = StoredIndex(config.settings.store.lookup(dirs or None)) if config.stored else None
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []  # to send with this step's metadata

    def matched_tokens(self, request, num_computed: int) -> int:
        """Tokens past ``num_computed`` (vLLM's own prefix-cache hit) that can be loaded."""
        previous = self._requests.get(request.request_id)
        retry = previous is not None and previous.failed
        tracked = self._requests[request.request_id] = _Tracked(request, num_computed, failed=retry)
        if self.index is None or retry:  # a load of it fell short: vLLM recomputes what it lacks, nothing is offered twice
            return 0
        prompt = list(request.prompt_token_ids or [])
        usable = restorable(len(prompt)) // CHUNK_TOKENS * CHUNK_TOKENS
        if usable <= num_computed:
            return 0
        namespace = self.namespace(request)
        stored, why = min((self.index.stored_prefix(chunk_keys(prompt[:usable], root_key(fingerprint, namespace))) for fingerprint in self._fingerprints),
                          key=lambda found: found[0])  # a prefix every rank holds  # fmt: skip
        end = stored * CHUNK_TOKENS
        if why is not None:
            tracked.misses = {why.value: usable - max(end, num_computed)}
        return max(0, end - num_computed)

    def namespace(self, request) -> str | None:
        """A request's namespace: its ``cache_salt``, else the deployment's."""
        return getattr(request, "cache_salt", None) or self.setup.config.settings.namespace

    def after_alloc(self, request, blocks, num_external: int) -> None:
        """The blocks for an offered load are allocated: the load goes to the worker with this step."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or not num_external:
            return
        end = tracked.computed + num_external
        self._loads.append(LoadJob(
            request.request_id, self.namespace(request), list(request.prompt_token_ids[:end]), [list(g) for g in blocks.get_block_ids()],
            tracked.computed, end,
        ))  # fmt: skip

    def build(self, scheduler_output) -> HCacheStepMetadata:
        metadata = HCacheStepMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                metadata.requests.append(self._step(new.req_id, tracked, [list(g) for g in new.block_ids], True, new.num_computed_tokens, scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            resumed = req_id in cached.resumed_req_ids
            added = [list(g) for g in cached.new_block_ids[i] or ()] or [[] for _ in tracked.block_ids]
            if not resumed:
                for held, more in zip(tracked.block_ids, added):
                    held.extend(more)
            metadata.requests.append(self._step(req_id, tracked, added if resumed else tracked.block_ids, resumed, cached.num_computed_tokens[i], scheduled))
        return metadata

    def _step(self, req_id: str, tracked: _Tracked, block_ids: list[list[int]], new: bool, computed: int, scheduled: dict[str, int]) -> RequestStep:
        """``computed``: the request's tokens held before this step, loaded ones included."""
        length = scheduled.get(req_id, 0)
        if new:
            tracked.sent = 0
        tracked.block_ids = block_ids
        tokens = list(tracked.request.all_token_ids[tracked.sent : computed + length])
        held = [ids[computed // size : -(-(computed + length) // size)] for ids, size in zip(block_ids, self.setup.block_sizes)]
        step = RequestStep(req_id, self.namespace(tracked.request), new, tokens, held, computed, length, tracked.misses)
        tracked.sent += len(tokens)
        tracked.misses = {}
        return step

    def worker_output(self, meta: HCacheWorkerMetadata | None) -> None:
        """What the worker's tiers gained and lost last step, into the index; loads that fell short, noted."""
        if meta is None:
            return
        if self.index is not None:
            self.index.apply(meta.changes)
        for req_id in meta.failed:
            if req_id in self._requests:
                self._requests[req_id].failed = True

    def finished(self, request) -> None:
        self._requests.pop(request.request_id, None)

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
