"""Inference engines hcache restores into. ``reference`` runs anywhere torch runs (HF transformers modules)."""
from .blocked_kv_cache import BlockedKVCache
from .capture import BatchSegment, LayerCapture
from .reference import ReferenceEngine

__all__ = ["BatchSegment", "BlockedKVCache", "LayerCapture", "ReferenceEngine"]
