"""hcache's vLLM plugin (entry point ``vllm.general_plugins``): the connector's settings checked in the
process that starts vLLM, before its engine process starts and any weights load.

vLLM imports a connector class only in its engine's processes, once the model is loading: there a
misspelt ``kv_connector_extra_config`` key surfaces as "Engine core initialization failed", with
hcache's message in the log lines above it, minutes later. vLLM runs its general plugins in every process
it starts, first in the launching one as it reads its arguments (``vllm serve``, ``vllm.LLM``): this one
wraps ``EngineArgs.create_engine_config`` so that a config naming hcache's connector has its settings
checked (:func:`~hcache.vllm.settings.connector_settings`) before the config is built, and the config
once built (:func:`~hcache.vllm.settings.check_engine`: the plan against the model and the tensor-parallel
size, the store's directories, vLLM's failure policy), before its engine starts. The directories checked
are those named, which no process of the engine holds (a rank holds a directory of its own below them at
TP > 1; at TP = 1 the worker holding them is the one process that may build a config again, for speculative
decoding, and a process holding a directory passes its check). It imports nothing of the connector's until
it sees such a config. A refusal of settings nothing catches (vLLM's OpenAI server catches none) is printed
as one line, ``hcache: error: ...``, not as the tail of a traceback. (In the engine's processes vLLM logs what fails
with its traceback, then fails its start: that form is vLLM's to choose.)
"""

from __future__ import annotations

import functools
import sys

from ..errors import InvalidRequestError, UnsupportedModelError
from . import CONNECTOR


def register() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if not getattr(sys.excepthook, "hcache_one_line", False):
        sys.excepthook = _one_line_refusals(sys.excepthook)

    build = EngineArgs.create_engine_config
    if getattr(build, "hcache_checks_settings", False):  # vLLM may load its plugins again in one process
        return

    @functools.wraps(build)
    def create_engine_config(self, *args, **kwargs):
        check_transfer_config(self.kv_transfer_config)
        config = build(self, *args, **kwargs)
        if _names_hcache(config.kv_transfer_config):
            from .settings import check_engine

            check_engine(config)
        return config

    create_engine_config.hcache_checks_settings = True
    EngineArgs.create_engine_config = create_engine_config


def check_transfer_config(transfer) -> None:
    """Raise hcache's :class:`~hcache.errors.InvalidRequestError` if ``transfer`` (vLLM's
    ``KVTransferConfig``, a dict of it, or None) names hcache's connector with settings it refuses."""
    if not _names_hcache(transfer):
        return
    from .settings import connector_settings

    connector_settings(_get(transfer, "kv_connector_extra_config"))


def _one_line_refusals(hook):
    """``sys.excepthook``: the refusals of settings this plugin's checks raise as one line, every other
    exception to ``hook`` (hcache's failures at run time, a store's or a full cache's, keep their traceback)."""

    def excepthook(kind, exc, traceback) -> None:
        if issubclass(kind, (InvalidRequestError, UnsupportedModelError)):
            print(f"hcache: error: {exc}", file=sys.stderr)
        else:
            hook(kind, exc, traceback)

    excepthook.hcache_one_line = True
    return excepthook


def _names_hcache(transfer) -> bool:
    return transfer is not None and _get(transfer, "kv_connector") == CONNECTOR


def _get(transfer, name: str):
    return transfer.get(name) if isinstance(transfer, dict) else getattr(transfer, name, None)
