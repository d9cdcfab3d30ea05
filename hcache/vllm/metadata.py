"""What vLLM's scheduler tells its worker each step about hcache's part of it: plain values, so they cross
from the scheduler's process to the worker's as vLLM sends them."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RequestStep:
    """One request in one step. ``tokens`` continue the request's token ids from where the worker's copy
    ends (all of them when ``new``: a new request, or one resumed after preemption, whose KV starts again).
    Positions ``[load_start, load_end)`` are loaded from the store before the forward; ``[start, start +
    length)`` are computed by it, and saved. ``block_ids``: every KV block the request holds, in order."""

    req_id: str
    namespace: str | None
    new: bool
    tokens: list[int]
    block_ids: list[int]
    start: int
    length: int
    load_start: int = 0
    load_end: int = 0


@dataclass
class HCacheStepMetadata(KVConnectorMetadata):
    requests: list[RequestStep] = field(default_factory=list)
