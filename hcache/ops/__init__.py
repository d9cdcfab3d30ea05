"""Restore and attention-side ops. Torch references here are the oracle for the kernels."""

from .kv_projection import KVProjection
from .paged_kv import gather_kv, read_kv, slot_mapping, write_kv
from .rope import apply_rope, rope_cos_sin
from .rope_scatter import rotate_and_write

__all__ = [
    "KVProjection",
    "apply_rope",
    "gather_kv",
    "read_kv",
    "rope_cos_sin",
    "rotate_and_write",
    "slot_mapping",
    "write_kv",
]
