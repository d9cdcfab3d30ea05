"""hcache in vLLM: a KV connector (``HCacheConnector``) that restores returning conversations from hcache's
store. Load it with ``--kv-transfer-config '{"kv_connector": "HCacheConnector", "kv_connector_module_path":
"hcache.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config":
{...hcache settings...}}'`` (``docs/vllm.md``), or from Python ``kv_transfer_config(settings)``. Asking for
either imports vLLM."""

from __future__ import annotations

import importlib

# How vLLM finds the connector: the class name and module that ``kv_transfer_config`` writes into vLLM's
# config, and that the plugin looks for there.
CONNECTOR = "HCacheConnector"
MODULE = __name__

# Handed on when first asked for: vLLM loads hcache's plugin (.plugin) in every process it starts, where
# nothing of the connector is wanted.
_HANDED_ON = {CONNECTOR: ".connector", "kv_transfer_config": ".settings"}
__all__ = list(_HANDED_ON)


def __getattr__(name: str):
    if name not in _HANDED_ON:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HANDED_ON[name], __name__), name)
