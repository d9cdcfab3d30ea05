"""The scheduler's side of hcache's vLLM connector: how much of a prompt is stored, and what the worker
loads and saves each step. It imports neither torch nor vLLM nor hcache's data plane (the loader, the paged
layout, the store stack): vLLM splits its own offloading the same way (``OffloadingSpec.get_manager()`` for
the scheduler, ``get_handlers()`` for the worker).

vLLM asks once per new request how many tokens past its own prefix cache's the connector can load. hcache
keys the prompt's full 64-token chunks as every entry point does (rooted in the model's fingerprint and the
request's ``cache_salt``; with tensor parallelism, each rank's keys, rooted in its own fingerprint) and
finds how many can be loaded from the first (:class:`~hcache.vllm.index.StoredIndex`, which the workers
keep told of what their tiers hold). The stored prefix then goes through a lifecycle, as in vLLM's
``OffloadingManager`` (``lookup``, ``prepare_load``, ``complete_load``), so that what is offered cannot be
evicted before it is loaded:

- **lookup**: the index says how much is stored. Nothing past vLLM's own hit: nothing to offer, and no
  round trip.
- **prepare_load**: the workers, which own the tiers and make every eviction, are asked to hold that prefix
  (:class:`~hcache.vllm.messages.PinRequest`), and vLLM is told to ask again (``None``): the request waits
  a step while vLLM steps the others. Each worker holds what its tiers have of it
  (:class:`~hcache.storage.pins.PinnedPrefix`) and answers how much that is.
- **offer**: asked again, the scheduler offers what every rank holds, past vLLM's hit, to be loaded
  asynchronously: vLLM allocates its blocks and holds the request back while the worker loads them
  (:class:`~hcache.paged.load_job.LoadJob`).
- **complete_load**: the worker lets the prefix go when the load is over, loaded or not; the scheduler tells
  it to (``unpins``) where no load follows (the request ended, or vLLM took none of it).

A small load skips the lifecycle (``load_in_step_tokens``; one KV cache group, one rank): its prefix is offered at
once, held by no one, and loaded in the step that computes the request, which waits for it (vLLM's
synchronous load), so the request costs no engine step of its own. Two steps of the lifecycle would cost
more than the load; a chunk that went meanwhile falls short, and vLLM recomputes its blocks in the
request's next step.

The last prompt token is never offered (:func:`~hcache.restore.restorable.restorable`). Stored-prefix
tokens not offered are told to the worker with their reason, for the request's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..paged.load_job import LoadJob
from ..restore.records import MissReason
from ..restore.restorable import restorable
from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from .events import BlockEvents, Event, HashBlock, Roots
from .index import StoredIndex
from .messages import Pinned, PinRequest, RequestStep, SchedulerStep

if TYPE_CHECKING:  # resolved in the connector, which imports vLLM and torch
    from .settings import VllmSetup


@dataclass
class _Tracked:
    request: object  # vllm.v1.request.Request
    computed: int  # vLLM's own prefix-cache hit when the store was asked
    block_ids: list[list[int]] = field(default_factory=list)  # in each KV cache group
    sent: int = 0  # token ids the worker has
    misses: dict[MissReason, int] = field(default_factory=dict)  # to send with the request's first step
    failed: bool = False  # its load fell short: a later look-up is vLLM's retry, which recomputes
    usable: int = 0  # prompt tokens a load may cover: whole chunks, the last token left out
    pinning: int = 0  # chunks the workers were asked to hold for its load (0: none held for it)
    why: MissReason | None = None  # why the stored prefix found ends where it does
    answers: dict[int, Pinned] = field(default_factory=dict)  # by rank: how much each holds
    in_step: bool = False  # its offer loads in the step that computes it (nothing held for it)
    restart: bool = False  # that load fell short: vLLM recomputes from there, the worker's sequence starts again


class SchedulerSide:
    """``hash_block`` and ``hash_block_size``: vLLM's, for the KV cache events told (with ``setup.events``)."""

    def __init__(self, setup: VllmSetup, hash_block: HashBlock | None = None, hash_block_size: int = 0):
        self.setup = setup
        self._fingerprints = setup.rank_fingerprints  # each rank's keys are rooted in its own
        self._roots = Roots(self._fingerprints, setup.config.settings.namespace)  # where events place chains
        self.events = (
            BlockEvents(hash_block, hash_block_size, len(self._fingerprints), self._roots, setup.event_groups)
            if hash_block is not None and setup.events
            else None
        )
        self.index = StoredIndex(setup.store_lookup()) if setup.config.stored else None
        self._states = setup.states  # where a recurrent layer's state may be stored (None: the model has none)
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []  # to send with this step's metadata
        self._pins: list[PinRequest] = []
        self._unpins: list[str] = []
        # vLLM takes an in-step load's failure by block, which names no request under several KV cache groups; under
        # tensor parallelism, a rank whose load fell short could not keep the others from saving what followed
        one = len(setup.block_sizes) == 1 and len(self._fingerprints) == 1
        self._in_step_tokens = setup.config.settings.load_in_step_tokens if one else 0

    def loads_in_step(self, request) -> bool:
        """Whether the offer :meth:`matched_tokens` made ``request`` loads in the step that computes it."""
        tracked = self._requests.get(request.request_id)
        return tracked is not None and tracked.in_step

    def matched_tokens(self, request, num_computed: int) -> int | None:
        """Tokens past ``num_computed`` (vLLM's own prefix-cache hit) that can be loaded; None while the
        workers have not yet answered how much of the stored prefix they hold."""
        previous = self._requests.get(request.request_id)
        if previous is not None and previous.pinning:
            return self._offer(previous, num_computed) if len(previous.answers) == len(self._fingerprints) else None
        retry = previous is not None and previous.failed
        tracked = self._requests[request.request_id] = _Tracked(request, num_computed, failed=retry)
        salt = getattr(request, "cache_salt", None)
        if salt and self.events is not None:  # its chunks' chains are rooted in it: events can place them
            self._roots.salted(salt)
        if (
            self.index is None or retry
        ):  # a load of it fell short: vLLM recomputes what it lacks, nothing is offered twice
            return 0
        prompt = list(request.prompt_token_ids or [])
        tracked.usable = restorable(len(prompt)) // CHUNK_TOKENS * CHUNK_TOKENS
        if tracked.usable <= num_computed:
            return 0
        namespace = self.namespace(request)
        stored, why = min(
            (
                self.index.stored_prefix(chunk_keys(prompt[: tracked.usable], root_key(fingerprint, namespace)))
                for fingerprint in self._fingerprints
            ),
            key=lambda found: found[0],
        )  # a prefix every rank holds
        if self._states is not None:
            stored, why = self._checkpoint(stored, why)
        tracked.why = why
        if stored * CHUNK_TOKENS <= num_computed:  # nothing past vLLM's own hit: nothing to hold
            return self._offer(tracked, num_computed, stored)
        if stored * CHUNK_TOKENS - num_computed <= self._in_step_tokens:  # loaded at once: nothing to hold
            tracked.in_step = True
            return self._offer(tracked, num_computed, stored)
        tracked.pinning = stored
        self._pins.append(PinRequest(request.request_id, namespace, prompt[: stored * CHUNK_TOKENS]))
        return None

    def _offer(self, tracked: _Tracked, num_computed: int, stored: int | None = None) -> int:
        """The tokens past ``num_computed`` of the prefix ``stored`` (by default, what every rank holds of what
        they were asked to), its misses noted; a held prefix with nothing to offer is let go."""
        why = tracked.why
        if stored is None:
            short = min(tracked.answers.values(), key=lambda answer: answer.chunks)
            stored, why = (short.chunks, short.why) if short.chunks < tracked.pinning else (tracked.pinning, why)
            if self._states is not None:
                stored, why = self._checkpoint(stored, why)
        tracked.computed = num_computed
        end = stored * CHUNK_TOKENS
        if why is not None:
            tracked.misses = {why: tracked.usable - max(end, num_computed)}
        offered = max(0, end - num_computed)
        if not offered:
            self._let_go(tracked)
        return offered

    def _checkpoint(self, stored: int, why: MissReason | None) -> tuple[int, MissReason | None]:
        """Of ``stored`` chunks, the most that end where the checkpoint rule may have stored the recurrent
        layers' state, and why the prefix ends there. Whether the chunk holds
        it is the load's to verify: one that does not is no hit, and is recomputed."""
        spec = self._states.spec
        usable = self._states.usable(
            range(spec.num_layers),
            0,
            stored,
            lambda m: m * CHUNK_TOKENS,
            lambda j, layer: self._states.saves(j, (j + 1) * CHUNK_TOKENS),  # a chunk a step ended on
        )
        return (usable, MissReason.NO_STATE) if usable < stored else (stored, why)

    def _let_go(self, tracked: _Tracked) -> None:
        """No load follows: the workers let its held prefix go."""
        if tracked.pinning:
            self._unpins.append(tracked.request.request_id)
            tracked.pinning, tracked.answers = 0, {}

    def take_events(self) -> list[Event]:
        return self.events.take() if self.events is not None else []

    def namespace(self, request) -> str | None:
        """A request's namespace: its ``cache_salt``, else the deployment's."""
        return getattr(request, "cache_salt", None) or self.setup.config.settings.namespace

    def after_alloc(self, request, blocks, num_external: int) -> None:
        """The blocks for an offered load are allocated: the load goes to the worker with this step, and the
        held prefix with it (the worker lets it go when the load is over). vLLM may take none of the offer."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or not (tracked.pinning or tracked.in_step):
            return
        if not num_external:
            self._let_go(tracked)
            return
        end = tracked.computed + num_external
        self._loads.append(
            LoadJob(
                request.request_id,
                self.namespace(request),
                list(request.prompt_token_ids[:end]),
                [list(g) for g in blocks.get_block_ids()],
                tracked.computed,
                end,
                tracked.in_step,
            )
        )
        tracked.pinning, tracked.answers = 0, {}

    def build(self, scheduler_output) -> SchedulerStep:
        step = SchedulerStep(loads=self._loads, pins=self._pins, unpins=self._unpins)
        self._loads, self._pins, self._unpins = [], [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                step.requests.append(
                    self._step(
                        new.req_id, tracked, [list(g) for g in new.block_ids], True, new.num_computed_tokens, scheduled
                    )
                )
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
            step.requests.append(
                self._step(
                    req_id,
                    tracked,
                    added if resumed else tracked.block_ids,
                    resumed,
                    cached.num_computed_tokens[i],
                    scheduled,
                )
            )
        return step

    def _step(
        self,
        req_id: str,
        tracked: _Tracked,
        block_ids: list[list[int]],
        new: bool,
        computed: int,
        scheduled: dict[str, int],
    ) -> RequestStep:
        """``computed``: the request's tokens held before this step, loaded ones included."""
        length = scheduled.get(req_id, 0)
        new, tracked.restart = new or tracked.restart, False
        if new:
            tracked.sent = 0
        tracked.block_ids = block_ids
        tokens = list(tracked.request.all_token_ids[tracked.sent : computed + length])
        held = [
            ids[computed // size : -(-(computed + length) // size)]
            for ids, size in zip(block_ids, self.setup.block_sizes)
        ]
        step = RequestStep(req_id, self.namespace(tracked.request), new, tokens, held, computed, length, tracked.misses)
        tracked.sent += len(tokens)
        tracked.misses = {}
        return step

    def worker_output(self, report) -> None:
        """A step's :class:`~hcache.vllm.messages.WorkerReport` (None: nothing to say): what the workers' tiers
        gained and lost, into the index; loads that fell short, noted; how much of each prefix asked for each
        rank holds."""
        if report is None:
            return
        if self.index is not None:
            self.index.apply(report.changes)
        if self.events is not None:
            self.events.apply(report.residency)
        for req_id in report.failed:
            if req_id in self._requests:
                tracked = self._requests[req_id]
                tracked.failed, tracked.restart = True, tracked.in_step
        for answer in report.pinned:
            tracked = self._requests.get(answer.req_id)
            if tracked is not None and tracked.pinning:
                tracked.answers[answer.rank] = answer

    def finished(self, request) -> None:
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None:
            self._let_go(tracked)

    def close(self) -> None:
        if self.index is not None:
            self.index.close()
