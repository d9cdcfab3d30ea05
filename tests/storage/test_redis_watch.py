"""A shared Redis server followed through its keyspace notifications, as a host tier tells it: another node's
writes placed in their chains, its deletes and the server's expiries, this node's writes in the server's order,
a lost connection, and servers that cannot be followed (one that will not notify, a cluster)."""

import logging
import time
import uuid

import pytest
from support.storage_chunks import chained, publish

from hcache.storage.chunk import Chunk, encode
from hcache.storage.chunk_store import Loss
from hcache.storage.host_pool import PAGE, HostPool
from hcache.storage.host_tier import HostTier
from hcache.storage.redis_store import RedisChunkStore
from hcache.storage.residency import HOST, Residency

REDIS = "redis"


def _ns(url: str) -> str:
    return f"{url}?namespace={uuid.uuid4().hex[:12]}"


def _follow(url: str) -> tuple[HostTier, list[Residency]]:
    size = -(-len(encode(chained(1)[0])) // PAGE) * PAGE
    tier, told = HostTier([RedisChunkStore.from_url(url)], HostPool(4 * size), readers=0), []
    tier.follow(told.append)
    return tier, told


def _held(c: Chunk, tier: str = REDIS) -> Residency:
    """``c`` held in ``tier``, with the layers it holds, read from its header as from its image."""
    return Residency(c.key, tier, True, tuple(c.tokens), c.parent, layers=frozenset(layer for layer, _ in c.tensors))


def _until(check, timeout_s: float = 10.0) -> None:
    """Notifications come on the watch's thread: wait for ``check()``, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not told in time"
        time.sleep(0.02)


def test_another_nodes_writes_are_told_with_their_chain_and_its_delete_as_a_loss(redis_url):
    url = _ns(redis_url)
    ours, told = _follow(url)
    theirs, chain = RedisChunkStore.from_url(url), chained(3, seed=11)
    for c in chain:
        theirs.put(c.key, memoryview(encode(c)), parent=c.parent)
    _until(lambda: len(told) == 3)
    assert told == [_held(c) for c in chain]  # read from each header, in the server's order
    theirs.discard(chain[2].key)
    _until(lambda: len(told) == 4)
    assert told[3] == Residency(chain[2].key, REDIS, False, why=Loss.EVICTED)
    assert ours.stores[0].gone(chain[2].key) is Loss.EVICTED  # a look-up's miss now says why
    theirs.close()
    ours.close()


def test_an_expiry_is_told_as_a_loss(redis_url):
    url = _ns(redis_url)
    ours, told = _follow(url)
    theirs, c = RedisChunkStore.from_url(url + "&ttl=0.3"), chained(1, seed=12)[0]
    theirs.put(c.key, memoryview(encode(c)))
    _until(lambda: Residency(c.key, REDIS, False, why=Loss.EVICTED) in told)
    assert told[0] == _held(c) and not theirs.contains(c.key)
    theirs.close()
    ours.close()


def test_this_nodes_writes_are_told_once_from_the_server_with_no_header_read(redis_url):
    ours, told = _follow(_ns(redis_url))
    store = ours.stores[0]
    chain = chained(2, seed=13)
    for c in chain:
        publish(ours, c)
    ours.flush()
    _until(lambda: sum(r.tier == REDIS for r in told) == 2)
    time.sleep(0.2)  # nothing more comes: the write-back's own word is not told twice
    assert [r for r in told if r.tier == REDIS] == [_held(c) for c in chain]
    assert told.index(_held(chain[0], HOST)) < told.index(_held(chain[0]))
    assert not store._written  # each write's header was kept until its notification, not read back
    ours.close()


def test_a_lost_connection_tells_every_chunk_it_told_as_no_longer_known_then_follows_again(redis_server):
    ours, told = _follow(f"{redis_server.url}?backoff=0.1&timeout=0.5")
    theirs, (first, second) = RedisChunkStore.from_url(redis_server.url), chained(2, seed=14)
    theirs.put(first.key, memoryview(encode(first)))
    _until(lambda: told == [_held(first)])
    redis_server.stop()
    _until(lambda: Residency(first.key, REDIS, False) in told)  # why: None, not known
    redis_server.start()  # the same port, empty, notifications off again: the watch turns them on
    # what is written before it is back goes unseen: write until it is seen
    _until(lambda: theirs.put(second.key, memoryview(encode(second))) or _held(second) in told)
    theirs.close()
    ours.close()


def test_a_server_that_will_not_notify_is_not_told_and_says_why(caplog):
    from hcache.storage.redis_server import RedisServer, redis_missing

    if why := redis_missing():
        pytest.skip(why)
    with RedisServer(options=["--rename-command", "CONFIG", '""']) as server:  # as managed servers often are
        with caplog.at_level(logging.WARNING, logger="hcache.storage.redis_store"):
            ours, told = _follow(server.url)
        assert "notify-keyspace-events" in caplog.text
        c = chained(1, seed=15)[0]
        publish(ours, c)
        ours.flush()
        assert ours.stores[0].contains(c.key)
        assert told == [_held(c, HOST)]  # stored, not told: its loss could not be
        ours.close()


def test_a_cluster_is_not_followed_and_says_why(redis_cluster_url, caplog):
    with caplog.at_level(logging.WARNING, logger="hcache.storage.redis_store"):
        ours, told = _follow(_ns(redis_cluster_url))
    assert "cluster" in caplog.text
    c = chained(1, seed=16)[0]
    publish(ours, c)
    ours.flush()
    assert ours.stores[0].contains(c.key) and told == [_held(c, HOST)]
    ours.close()
