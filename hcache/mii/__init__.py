"""hcache as a DeepSpeed-MII backend: ``mii.pipeline`` and ``mii.serve`` with hcache's restore and save.

    import hcache.mii
    pipe = hcache.mii.pipeline("path/to/model", hcache={"store_dirs": ["/nvme0/hc", "/nvme1/hc"]})
    client = hcache.mii.serve("path/to/model", hcache={"plan": "auto", "profile": "profiles/x.json"},
                              enable_restful_api=True)

Both take MII's own arguments too, and return MII's own pipeline and client.
"""
from __future__ import annotations

from typing import Any

from .backend import (
    build_engine,
    check_mii_version,
    installed,
    resolve_profile,
    server_processes_launched_by_hcache,
    stop,
)
from .config import HCacheConfig

__all__ = ["HCacheConfig", "build_engine", "pipeline", "serve"]


def pipeline(model_name_or_path: str = "", *, hcache: HCacheConfig | dict | None = None, **kwargs: Any):
    """``mii.pipeline`` (same arguments) whose engine restores and saves through hcache. The pipeline's
    ``inference_engine.close()`` drains the saver; finished sequences are already stored."""
    import mii

    with installed(_config(hcache, model_name_or_path, kwargs)):
        return mii.pipeline(model_name_or_path, **kwargs)


def serve(model_name_or_path: str = "", *, hcache: HCacheConfig | dict | None = None, **kwargs: Any):
    """``mii.serve`` (same arguments: ``enable_restful_api``, ``deployment_name``, ports, ...) whose replicas
    restore and save through hcache. Returns MII's client; its ``terminate_server()`` stops the deployment
    and waits until every process it started has exited."""
    import mii

    check_mii_version()
    config = _config(hcache, model_name_or_path, kwargs)
    launched: list = []
    with server_processes_launched_by_hcache(config, launched):
        client = mii.serve(model_name_or_path, **kwargs)
    terminate = client.terminate_server

    def terminate_server() -> None:
        terminate()
        stop(launched)

    client.terminate_server = terminate_server
    return client


def _config(hcache: HCacheConfig | dict | None, model_name_or_path: str, mii_kwargs: dict) -> HCacheConfig:
    config = hcache if isinstance(hcache, HCacheConfig) else HCacheConfig(**(hcache or {}))
    return resolve_profile(config, model_name_or_path, mii_kwargs.get("tensor_parallel", 1))
