"""hcache's vLLM plugin (entry point ``vllm.general_plugins``): the connector's settings checked in the
process that starts vLLM, before its engine process starts and any weights load.

vLLM imports a connector class only in its engine's processes, once the model is loading: there a
misspelt ``kv_connector_extra_config`` key surfaces as "Engine core initialization failed", with
hcache's message in the log lines above it, minutes later. vLLM runs its general plugins in every process
it starts, first in the launching one as it reads its arguments (``vllm serve``, ``vllm.LLM``): this one
wraps ``EngineArgs.create_engine_config`` so that a config naming hcache's connector has its settings
checked (:func:`~hcache.vllm.settings.connector_settings`) before the config is built. Not the store's
directories: a config built again in a process that holds them (speculative decoding rebuilds one in the
worker) would find them held. It imports nothing of the connector's until it sees such a config.
"""

from __future__ import annotations

import functools

from . import CONNECTOR


def register() -> None:
    from vllm.engine.arg_utils import EngineArgs

    build = EngineArgs.create_engine_config
    if getattr(build, "hcache_checks_settings", False):  # vLLM may load its plugins again in one process
        return

    @functools.wraps(build)
    def create_engine_config(self, *args, **kwargs):
        check_transfer_config(self.kv_transfer_config)
        return build(self, *args, **kwargs)

    create_engine_config.hcache_checks_settings = True
    EngineArgs.create_engine_config = create_engine_config


def check_transfer_config(transfer) -> None:
    """Raise hcache's :class:`~hcache.errors.InvalidRequestError` if ``transfer`` (vLLM's
    ``KVTransferConfig``, a dict of it, or None) names hcache's connector with settings it refuses."""
    get = transfer.get if isinstance(transfer, dict) else lambda name: getattr(transfer, name, None)
    if transfer is None or get("kv_connector") != CONNECTOR:
        return
    from .settings import connector_settings

    connector_settings(get("kv_connector_extra_config"))
