"""What hcache's two sides of a vLLM engine tell each other each step: plain values, free of torch and of
vLLM, so that the scheduler's side imports neither; :mod:`hcache.vllm.metadata` gives them vLLM's types,
under which they cross between the scheduler's process and the workers'."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..paged.load_job import LoadJob
from ..restore.records import MissReason
from ..storage.residency import Residency


@dataclass
class RequestStep:
    """One request in one step. ``tokens`` continue the request's token ids from where the worker's copy
    ends (all of them when ``new``: a new request, or one resumed after preemption, whose KV starts again).
    Positions ``[start, start + length)`` are computed by the forward, and saved. ``block_ids``: the KV
    blocks that hold them, in order, in each KV cache group, from the block holding ``start`` (the step's,
    not the request's: a decode step sends one a group, whatever the history). ``misses``: on a request's
    first step, the stored-prefix tokens the scheduler did not offer, by :class:`~hcache.restore.records.MissReason`."""

    req_id: str
    namespace: str | None
    new: bool
    tokens: list[int]
    block_ids: list[list[int]]
    start: int
    length: int
    misses: dict[MissReason, int] = field(default_factory=dict)


@dataclass
class PinRequest:
    """A request's stored prefix, which the scheduler found and means to offer: each worker holds what its
    tiers have of it (``tokens``, full chunks, keyed in ``namespace`` from each rank's own root) until its
    load is over, and answers how much that is (:class:`Pinned`)."""

    req_id: str
    namespace: str | None
    tokens: list[int]


@dataclass
class Pinned:
    """A worker's answer to a :class:`PinRequest`: the chunks its rank holds, from the first, and why they
    end short of those asked (a :class:`~hcache.restore.records.MissReason`'s value; None: all held)."""

    req_id: str
    rank: int
    chunks: int
    why: MissReason | None


@dataclass
class SchedulerStep:
    """``loads``: requests whose stored prefix the worker loads, off the step while vLLM holds them back, or
    in it (:attr:`~hcache.paged.load_job.LoadJob.in_step`); ``pins``: prefixes to hold for loads to come;
    ``unpins``: requests whose held prefix will not be loaded."""

    requests: list[RequestStep] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    pins: list[PinRequest] = field(default_factory=list)
    unpins: list[str] = field(default_factory=list)


@dataclass
class WorkerReport:
    """What a worker tells the scheduler after a step. ``changes``: what its tiers gained and lost since its
    last step, in order: (chunk key, None) for a chunk held, (chunk key, the
    :class:`~hcache.restore.records.MissReason`) for one discarded as bad or found gone. The scheduler's
    index of what can be loaded follows it (:class:`~hcache.vllm.index.StoredIndex`). ``failed``: requests
    whose load fell short (vLLM recomputes the rest); ``pinned``: its answers to the step's pin requests;
    ``residency``: where its chunks are held, as it changed (with KV cache events on, :mod:`hcache.vllm.events`)."""

    changes: list[tuple[str, MissReason | None]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    pinned: list[Pinned] = field(default_factory=list)
    residency: list[Residency] = field(default_factory=list)

    def joined(self, other: WorkerReport) -> dict:
        """Every rank's report of one step as one, by field, for vLLM's ``aggregate``."""
        return {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(WorkerReport)}
