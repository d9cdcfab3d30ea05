"""A paged KV cache in DeepSpeed-FastGen's block layout, with a free-list block allocator."""

from __future__ import annotations

import torch

from ..errors import CacheFullError, InvalidRequestError
from ..model.spec import ModelSpec


class BlockedKVCache:
    """Per layer ``[num_blocks, block_size, 2, n_kv_heads, head_size]``; blocks are shared by all layers."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int = 64, device: str | torch.device = "cpu"):
        if num_blocks <= 0 or block_size <= 0:
            raise InvalidRequestError(
                f"the KV cache needs a positive number of blocks of a positive size, not num_blocks={num_blocks} "
                f"of block_size={block_size} tokens"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, 2, spec.num_kv_heads, spec.head_size)
        self.layers = [torch.zeros(shape, dtype=spec.torch_dtype, device=device) for _ in range(spec.num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(
                f"KV cache full: {n} blocks requested, {len(self._free)} of {self.num_blocks} free "
                f"({self.block_size} tokens each); raise num_blocks or shorten the request"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
