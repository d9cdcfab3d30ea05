"""The Redis chunk store against real servers (standalone and a 3-master cluster): one value per chunk,
verified when it enters the host pool, tiers below the pool with promotion, namespaces, and failures that
are misses."""

import logging
import time
import uuid

import pytest
import redis
from support.storage_chunks import check_bytes, check_image, chunk, publish, read_back

from hcache.errors import StorageError
from hcache.storage.chunk import ChunkInvalid, encode
from hcache.storage.chunk_store import Loss
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.host_tier import HostTier
from hcache.storage.redis_store import RedisChunkStore
from hcache.storage.host_pool import PAGE, HostPool


@pytest.fixture(params=["standalone", "cluster"])
def url(request):
    """A fresh namespace on the session's standalone server or cluster."""
    base = request.getfixturevalue("redis_url" if request.param == "standalone" else "redis_cluster_url")
    return f"{base}?namespace={uuid.uuid4().hex[:12]}"


def _tier(stores, chunks_in_pool: int = 4, **kw) -> HostTier:
    size = -(-len(encode(chunk(0))) // PAGE) * PAGE
    return HostTier(stores, HostPool(chunks_in_pool * size), **kw)


def test_chunks_round_trip_whole_and_are_listed_and_deleted(url):
    store = RedisChunkStore.from_url(url + "&ttl=60")
    keys = [chunk(i).key for i in range(3)]
    for i in range(3):
        store.put(keys[i], memoryview(encode(chunk(i))))
    assert store.contains_many(keys + ["ee" * 16]) == [True, True, True, False]
    assert store.keys() == sorted(keys)
    for i in range(3):
        check_bytes(read_back(store, keys[i]), keys[i], chunk(i))
    assert store.header(keys[0])[0].name_set == {"L0000.H", "L0001.H"}
    assert store.header("ee" * 16) is None and read_back(store, "ee" * 16) is None
    store.discard(keys[0])
    assert not store.contains(keys[0]) and store.keys() == sorted(keys[1:])
    assert store.gone(keys[0]) == Loss.FAILED_VERIFICATION and store.losses() == [(keys[0], Loss.FAILED_VERIFICATION)]
    store.put(keys[0], memoryview(encode(chunk(0))))  # stored again: no longer lost
    assert store.gone(keys[0]) is None
    assert store.stats()["errors"] == 0
    store.close()


def test_values_expire_unless_read(redis_url):
    store = RedisChunkStore.from_url(f"{redis_url}?namespace=ttl-{uuid.uuid4().hex[:8]}&ttl=1")
    key = chunk(0).key
    store.put(key, memoryview(encode(chunk(0))))
    for _ in range(3):  # each read renews the TTL: 1.2 s in all, longer than one TTL
        time.sleep(0.4)
        assert read_back(store, key) is not None
    time.sleep(1.5)
    assert not store.contains(key)


def test_a_touch_renews_a_values_ttl(redis_url):
    """Host-pool hits passed down: a value the pool keeps serving does not expire below it."""
    namespace = f"touch-{uuid.uuid4().hex[:8]}"
    store = RedisChunkStore.from_url(f"{redis_url}?namespace={namespace}&ttl=2")
    key, name = chunk(0).key, f"hcache:{namespace}:{chunk(0).key}"
    store.put(key, memoryview(encode(chunk(0))))
    client = redis.Redis.from_url(redis_url)
    time.sleep(0.5)
    assert client.pttl(name) <= 1600
    store.touch([key, "ee" * 16])
    assert client.pttl(name) > 1800
    without_ttl = RedisChunkStore.from_url(f"{redis_url}?namespace={namespace}")
    without_ttl.touch([key])  # the server's LRU order
    assert store.stats()["errors"] == without_ttl.stats()["errors"] == 0
    client.close()


def test_namespaces_and_prefixes_keep_deployments_apart(url):
    a = RedisChunkStore.from_url(url)
    b = RedisChunkStore.from_url(url.replace("namespace=", "namespace=other"))
    c = RedisChunkStore.from_url(url + "&prefix=elsewhere")
    a.put(chunk(0).key, memoryview(encode(chunk(0))))
    assert a.contains(chunk(0).key) and not b.contains(chunk(0).key) and not c.contains(chunk(0).key)
    assert b.keys() == [] and c.keys() == []


def test_a_chunk_found_only_below_is_served_and_promoted_to_the_tiers_above(url, tmp_path):
    shared = RedisChunkStore.from_url(url)
    shared.put(chunk(0).key, memoryview(encode(chunk(0))))
    tier = _tier([DiskChunkStore(tmp_path, fsync=False), shared], readers=1)
    assert tier.stored_prefix([chunk(0).key, chunk(1).key]) == 1
    image = tier.fetch(chunk(0).key).result(timeout=10)
    check_image(image, chunk(0))
    tier.release(image)
    tier.flush()
    check_bytes(read_back(tier.stores[0], chunk(0).key), chunk(0).key, chunk(0))  # promoted to the disk
    publish(tier, chunk(1))  # saved: written to every tier
    tier.flush()
    assert tier.stores[0].contains(chunk(1).key) and shared.contains(chunk(1).key)
    tier.close()


def test_a_corrupt_value_is_refused_on_entry_and_dropped(url):
    store = RedisChunkStore.from_url(url)
    data = bytearray(encode(chunk(0)))
    data[-3] ^= 0xFF
    store.put(chunk(0).key, memoryview(data))
    tier = _tier([store], readers=0)
    with pytest.raises(ChunkInvalid):
        tier.fetch(chunk(0).key).result()
    assert not store.contains(chunk(0).key)
    tier.close()


def test_a_value_of_another_type_is_a_bad_chunk_replaced_not_a_server_failure(redis_url):
    """Issue 25: a list under a chunk's key made the tier back off and was never replaced."""
    namespace = f"type-{uuid.uuid4().hex[:8]}"
    store = RedisChunkStore.from_url(f"{redis_url}?namespace={namespace}")
    tier = _tier([store], readers=0)
    key, name = chunk(0).key, f"hcache:{namespace}:{chunk(0).key}"
    client = redis.Redis.from_url(redis_url)
    client.rpush(name, b"not a chunk")
    publish(tier, chunk(0))  # the write-back finds no chunk there, and writes one
    tier.flush()
    check_bytes(read_back(store, key), key, chunk(0))
    client.delete(name)
    client.rpush(name, b"not a chunk")
    tier.drop_resident()
    with pytest.raises(ChunkInvalid, match="not a string"):
        tier.fetch(key).result()
    assert not client.exists(name)  # discarded, so the next save writes it
    publish(tier, chunk(0))
    tier.flush()
    check_bytes(read_back(store, key), key, chunk(0))
    assert store.stats()["errors"] == store.stats()["skipped"] == 0
    tier.close()
    client.close()


def test_a_dead_server_is_a_miss_counted_and_logged_once(redis_server, caplog):
    store = RedisChunkStore.from_url(f"{redis_server.url}?backoff=0&timeout=0.5")
    store.put(chunk(0).key, memoryview(encode(chunk(0))))
    redis_server.stop()
    tier = _tier([store], readers=0)
    with caplog.at_level(logging.WARNING, logger="hcache.storage.redis_store"):
        for _ in range(5):
            assert tier.stored_prefix([chunk(0).key]) == 0
            assert tier.fetch(chunk(0).key).result() is None
    assert store.stats()["errors"] == 10
    assert len([r for r in caplog.records if r.name == "hcache.storage.redis_store"]) == 1
    publish(tier, chunk(1))  # its write fails: the chunk stays restorable from the pool
    tier.flush()
    assert tier.write_errors == 1
    image = tier.fetch(chunk(1).key).result()
    check_image(image, chunk(1))
    tier.release(image)
    tier.close()


def test_a_slow_server_costs_one_timeout_then_is_left_alone_for_the_backoff(redis_server):
    store = RedisChunkStore.from_url(f"{redis_server.url}?timeout=0.2&backoff=30")
    assert not store.contains(chunk(0).key)  # connects
    redis.Redis.from_url(redis_server.url).execute_command("CLIENT", "PAUSE", "3000")
    began = time.perf_counter()
    assert not store.contains(chunk(0).key)
    first = time.perf_counter() - began
    began = time.perf_counter()
    assert store.contains_many([chunk(i).key for i in range(4)]) == [False] * 4
    assert first >= 0.2 and time.perf_counter() - began < 0.1
    assert store.stats()["errors"] == 1 and store.stats()["skipped"] == 1


def test_a_server_restarted_empty_gives_misses_not_errors(redis_server):
    store = RedisChunkStore.from_url(redis_server.url)
    store.put(chunk(0).key, memoryview(encode(chunk(0))))
    assert store.contains(chunk(0).key)
    redis_server.stop()
    redis_server.start()  # the same port, nothing kept
    assert not store.contains(chunk(0).key) and read_back(store, chunk(0).key) is None
    store.put(chunk(1).key, memoryview(encode(chunk(1))))
    assert store.contains(chunk(1).key) and store.stats()["errors"] == 0


def test_a_full_server_refuses_writes_and_the_pool_keeps_the_chunk(tmp_path):
    from hcache.storage.redis_server import RedisServer, redis_missing

    if why := redis_missing():
        pytest.skip(why)
    with RedisServer(maxmemory="1mb") as server:
        store = RedisChunkStore.from_url(server.url)
        big = chunk(0, width=4096)  # 2 MiB: more than the server may hold
        tier = HostTier([store], HostPool(4 << 20), readers=0)
        publish(tier, big)
        tier.flush()
        assert tier.write_errors == 1 and not store.contains(big.key)
        image = tier.fetch(big.key).result()
        check_image(image, big)
        tier.release(image)
        tier.close()


@pytest.mark.parametrize(
    "bad",
    [
        "redis://",
        "redis://h:1/0?ttl=-1",
        "redis://h:1/0?nope=1",
        "redis://h:1/0?timeout=x",
        "redis+cluster://h:1,h2",
        "redis://h:1/0?namespace=a:b",
    ],
)
def test_bad_urls_are_refused_before_anything_connects(bad):
    with pytest.raises(StorageError):
        RedisChunkStore.from_url(bad)
