"""hcache in vLLM: a KV connector (``HCacheConnector``) that restores returning conversations from hcache's
store. Load it with ``--kv-transfer-config '{"kv_connector": "HCacheConnector", "kv_connector_module_path":
"hcache.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config":
{...hcache settings...}}'`` (``docs/vllm.md``), or from Python ``kv_transfer_config(settings)``. Importing this package imports vLLM."""
from .connector import HCacheConnector
from .settings import kv_transfer_config

__all__ = ["HCacheConnector", "kv_transfer_config"]
