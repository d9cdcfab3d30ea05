"""Inference engines hcache restores into. ``reference`` runs anywhere torch runs (HF transformers modules)."""

from .blocked_kv_cache import BlockedKVCache
from .capture import LayerCapture
from .reference import ReferenceEngine

__all__ = ["BlockedKVCache", "LayerCapture", "ReferenceEngine"]
