"""The host tier: saved chunks restorable from memory before their disk write, write-back, loads verified
once, LRU eviction that never touches a referenced slot, back-pressure, healing a chunk short of a format, and
pool hits counted as uses by the stores below."""

import threading
import time

import pytest
import torch
from support.damage import HEADER_PARSES, damage
from support.storage_chunks import FINGERPRINT, Chunk, check_image, check_served, chunk, publish

from hcache.storage.chunk import ChunkInvalid, ChunkLayout, decode, encode
from hcache.storage.chunk_store import Loss
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.host_tier import HostTier
from hcache.storage.host_pool import PAGE, HostPool


def _tier(path, chunks_in_pool: int, **kw) -> HostTier:
    size = -(-len(encode(chunk(0))) // PAGE) * PAGE
    return HostTier([DiskChunkStore(path, fsync=False)], HostPool(chunks_in_pool * size), **kw)


def test_a_saved_chunk_is_restorable_from_memory_before_its_disk_write_finishes(tmp_path, monkeypatch):
    tier = _tier(tmp_path, 4)
    gate, put = threading.Event(), tier.stores[0].put
    monkeypatch.setattr(tier.stores[0], "put", lambda *a: (gate.wait(), put(*a)))
    publish(tier, chunk(0))
    assert not tier.stores[0].contains(chunk(0).key) and tier.contains(chunk(0).key)  # still being written
    image = tier.fetch(chunk(0).key).result(timeout=5)
    check_image(image, chunk(0))
    tier.release(image)
    gate.set()
    tier.flush()
    check_served(tier.stores[0], chunk(0).key, chunk(0))
    tier.close()


def test_a_miss_is_loaded_from_disk_once_verified_and_then_served_from_memory(tmp_path):
    tier = _tier(tmp_path, 4, readers=2)
    for i in range(2):
        tier.stores[0].put(*(chunk(i).key, encode(chunk(i))))
    futures = [tier.fetch(chunk(0).key), tier.fetch(chunk(0).key), tier.fetch(chunk(1).key)]  # two of one key at once
    images = [f.result(timeout=5) for f in futures]
    assert images[0] is images[1] and images[0].slot.refs == 2
    check_image(images[0], chunk(0))
    check_image(images[2], chunk(1))
    loaded = tier.bytes_loaded
    assert loaded == sum(len(encode(chunk(i))) for i in range(2)) and tier.misses == 3
    for im in images:
        tier.release(im)
    again = tier.fetch(chunk(1).key).result()
    assert tier.hits == 1 and tier.bytes_loaded == loaded  # from memory: no read, no second verification
    tier.release(again)
    assert tier.fetch("ee" * 16).result() is None
    tier.close()


def test_a_corrupt_file_is_refused_when_it_enters_the_pool_and_discarded(tmp_path):
    tier = _tier(tmp_path, 4, readers=0)
    data = bytearray(encode(chunk(0)))
    data[-3] ^= 0xFF
    tier.stores[0].put(chunk(0).key, bytes(data))
    with pytest.raises(ChunkInvalid, match="checksum"):
        tier.fetch(chunk(0).key).result()
    assert not tier.contains(chunk(0).key) and tier.pool.used_bytes == 0  # dropped, slot given back
    tier.close()


def test_lru_eviction_never_takes_a_referenced_slot(tmp_path):
    tier = _tier(tmp_path, 3)
    for i in range(3):
        publish(tier, chunk(i))
    tier.flush()
    held = tier.fetch(chunk(0).key).result()  # 0 is referenced (a restore reads it)
    touched = tier.fetch(chunk(1).key).result()
    tier.release(touched)  # 1 is now more recent than 2
    publish(tier, chunk(3))  # room for one: 2 is the least recently used unreferenced chunk
    tier.flush()
    assert [tier.resident(chunk(i).key) for i in range(4)] == [True, True, False, True] and tier.evictions == 1
    for i in (4, 5):
        publish(tier, chunk(i))
        tier.flush()
    assert tier.resident(chunk(0).key)  # still held: never evicted, its bytes intact
    check_image(held, chunk(0))
    tier.release(held)
    assert all(tier.contains(chunk(i).key) for i in range(6))  # the evicted ones are on disk
    image = tier.fetch(chunk(2).key).result()
    check_image(image, chunk(2))
    tier.release(image)
    tier.close()


def _valued(tier: HostTier, monkeypatch, values: dict[str, float]) -> None:
    """Publish as the saver does, with the value it gives each chunk (1 unless ``values`` says)."""
    publish = tier.publish
    monkeypatch.setattr(
        tier, "publish", lambda image, key, tokens, parent="": publish(image, key, tokens, values.get(key, 1.0), parent)
    )


@pytest.mark.parametrize("eviction, kept", [("cost", [True, False, True, True]), ("lru", [False, True, True, True])])
def test_cost_eviction_keeps_the_expensive_chunk_that_lru_drops(tmp_path, monkeypatch, eviction, kept):
    """Chunk 0 saves a billion times more than the others: cost eviction gives up the cheap chunk idle
    longest (1) instead of the least recently used (0); LRU takes 0, as it always has."""
    tier = _tier(tmp_path, 3, eviction=eviction)
    _valued(tier, monkeypatch, {chunk(0).key: 1e9})
    for i in range(4):
        publish(tier, chunk(i))
        tier.flush()
        time.sleep(0.01)
    assert [tier.resident(chunk(i).key) for i in range(4)] == kept and tier.evictions == 1
    tier.close()


def test_a_chunk_loaded_back_from_disk_keeps_the_value_it_was_published_with(tmp_path, monkeypatch):
    tier = _tier(tmp_path, 3, eviction="cost", readers=0)
    _valued(tier, monkeypatch, {chunk(0).key: 1e9})
    for i in range(3):
        publish(tier, chunk(i))
    tier.flush()
    assert tier.drop_resident() == 3
    for i in range(3):  # loaded from disk, least recent first: 0, 1, 2
        tier.release(tier.fetch(chunk(i).key).result())
    publish(tier, chunk(3))
    tier.flush()
    assert [tier.resident(chunk(i).key) for i in range(4)] == [True, False, True, True]
    tier.close()


def test_a_pool_full_of_write_backs_stalls_the_saver_then_frees(tmp_path, monkeypatch):
    tier = _tier(tmp_path, 2)
    gate, put = threading.Event(), tier.stores[0].put
    monkeypatch.setattr(tier.stores[0], "put", lambda *a: (gate.wait(), put(*a)))
    publish(tier, chunk(0))
    publish(tier, chunk(1))  # the pool is full of chunks being written back
    threading.Timer(0.3, gate.set).start()
    publish(tier, chunk(2))  # waits for a write-back, then evicts
    assert tier.saver_stalls.count == 1 and tier.saver_stalls.seconds > 0.2 and tier.unsaved == 0
    assert tier.loader_stalls.count == 0  # a saver's wait is not a load's
    assert tier.stats()["saver_stalls"] == 1 and tier.stats()["loader_stalls"] == 0
    tier.flush()
    assert sorted(tier.keys()) == sorted(chunk(i).key for i in range(3))
    for i in range(3):
        check_served(tier.stores[0], chunk(i).key, chunk(i))
    tier.close()


def test_a_pool_full_of_write_backs_stalls_a_load_then_frees_and_counts_it_as_the_loaders(tmp_path, monkeypatch):
    tier = _tier(tmp_path, 1, readers=0)
    tier.stores[0].put(chunk(1).key, encode(chunk(1)))  # on disk only
    gate, put = threading.Event(), tier.stores[0].put
    monkeypatch.setattr(tier.stores[0], "put", lambda *a: (gate.wait(), put(*a)))
    publish(tier, chunk(0))  # the pool is full of a chunk being written back
    threading.Timer(0.3, gate.set).start()
    image = tier.fetch(chunk(1).key).result(timeout=5)  # waits for the write-back, then evicts 0
    check_image(image, chunk(1))
    tier.release(image)
    assert tier.loader_stalls.count == 1 and tier.loader_stalls.seconds > 0.2
    assert tier.saver_stalls.count == 0 and tier.evictions == 1
    stats = tier.stats()
    assert stats["loader_stalls"] == 1 and stats["loader_stall_seconds"] > 0.2 and stats["saver_stalls"] == 0
    tier.close()


def test_take_source_names_the_store_once_then_the_pool(tmp_path):
    """The first restore that reads a chunk loaded from disk is credited with the disk read; every later
    one with the pool, where the chunk now is. A chunk saved here was in the pool from the start."""
    tier = _tier(tmp_path, 4, readers=0)
    tier.stores[0].put(chunk(0).key, encode(chunk(0)))
    publish(tier, chunk(1))
    loaded, saved = (tier.fetch(chunk(i).key).result() for i in (0, 1))
    assert [tier.take_source(loaded), tier.take_source(loaded)] == ["disk", "host"]
    assert tier.take_source(saved) == "host"
    for image in (loaded, saved):
        tier.release(image)
    tier.close()


def test_a_chunk_that_can_never_fit_is_not_saved_rather_than_waited_for(tmp_path):
    tier = _tier(tmp_path, 1)
    image = tier.create(_layout_of(chunk(0)), FINGERPRINT)  # held by the saver, unpublished
    assert tier.create(_layout_of(chunk(1)), FINGERPRINT) is None and tier.unsaved == 1
    tier.abandon(image)
    assert tier.pool.used_bytes == 0
    tier.close()


def _layout_of(c: Chunk) -> ChunkLayout:
    return ChunkLayout.plan(
        [(layer, fmt, tuple(t.shape[1:]), t.dtype) for (layer, fmt), t in c.tensors.items()], c.fingerprint
    )


def test_a_chunk_saved_with_more_formats_replaces_one_with_fewer(tmp_path):
    tier = _tier(tmp_path, 8)
    short = chunk(0)
    full = Chunk(short.key, short.tokens, FINGERPRINT, {**short.tensors, (0, "KV"): torch.randn(64, 2, 1, 8)})
    publish(tier, short)
    publish(tier, full)  # the same key, and more: it replaces the short one, in memory and on disk
    tier.flush()
    image = tier.fetch(short.key).result()
    check_image(image, full)
    tier.release(image)
    assert tier.stores[0].header(short.key)[0].name_set == {"L0000.H", "L0001.H", "L0000.KV"}
    publish(tier, short)  # fewer than what is stored: kept as it is
    tier.flush()
    assert tier.stores[0].header(short.key)[0].name_set == {"L0000.H", "L0001.H", "L0000.KV"}
    tier.drop_resident()
    publish(tier, short)  # the same, when the full one is only on disk
    tier.flush()
    assert tier.stores[0].header(short.key)[0].name_set == {"L0000.H", "L0001.H", "L0000.KV"}
    tier.close()


def test_pool_hits_renew_a_chunks_ttl_on_disk_and_across_a_restart(tmp_path):
    now = [time.time()]  # file times and the clock must agree: a restart reads the TTL from file times
    store = DiskChunkStore(tmp_path, ttl_s=60, fsync=False, clock=lambda: now[0])
    tier = HostTier([store], HostPool(4 * 64 * PAGE))
    for i in range(2):
        publish(tier, chunk(i))
    tier.flush()
    for _ in range(4):  # 0 is restored from the pool every 30 s, 1 never
        now[0] += 30
        assert tier.stored_prefix([chunk(0).key]) == 1
    tier.flush()
    tier.drop_resident()
    assert tier.stored_prefix([chunk(0).key]) == 1 and tier.stored_prefix([chunk(1).key]) == 0
    tier.close()
    reopened = DiskChunkStore(tmp_path, ttl_s=60, clock=lambda: now[0])
    assert reopened.keys() == [chunk(0).key]
    check_served(reopened, chunk(0).key, chunk(0))


@pytest.mark.parametrize("change", [b"appended", None])
def test_a_chunk_file_whose_length_changed_is_rewritten_by_the_next_write_back(tmp_path, change):
    """Header intact, length changed while the store is open: the write-back's check of what is stored
    must see it (issue 25), or the file stays on disk failing full verification."""
    tier = _tier(tmp_path, 4, readers=0)
    publish(tier, chunk(0))
    tier.flush()
    tier.drop_resident()
    path = tier.stores[0].path(chunk(0).key)
    data = path.read_bytes()
    path.write_bytes(data + change if change else data[:-100])
    publish(tier, chunk(0))  # saved again (by a restore that recomputed it, or a promotion)
    tier.flush()
    assert path.read_bytes() == data
    decode(path.read_bytes(), chunk(0).key)  # every checksum
    tier.close()


def test_a_watcher_sees_chunks_enter_the_pool_and_discards_but_not_pool_evictions(tmp_path):
    """What the vLLM scheduler's index is told: what the stores lost before it watched, with why; a saved
    chunk and one loaded from the disk are held; a chunk discarded is bad; one evicted from the pool alone
    is not reported (its store still holds it)."""
    tier = _tier(tmp_path, 2, readers=0)
    lost = chunk(3)
    tier.stores[0].put(lost.key, encode(lost))
    tier.stores[0].discard(lost.key)
    changes = []
    tier.watch(lambda key, loss: changes.append((key, loss)))
    tier.stores[0].put(chunk(0).key, encode(chunk(0)))
    tier.release(tier.fetch(chunk(0).key).result())
    for i in (1, 2):  # the pool holds two: the third publish evicts chunk 0
        publish(tier, chunk(i))
    tier.flush()
    assert not tier.resident(chunk(0).key)
    tier.discard(chunk(1).key)
    bad = Loss.FAILED_VERIFICATION
    assert changes == [
        (lost.key, bad),
        (chunk(0).key, None),
        (chunk(1).key, None),
        (chunk(2).key, None),
        (chunk(1).key, bad),
    ]
    tier.close()


@pytest.mark.parametrize("kind", [k for k in HEADER_PARSES if k != "flip_data"])
def test_a_write_back_replaces_a_stored_copy_whose_header_disagrees(tmp_path, kind):
    """Issue 42: a damaged file whose header still parses, with the tensor names of the chunk published,
    is no copy of it: the write-back rewrites it (a copy damaged in its rows alone is caught when read)."""
    tier = _tier(tmp_path, 8)
    store, c = tier.stores[0], chunk(0)
    store.put(c.key, encode(c))
    damage(store.path(c.key), kind, store.path(c.key))
    assert store.header(c.key)[0].name_set == {"L0000.H", "L0001.H"}  # what a write-back once compared
    publish(tier, c)
    tier.flush()
    check_served(store, c.key, c)
    tier.close()


def test_a_chain_is_written_back_in_order_so_a_quota_keeps_its_start(tmp_path, monkeypatch):
    """With two writers, a chunk's write must not reach the store before that of the chunk it continues:
    else the third of a chain can take the quota's room while the second is on its way, and the quota (which
    keeps a chain's start) refuses the second instead."""
    chain = [chunk(i) for i in range(3)]
    size = len(encode(chain[0]))
    tier = HostTier(
        [DiskChunkStore(tmp_path, quota_bytes=2 * size + size // 2, fsync=False)],
        HostPool(4 * -(-size // PAGE) * PAGE),
        writers=2,
    )
    order, put = [], tier.stores[0].put

    def slow_second(key, *a):
        if key == chain[1].key:
            time.sleep(0.3)  # the second chunk's writer is slower than the first's
        order.append(key)
        put(key, *a)

    monkeypatch.setattr(tier.stores[0], "put", slow_second)
    parent = ""
    for c in chain:
        image = tier.create(_layout_of(c), FINGERPRINT)
        for name, t in c.tensors.items():
            image.tensor(*name).copy_(t)
        tier.publish(image, c.key, c.tokens, parent=parent)
        parent = c.key
    tier.flush()
    assert order == [c.key for c in chain]
    assert [tier.stores[0].contains(c.key) for c in chain] == [True, True, False]
    assert tier.stores[0].gone(chain[2].key) is Loss.EVICTED
    tier.close()
