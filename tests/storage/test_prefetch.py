"""Look-ahead prefetch against a real host tier over a disk store: it loads the leading stored chunks into
the pool and lets go of them, records the read time a restore then finds hidden, and keeps at most
``MAX_TRACKED`` load records."""

import threading

from support.storage_chunks import check_image, chunk, publish

from hcache.storage import prefetch as prefetch_module
from hcache.storage.chunk import encode
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.host_pool import PAGE, HostPool
from hcache.storage.host_tier import HostTier
from hcache.storage.prefetch import Prefetcher


def _tier(path, on_disk: int, readers: int = 0, chunks_in_pool: int = 8) -> HostTier:
    """A tier whose store holds chunks 0 .. on_disk-1, none of them in the pool yet."""
    size = -(-len(encode(chunk(0))) // PAGE) * PAGE
    tier = HostTier([DiskChunkStore(path, fsync=False)], HostPool(chunks_in_pool * size), readers=readers)
    for i in range(on_disk):
        tier.stores[0].put(chunk(i).key, encode(chunk(i)))
    return tier


def test_prefetch_loads_the_leading_stored_chunks_into_the_pool_and_holds_none(tmp_path):
    tier = _tier(tmp_path, 3)
    prefetcher = Prefetcher(tier)
    keys = [chunk(0).key, chunk(1).key, "ee" * 16, chunk(2).key]  # the third is stored nowhere: the prefix ends there
    assert prefetcher.prefetch(keys) == 2 and prefetcher.chunks == 2
    assert [tier.resident(chunk(i).key) for i in range(3)] == [True, True, False]
    assert tier.bytes_loaded == 2 * len(encode(chunk(0)))
    assert tier.drop_resident() == 2  # nothing references them: a running restore may have their memory
    assert tier.pool.used_bytes == 0
    tier.close()


def test_a_restore_then_reads_the_prefetched_chunk_from_memory(tmp_path):
    tier = _tier(tmp_path, 1)
    Prefetcher(tier).prefetch([chunk(0).key])
    loaded = tier.bytes_loaded
    image = tier.fetch(chunk(0).key).result()
    check_image(image, chunk(0))
    assert tier.hits == 1 and tier.bytes_loaded == loaded  # no second read
    assert tier.take_source(image) == "disk"  # credited to the store it was read from, by the prefetch
    tier.release(image)
    tier.close()


def test_chunks_in_memory_or_being_loaded_are_not_loaded_again(tmp_path):
    tier = _tier(tmp_path, 3)
    publish(tier, chunk(5))  # saved here: in the pool already
    prefetcher = Prefetcher(tier)
    assert prefetcher.prefetch([chunk(5).key, chunk(0).key]) == 1
    assert prefetcher.prefetch([chunk(0).key, chunk(1).key]) == 1  # 0 is tracked already: only 1 starts
    assert prefetcher.chunks == 2 and tier.misses == 2
    tier.close()


def test_hidden_time_is_the_read_that_ran_before_the_restore_and_is_reported_once(tmp_path):
    tier = _tier(tmp_path, 2, readers=1)
    gate, started, read = threading.Event(), threading.Event(), tier.stores[0].read_into

    def slow_read(key, take):
        if key == chunk(1).key:
            started.set()
            gate.wait(5)
        return read(key, take)

    tier.stores[0].read_into = slow_read
    prefetcher = Prefetcher(tier)
    assert prefetcher.prefetch([chunk(0).key, chunk(1).key]) == 2
    assert started.wait(5)
    threading.Event().wait(0.2)  # chunk 1's read is in flight for at least this long
    in_flight = prefetcher.hidden([chunk(1).key])  # its restore begins now: what ran so far was hidden
    assert 0.2 <= in_flight < 5
    assert prefetcher.hidden([chunk(1).key]) == 0.0  # forgotten once reported
    gate.set()
    tier.release(
        tier.fetch(chunk(1).key).result(timeout=5)
    )  # the restore waits on the prefetch's load, not a read of its own
    done = prefetcher.hidden([chunk(0).key])
    assert 0 < done < in_flight  # a finished load counts its whole read, however long ago it ended
    assert prefetcher.hidden(["ee" * 16]) == 0.0  # never prefetched: nothing hidden
    assert tier.bytes_loaded == 2 * len(encode(chunk(0)))
    tier.close()


def test_a_load_that_fails_raises_nothing_and_holds_nothing(tmp_path):
    tier = _tier(tmp_path, 0)
    data = bytearray(encode(chunk(0)))
    data[-3] ^= 0xFF  # a bad checksum
    tier.stores[0].put(chunk(0).key, bytes(data))
    prefetcher = Prefetcher(tier)
    assert prefetcher.prefetch([chunk(0).key]) == 1  # started; its failure is not the prefetcher's to raise
    assert not tier.resident(chunk(0).key) and tier.pool.used_bytes == 0
    assert prefetcher.hidden([chunk(0).key]) > 0  # the read was still made
    assert tier.fetch(chunk(0).key).result() is None  # found bad and discarded: the restore recomputes it
    tier.close()


def test_at_most_max_tracked_loads_are_remembered_the_oldest_forgotten_first(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch_module, "MAX_TRACKED", 2)
    tier = _tier(tmp_path, 3)
    prefetcher = Prefetcher(tier)
    assert prefetcher.prefetch([chunk(i).key for i in range(3)]) == 3
    assert prefetcher.hidden([chunk(0).key]) == 0.0  # its record was dropped for the newer ones
    assert prefetcher.hidden([chunk(1).key]) > 0 and prefetcher.hidden([chunk(2).key]) > 0
    tier.drop_resident()
    assert prefetcher.prefetch([chunk(0).key]) == 1  # forgotten, and gone from the pool: loaded again
    tier.close()
