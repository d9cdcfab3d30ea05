"""``mii.pipeline`` and ``mii.serve`` with hcache's restore and save: a deployment's settings resolved and
checked before MII starts anything, MII's processes started with hcache's backend, and stopped whole."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..config import HCacheConfig, ResolvedConfig
from .engine_factory import check_deployment, resolve_deployment
from .patches import check_mii_version, hold_loop_patches, installed, launching_with_hcache
from .processes import stop

log = logging.getLogger(__name__)
TERMINATE_WAIT_S = 15
MII_CACHE_ENV = "MII_CACHE_PATH"
DS_ACCELERATOR_ENV = "DS_ACCELERATOR"


def pipeline(model_name_or_path: str = "", *, hcache: HCacheConfig | dict | None = None, **kwargs: Any):
    """``mii.pipeline`` (same arguments) whose engine restores and saves through hcache, and whose batching
    loop checks each request, prefetches for waiting ones and fails a call alone
    (:func:`~hcache.mii.patches.hold_loop_patches`).
    The pipeline's ``inference_engine.close()`` drains the saver; finished sequences are already stored."""
    _quiet_libraries()
    import mii

    path, tensor_parallel = _deployment(model_name_or_path, kwargs)
    with installed(resolve_deployment(HCacheConfig.of(hcache), path, tensor_parallel)):
        pipe = mii.pipeline(model_name_or_path, **kwargs)
        hold_loop_patches(pipe)
        return pipe


def serve(
    model_name_or_path: str = "",
    *,
    hcache: HCacheConfig | dict | None = None,
    checked: Callable[[ResolvedConfig], None] | None = None,
    **kwargs: Any,
):
    """``mii.serve`` (same arguments: ``enable_restful_api``, ``deployment_name``, ports, ...) whose replicas
    restore and save through hcache. Returns MII's client; its ``terminate_server()`` stops the deployment
    and waits until every process it started has exited (ending those that do not exit).

    The hcache config is resolved, and the model and store checked, before any process starts (then
    ``checked(resolved config)`` is called, if given). If the deployment still fails to start, every process it started is
    stopped before the error is raised."""
    _quiet_libraries()
    import mii

    check_mii_version()
    path, tensor_parallel = _deployment(model_name_or_path, kwargs)
    config = resolve_deployment(HCacheConfig.of(hcache), path, tensor_parallel)
    check_deployment(config)
    if checked is not None:
        checked(config)
    launched: list = []
    mii_cache = tempfile.mkdtemp(prefix="hcache-mii-")
    try:
        with launching_with_hcache(config, launched), _mii_cache_at(mii_cache):
            client = mii.serve(model_name_or_path, **kwargs)
    except BaseException:
        stop(launched, grace_s=0)
        shutil.rmtree(mii_cache, ignore_errors=True)
        raise
    terminate = client.terminate_server

    def terminate_server() -> None:
        # A hung server may never answer the terminate request: give it a while, then stop what is left.
        asking = threading.Thread(target=_ask_to_terminate, args=(terminate,), daemon=True)
        asking.start()
        asking.join(TERMINATE_WAIT_S)
        stop(launched)
        shutil.rmtree(mii_cache, ignore_errors=True)

    client.terminate_server = terminate_server
    return client


def _quiet_libraries() -> None:
    """DeepSpeed picks its accelerator when it is first imported, and where it finds no GPU it warns so, in
    this process and in each one MII starts. Where torch sees no CUDA device (as DeepSpeed checks), the CPU
    is named with DeepSpeed's own switch, ``DS_ACCELERATOR``, which those processes inherit. MII logs at
    INFO: below INFO for hcache's logger (``hcache`` without ``-v``), only its warnings show."""
    import torch

    if DS_ACCELERATOR_ENV not in os.environ and not (torch.cuda.device_count() > 0 and torch.cuda.is_available()):
        os.environ[DS_ACCELERATOR_ENV] = "cpu"
    mii_log = logging.getLogger("MII")  # MII sets its level when first imported: a filter stays
    if not log.isEnabledFor(logging.INFO) and _warnings_only not in mii_log.filters:
        mii_log.addFilter(_warnings_only)


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


@contextmanager
def _mii_cache_at(path: str) -> Iterator[None]:
    """MII writes a deployment's config to ``$MII_CACHE_PATH/<deployment name>/score.py``, imports it back to
    start the deployment, and its REST gateway reads it for each request: two deployments of one name
    starting at once on a machine (the nodes of a fleet) would each start with the other's ports. Each
    ``serve`` and the processes it starts use a directory of their own for it, removed when it stops."""
    saved = os.environ.get(MII_CACHE_ENV)
    os.environ[MII_CACHE_ENV] = path
    try:
        yield
    finally:
        if saved is None:
            del os.environ[MII_CACHE_ENV]
        else:
            os.environ[MII_CACHE_ENV] = saved


def _ask_to_terminate(terminate) -> None:
    try:
        terminate()
    except Exception as exc:  # the load balancer or the gateway is gone already
        log.warning("the deployment did not take the terminate request (%s); stopping its processes", exc)


def _deployment(model_name_or_path: str, mii_kwargs: dict) -> tuple[str, int]:
    """The model and tensor-parallel degree of MII's arguments, wherever they were given."""
    model_config = mii_kwargs.get("model_config") or {}
    path = model_name_or_path or model_config.get("model_name_or_path", "")
    return path, mii_kwargs.get("tensor_parallel", model_config.get("tensor_parallel", 1))
