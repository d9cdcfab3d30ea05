"""Reads and writes of the paged (blocked) KV cache in DeepSpeed-FastGen's layout.

One layer's cache is ``[num_blocks, block_size, 2, n_kv_heads, head_size]``; index 0 of dim 2 is K, 1 is V.
A sequence owns a list of blocks (its block table); token ``p`` of it lives in slot
``table[p // block_size] * block_size + p % block_size``.
"""
from __future__ import annotations

import torch


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` for a sequence whose blocks are ``block_table``."""
    return block_table[positions // block_size] * block_size + positions % block_size


def write_kv(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter ``k`` and ``v`` ``[T, n_kv_heads, head_size]`` into ``slots`` ``[T]`` of one layer's cache."""
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots, 0] = k.to(cache.dtype)
    flat[slots, 1] = v.to(cache.dtype)


def read_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[T, 2, n_kv_heads, head_size]`` (a copy; K then V) at ``slots`` ``[T]``: what :func:`write_kv` wrote
    there, in one gather."""
    return cache.view(-1, *cache.shape[2:])[slots]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length, n_kv_heads, head_size]`` of the first ``length`` tokens of one sequence."""
    n_blocks = -(-length // cache.shape[1])
    kv = cache[block_table[:n_blocks]].flatten(0, 1)[:length]
    return kv[:, 0], kv[:, 1]
