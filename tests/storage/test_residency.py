"""Where a chunk is held, as a host tier tells it: entering and leaving the pool, written to and evicted from
the disk, discarded as bad, and what a restart finds on disk, parents before the chunks that continue them;
each entry with the layers the chunk holds."""

from support.damage import rewrite_header
from support.storage_chunks import chained, publish

from hcache.storage.chunk import Chunk, encode
from hcache.storage.chunk_store import Loss
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.host_pool import PAGE, HostPool
from hcache.storage.host_tier import HostTier
from hcache.storage.residency import HOST, Residency

DISK = "disk"


def _tier(path, chunks_in_pool: int, **store) -> HostTier:
    size = -(-len(encode(chained(1)[0])) // PAGE) * PAGE
    return HostTier([DiskChunkStore(path, fsync=False, **store)], HostPool(chunks_in_pool * size))


def _held(c: Chunk, tier: str) -> Residency:
    """``c`` held in ``tier``, with the layers whose rows it holds (for KV cache events' groups)."""
    return Residency(c.key, tier, True, tuple(c.tokens), c.parent, layers=frozenset(layer for layer, _ in c.tensors))


def test_a_saved_chunk_enters_the_pool_then_the_disk_and_leaves_the_pool_when_it_makes_room(tmp_path):
    tier, told = _tier(tmp_path, 2), []
    tier.follow(told.append)
    chain = chained(3)
    for c in chain:
        publish(tier, c)
        tier.flush()  # its write-back ends before the next chunk needs room
    assert told[:2] == [_held(chain[0], HOST), _held(chain[0], DISK)]
    assert Residency(chain[0].key, HOST, False) in told  # the third chunk took its slot
    assert told.index(Residency(chain[0].key, HOST, False)) < told.index(_held(chain[2], HOST))
    assert [r for r in told if r.tier == DISK] == [_held(c, DISK) for c in chain]
    tier.close()


def test_a_chunk_discarded_as_bad_leaves_the_pool_and_the_disk_with_why(tmp_path):
    tier, told = _tier(tmp_path, 4), []
    tier.follow(told.append)
    c = chained(1)[0]
    publish(tier, c)
    tier.flush()
    tier.discard(c.key)
    gone = [r for r in told if not r.held]
    assert {(r.tier, r.why) for r in gone} == {(HOST, Loss.FAILED_VERIFICATION), (DISK, Loss.FAILED_VERIFICATION)}
    tier.close()


def test_a_chunk_the_disk_quota_evicts_leaves_the_disk(tmp_path):
    one = len(encode(chained(1)[0]))
    tier, told = _tier(tmp_path, 4, quota_bytes=2 * one), []
    tier.follow(told.append)
    first, second = chained(1, seed=1)[0], chained(1, seed=2)[0]  # two chains: neither is kept for the other
    third = chained(1, seed=3)[0]
    for c in (first, second, third):
        publish(tier, c)
        tier.flush()
    assert Residency(first.key, DISK, False, why=Loss.EVICTED) in told
    assert not tier.stores[0].contains(first.key)
    tier.close()


def test_a_restart_tells_what_the_disk_holds_parents_first(tmp_path):
    tier = _tier(tmp_path, 8)
    chains = [chained(4, seed=5), chained(3, seed=6)]
    for chain in chains:
        for c in chain:
            publish(tier, c)
    tier.close()
    again, told = _tier(tmp_path, 8), []
    again.follow(told.append)
    assert sorted(told, key=lambda r: r.key) == sorted(
        (_held(c, DISK) for ch in chains for c in ch), key=lambda r: r.key
    )
    order = [r.key for r in told]
    for chain in chains:
        assert [order.index(c.key) for c in chain] == sorted(order.index(c.key) for c in chain)
    again.close()


def test_a_restart_leaves_out_a_chunk_whose_token_ids_cannot_be_read(tmp_path):
    """Its header parses, its token ids do not: left out of what is told (a read of it finds it bad), and
    the rest is told as ever."""
    tier = _tier(tmp_path, 8)
    chain = chained(3, seed=7)
    for c in chain:
        publish(tier, c)
    tier.close()
    (path,) = tmp_path.glob(f"chunks/*/{chain[1].key}*")
    rewrite_header(path, lambda header: header["__metadata__"].update(tokens='"not a list"'))
    again, told = _tier(tmp_path, 8), []
    again.follow(told.append)
    assert again.stores[0].contains(chain[1].key)  # still stored: its header checks out as a whole
    assert {r.key for r in told} == {chain[0].key, chain[2].key}
    again.close()


def test_a_shared_directory_is_not_told_for_its_other_nodes_change_it_unseen(tmp_path):
    """Another node's eviction from it goes unseen: told held, a chunk could be gone when a load comes."""
    tier, told = _tier(tmp_path, 4, shared=True), []
    tier.follow(told.append)
    c = chained(1)[0]
    publish(tier, c)
    tier.flush()
    assert tier.stores[0].contains(c.key)
    assert told == [_held(c, HOST)]
    tier.close()
