"""hcache's KV connector for vLLM (``KVConnectorBase_V1``): returning conversations restored from hcache's
store instead of recomputed.

vLLM builds the connector twice, as its scheduler's and as each worker's, in processes of their own; both
resolve the same settings from vLLM's config (:func:`~hcache.vllm.settings.resolve_setup`), and each role
hands its calls to its side: :class:`~hcache.vllm.scheduler.SchedulerSide` (what is stored, what to load
and save; it imports neither torch nor vLLM, and its messages take vLLM's types here,
:mod:`~hcache.vllm.metadata`) and :class:`~hcache.vllm.worker.WorkerSide` (the store stack, the loads and
saves). Stored
prefixes load asynchronously: vLLM holds a request back (``WAITING_FOR_REMOTE_KVS``) until the worker
reports its load done, and steps the others meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

from .metadata import HCacheStepMetadata
from .scheduler import SchedulerSide
from .settings import connector_settings, resolve_setup
from .vllm_events import block_hasher, vllm_event
from .worker import WorkerSide


class HCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """With vLLM's hybrid KV cache manager (a model with sliding-window and full-attention layers), each KV
    cache group's blocks are loaded and saved by its layers' rule (:mod:`hcache.planning.window`)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        setup = resolve_setup(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            hash_block_size = (
                resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]
                if kv_cache_config is not None
                else vllm_config.cache_config.block_size
            )
            hashing = block_hasher(vllm_config.cache_config.prefix_caching_hash_algo)
            self._scheduler = SchedulerSide(setup, hashing, hash_block_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            device = torch.device(vllm_config.device_config.device)
            self._worker = WorkerSide(
                setup, device, vllm_config.compilation_config.static_forward_context, get_tensor_model_parallel_rank()
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: where hidden states are saved or restored, each layer's input is captured and handed to the
        saver in Python (``save_kv_layer``), which a full CUDA graph would skip. (K/V need no layer hook: they
        are read out of the cache after the forward. Whether a full graph then serves a KV plan has not been
        tried, so piecewise graphs are asked for all the same.) vLLM asks this whenever it builds a config with
        CUDA graphs on (a GPU's default): first in the process that starts it, before any weights load, where
        hcache's settings are checked. The store's directories are not: a config rebuilt later (speculative
        decoding's, in the worker) would find them held by this very engine."""
        connector_settings(extra_config)
        return True

    # ---- scheduler side ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """None while the workers are holding the stored prefix found (vLLM asks again next step); a small
        load is synchronous (loaded in the step that computes the request), a larger one asynchronous."""
        tokens = self._scheduler.matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and not self._scheduler.loads_in_step(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return HCacheStepMetadata(**vars(self._scheduler.build(scheduler_output)))

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.worker_output(connector_output.kv_connector_worker_meta)

    def take_events(self) -> list[KVCacheEvent]:
        """What hcache's tiers gained and lost, as vLLM's KV cache events (:mod:`hcache.vllm.events`)."""
        return [vllm_event(event) for event in self._scheduler.take_events()]

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request)
        return False, None  # saves are copied out during the forward; vLLM keeps a loading request's blocks itself

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # ---- worker side --------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, HCacheStepMetadata)
        self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass  # the loads were handed to the loader when the metadata was bound, in-step ones waited for

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # no layer waits: a request's load is done before its forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads; with several KV cache groups, those that fell short as failed too (vLLM recomputes
        such a request whole: a block id names no request across groups)."""
        loaded = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=loaded, failed_recving=self._worker.failed_loads())

    def build_connector_worker_meta(self):
        return self._worker.scheduler_news()

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()
