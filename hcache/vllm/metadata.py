"""What hcache's two sides of a vLLM engine tell each other each step: plain values, so they cross between
the scheduler's process and the workers' as vLLM sends them."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ..paged.loader import LoadJob


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
    misses: dict[str, int] = field(default_factory=dict)


@dataclass
class HCacheStepMetadata(KVConnectorMetadata):
    """``loads``: requests whose stored prefix the worker loads off the step, while vLLM holds them back."""

    requests: list[RequestStep] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)


@dataclass
class HCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker tells the scheduler after a step. ``changes``: what its tiers gained and lost since
    its last step, in order: (chunk key, None) for a chunk
    held, (chunk key, the :class:`~hcache.restore.records.MissReason`) for one discarded as bad or found
    gone by a load. The scheduler's index of what can be loaded follows it
    (:class:`~hcache.vllm.index.StoredIndex`)."""

    changes: list[tuple[str, str | None]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # requests whose load fell short: vLLM recomputes the rest

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        assert isinstance(other, HCacheWorkerMetadata)
        return HCacheWorkerMetadata(self.changes + other.changes, self.failed + other.failed)
