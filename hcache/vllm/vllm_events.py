"""hcache's KV cache events (:mod:`hcache.vllm.events`) in vLLM's own types, hashed by vLLM's own block hash:
what vLLM's publisher sends, for the connector and for any other publisher of hcache's tiers."""

from __future__ import annotations

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash, to_event_extra_keys

from .events import Event, HashBlock, Removed, Stored


def block_hasher(algorithm: str) -> HashBlock:
    """vLLM's hash of a block after ``parent`` (``prefix_caching_hash_algo``), under a request's ``cache_salt``
    as vLLM keys the first block; seeded as the engine of this process seeds it (``init_none_hash``)."""
    hash_fn = get_hash_fn_by_name(algorithm)
    return lambda parent, tokens, salt: hash_block_tokens(
        hash_fn, parent, tokens, (("cache_salt", salt),) if salt else None
    )


def vllm_event(event: Event) -> KVCacheEvent:
    """One of :mod:`hcache.vllm.events`' events as vLLM publishes its own: hashes as ints where vLLM's are, with
    the KV cache group's index, kind and window as vLLM's scheduler sets them."""
    if isinstance(event, Stored):
        salts = [(("cache_salt", b.salt),) if b.parent is None and b.salt else None for b in event.blocks]
        parent, group = event.blocks[0].parent, event.group
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(b.hash) for b in event.blocks],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=[t for b in event.blocks for t in b.tokens],
            block_size=group.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=None,
            extra_keys=to_event_extra_keys(salts) if any(salts) else None,
            group_idx=group.index,
            kv_cache_spec_kind=group.kind,
            kv_cache_spec_sliding_window=group.window,
        )
    if isinstance(event, Removed):
        return BlockRemoved(
            block_hashes=[maybe_convert_block_hash(h) for h in event.hashes],
            medium=event.medium,
            group_idx=event.group.index,
        )
    return AllBlocksCleared()
