"""Restore and attention-side ops. Torch references here are the oracle for the kernels."""
from .kv_projection import KVProjection
from .paged_kv import gather_kv, slot_mapping, write_kv
from .rope import apply_rope, rope_cos_sin

__all__ = ["KVProjection", "apply_rope", "gather_kv", "rope_cos_sin", "slot_mapping", "write_kv"]
