"""How vLLM finds hcache's connector: the class name and module that ``kv_transfer_config`` writes into
vLLM's config, and that hcache's vLLM plugin looks for there. Imports nothing."""

CONNECTOR = "HCacheConnector"
MODULE = "hcache.vllm"
