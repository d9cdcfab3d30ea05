"""The engine MII serves: MII builds its engine in one place, ``mii.api.load_model``, which
:mod:`hcache.mii.patches` points at :func:`build_engine`; MII's Dynamic SplitFuse loop then drives a
:class:`~hcache.serving.engine.ServingEngine` exactly as it drives ``InferenceEngineV2``. The deployment's
settings are resolved once, where it starts (:func:`resolve_deployment`), and checked before any process
starts (:func:`check_deployment`); model servers read the result."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import HCacheConfig, KvEvents, ResolvedConfig, engine_and_device
from ..engine.reference import ReferenceEngine
from ..errors import InvalidRequestError, ModelNotFoundError, StorageError
from ..model.fingerprint import checkpoint_fingerprint, model_fingerprint
from ..model.loader import check_device, load_model, model_dtype
from ..model.spec import ModelSpec
from ..model.tensor_parallel import SINGLE, TPGroup, local_spec, shard_model
from ..resolve import resolve
from ..serving.engine import ServingEngine
from ..serving.metrics import serve_metrics
from ..serving.factory import serving_engine


def building_hcache_engines(_load_model, hcache: ResolvedConfig):
    """``mii.api.load_model``: :func:`build_engine` with the deployment's resolved settings."""
    return lambda model_config: build_engine(model_config, hcache)


def build_engine(model_config, hcache: ResolvedConfig) -> ServingEngine:
    """The engine MII serves ``model_config`` with (``model_config`` is MII's ``ModelConfig``), by the config
    :func:`resolve_deployment` resolved. With ``tensor_parallel`` above 1, this process is one rank of the
    deployment (MII starts one per rank)."""
    path, settings = model_config.model_name_or_path, hcache.settings
    tp = _tensor_parallel_group(model_config.tensor_parallel)
    if hcache.engine == "fastgen":
        from ..engine.fastgen import build_fastgen_engine

        engine = build_fastgen_engine(path, model_config.inference_engine_config)
        fingerprint, config = checkpoint_fingerprint(path, engine.spec), engine.config
    else:
        device = hcache.device  # "cuda" is this rank's GPU: the process group set it
        loaded = load_model(path, model_dtype(settings.dtype, device), device)
        fingerprint = model_fingerprint(loaded.model, loaded.spec)  # of the whole model, on every rank
        shard, spec = shard_model(loaded.model, loaded.spec, tp)
        engine = ReferenceEngine(shard, spec, num_blocks=settings.num_blocks)
        config = model_config.inference_engine_config
    if model_config.max_length is None:  # else MII reads it from FastGen's checkpoint engine
        model_config.max_length = context_length(hcache)
    serving = serving_engine(hcache, engine, fingerprint, tp, engine_config=config)  # after the self-check
    if settings.published_events is not None:
        _publish_events(serving, settings.published_events)
    if settings.metrics_port is not None:
        port = settings.metrics_port + tp.rank
        try:
            serve_metrics(serving.metrics, port, settings.metrics_host)
        except OSError as e:  # another replica on this host has the port: serve without the endpoint
            warnings.warn(f"hcache metrics not served on {settings.metrics_host}:{port}: {e}", stacklevel=2)
    return serving


def _publish_events(serving: ServingEngine, settings: KvEvents) -> None:
    """The ``kv_events`` setting: ``serving``'s tiers published as vLLM's KV cache events until it is closed
    (:mod:`hcache.vllm.publisher`; one rank: :func:`~hcache.resolve.resolve` refused more), in KV cache groups of
    the engine's model. A publisher that cannot start (its port taken since the check) stops the model server."""
    from ..vllm.publisher import TierEvents, model_groups  # imports vLLM

    stack = serving.stack
    groups = model_groups(stack.config, stack.window.spec, settings.block_size, stack.window.block)
    try:
        serving.kv_events = TierEvents(settings, serving.fingerprint, serving.namespace, stack.store, groups)
    except BaseException:
        serving.close()
        raise


def resolve_deployment(settings: HCacheConfig, path: str, tensor_parallel: int = 1) -> ResolvedConfig:
    """Resolve the settings once, where MII is started and before any model server loads, for the model's
    shape read from its config (with tensor parallelism, a rank's shard): a bad setting, plan or profile is
    refused here, and ``plan="auto"`` alone gets this machine's profile (measured now, from the model, if
    none is found and ``measure_profile``) or, after one warning, the default plan. The model servers get
    the result and resolve nothing."""
    spec = _model_spec(path, settings)
    if tensor_parallel > 1:
        spec = local_spec(spec, TPGroup(0, tensor_parallel))
    _, device = engine_and_device(settings)
    return resolve(
        settings,
        spec,
        path,
        tensor_parallel=tensor_parallel,
        measure=lambda: load_model(path, spec.torch_dtype, device),
    )


def _tensor_parallel_group(degree: int) -> TPGroup:
    """This rank's group, joining the process group the launcher describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) unless it is already joined: NCCL on GPUs, gloo on a CPU."""
    if degree == 1:
        return SINGLE
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    tp = TPGroup.current()
    if tp.world_size != degree:
        raise InvalidRequestError(f"tensor_parallel={degree}, but the process group has {tp.world_size} ranks")
    return tp


def check_deployment(hcache: ResolvedConfig) -> None:
    """Refuse, before any server process starts, a store or request log the model servers could not use:
    each rank's store directories are checked as its engine will open them (lock free, layout current)."""
    settings = hcache.settings
    if hcache.stored:
        for rank in range(hcache.tensor_parallel):
            settings.store.check_dirs(hcache.store_dirs(rank))
    if settings.request_log is not None and not os.access(Path(settings.request_log).parent, os.W_OK):
        raise StorageError(
            f"cannot write the request log {settings.request_log}: its directory is missing or read-only"
        )


def _model_spec(path: str, settings: HCacheConfig) -> ModelSpec:
    """The model's shape from its config alone (no weights), in the dtype its engine will run it in:
    ``dtype`` if set; FastGen runs a checkpoint in its own half-precision dtype; the reference engine in
    float16 on a GPU and float32 on the CPU."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read the model config in {path!r}: {exc}") from exc
    engine, device = engine_and_device(settings, getattr(config, "model_type", None))
    check_device(device)
    dtype = model_dtype(settings.dtype, device)
    if settings.dtype is None and engine == "fastgen":  # FastGen runs the config's dtype
        checkpoint = getattr(config, "dtype", None)
        dtype = checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.float16
    return ModelSpec.from_config(config, dtype)


def context_length(hcache: ResolvedConfig) -> int:
    """The longest sequence a deployment serves: the model's positions; on the reference engine, no more
    than its KV cache holds (a longer sequence would wait in MII's scheduler forever)."""
    spec = hcache.spec
    if hcache.engine == "fastgen":
        return spec.max_positions
    return min(spec.max_positions, hcache.settings.num_blocks * ReferenceEngine.BLOCK_SIZE)
