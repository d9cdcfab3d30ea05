"""hcache's messages between the two sides of a vLLM engine (:mod:`hcache.vllm.messages`) under vLLM's types,
as vLLM sends them: this module imports vLLM, and so torch; the scheduler's side does not."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .messages import SchedulerStep, WorkerReport


@dataclass
class HCacheStepMetadata(SchedulerStep, KVConnectorMetadata):
    """A :class:`~hcache.vllm.messages.SchedulerStep`, for the workers."""


@dataclass
class HCacheWorkerMetadata(WorkerReport, KVConnectorWorkerMetadata):
    """A :class:`~hcache.vllm.messages.WorkerReport`, for the scheduler."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HCacheWorkerMetadata)
        return HCacheWorkerMetadata(**self.joined(other))
