"""Rotate K and write K and V into the paged KV cache: every forward's K/V write, and a hidden-state
restore's step after the K/V GEMM.

Two backends compute the same bits:
- ``"torch"``: :func:`~hcache.ops.rope.apply_rope` then :func:`~hcache.ops.paged_kv.write_kv`, the
  reference and the tests' oracle;
- ``"triton"``: one fused pass (:mod:`hcache.ops.rope_scatter_kernel`).

``"auto"`` takes Triton for CUDA tensors, and under ``TRITON_INTERPRET=1`` (how CI runs the kernel on the
CPU); otherwise torch. The reference engine's forward and its restores all go through here with the same
backend, so a restored K is bit-identical to the K the forward wrote.
"""

from __future__ import annotations

from typing import Literal

import torch

from .paged_kv import write_kv
from .rope import apply_rope
from .rope_scatter_kernel import interpreting, launch

Backend = Literal["auto", "torch", "triton"]


def resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    """The backend that ``backend`` means for tensors on ``device``."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")
    if backend == "torch":
        return "torch"
    runnable = device.type == "cuda" or interpreting()
    if backend == "triton" and not runnable:
        raise ValueError(f"the triton backend needs CUDA tensors or TRITON_INTERPRET=1; got {device.type} tensors")
    return "triton" if runnable else "torch"


def rotate_and_write(
    cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    backend: Backend = "auto",
) -> None:
    """Rotate ``k`` by ``cos_sin`` and write ``k`` and ``v`` into ``slots`` of one layer's cache.

    - ``cache``: ``[num_blocks, block_size, 2, n_kv_heads, head_size]``, contiguous.
    - ``slots``: ``[T]`` int64 flat slots, :func:`~hcache.ops.paged_kv.slot_mapping` of each sequence's
      block table and positions, concatenated: a ragged batch, starting mid-block or not.
    - ``k``, ``v``: ``[T, n_kv_heads, head_size]``, any token and head strides (views of a K/V GEMM output).
    - ``cos_sin``: :func:`~hcache.ops.rope.rope_cos_sin` of the same ``T`` tokens' absolute positions, or
      ``None`` for a model without RoPE (OPT): then K is copied unrotated.
    """
    if resolve_backend(backend, cache.device) == "torch":
        write_kv(cache, slots, k if cos_sin is None else apply_rope(k, *cos_sin), v)
    else:
        launch(cache, slots, k, v, cos_sin)
