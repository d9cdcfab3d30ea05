"""The scheduler's side of hcache's vLLM connector: how much of a prompt is stored, and what the worker
loads and saves each step.

vLLM asks once per new request how many tokens past its own prefix cache's the connector can load. hcache
keys the prompt's full 64-token chunks as every entry point does (rooted in the model's fingerprint and the
request's ``cache_salt``), finds how many the store holds from the first (:class:`StoreLookup`: the
scheduler does not own the store, its worker does), and offers those past what vLLM holds. The last prompt
token is never offered: its logits give the first output token, so vLLM must compute it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from .metadata import HCacheStepMetadata, RequestStep
from .settings import VllmSetup


@dataclass
class _Tracked:
    request: object  # vllm.v1.request.Request
    block_ids: list[int] = field(default_factory=list)
    sent: int = 0  # token ids the worker has
    external: int = 0  # tokens to load, once the blocks for them are allocated


class SchedulerSide:
    def __init__(self, setup: VllmSetup):
        self.setup = setup
        settings = setup.config.settings
        self.lookup = settings.store.lookup(setup.config.store_dirs(0)) if setup.config.stored else None
        self._requests: dict[str, _Tracked] = {}

    def matched_tokens(self, request, num_computed: int) -> int:
        """Tokens past ``num_computed`` (vLLM's own prefix-cache hit) that the store holds."""
        self._requests[request.request_id] = _Tracked(request)
        if self.lookup is None:
            return 0
        prompt = list(request.prompt_token_ids or [])
        usable = (len(prompt) - 1) // CHUNK_TOKENS * CHUNK_TOKENS
        if usable <= num_computed:
            return 0
        keys = chunk_keys(prompt[:usable], root_key(self.setup.fingerprint, self.namespace(request)))
        return max(0, self.lookup.stored_prefix(keys) * CHUNK_TOKENS - num_computed)

    def namespace(self, request) -> str | None:
        """A request's namespace: its ``cache_salt``, else the deployment's."""
        return getattr(request, "cache_salt", None) or self.setup.config.settings.namespace

    def after_alloc(self, request, num_external: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            tracked.external = num_external

    def build(self, scheduler_output) -> HCacheStepMetadata:
        metadata = HCacheStepMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                metadata.requests.append(self._step(new.req_id, tracked, list(new.block_ids[0]), True, new.num_computed_tokens, scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            resumed = req_id in cached.resumed_req_ids
            added = cached.new_block_ids[i]
            blocks = list(added[0]) if added is not None else []
            metadata.requests.append(
                self._step(req_id, tracked, blocks if resumed else tracked.block_ids + blocks, resumed, cached.num_computed_tokens[i], scheduled)
            )
        return metadata

    def _step(self, req_id: str, tracked: _Tracked, block_ids: list[int], new: bool, computed: int, scheduled: dict[str, int]) -> RequestStep:
        """``computed``: the request's tokens held before this step, loaded ones included."""
        length = scheduled.get(req_id, 0)
        if new:
            tracked.sent = 0
        tracked.block_ids = block_ids
        tokens = list(tracked.request.all_token_ids[tracked.sent : computed + length])
        loaded, tracked.external = tracked.external, 0
        step = RequestStep(req_id, self.namespace(tracked.request), new, tokens, block_ids, computed, length, computed - loaded, computed)
        tracked.sent += len(tokens)
        return step

    def finished(self, request) -> None:
        self._requests.pop(request.request_id, None)

    def close(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
