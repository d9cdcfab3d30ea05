"""The DRAM tier in front of the disk store."""
import pytest
from storage_chunks import chunk, chunk_bytes, check_served

from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.dram_tier import DramTier


def test_dram_tier_serves_recent_chunks_from_memory_within_its_size(tmp_path):
    size = len(chunk_bytes(0)[1])
    disk = DiskChunkStore(tmp_path)
    tier = DramTier(disk, capacity_bytes=2 * size)
    for i in range(3):
        tier.put(*chunk_bytes(i))
    assert disk.keys() == tier.keys() == sorted(chunk(i).key for i in range(3))  # written through
    assert tier.used_bytes == 2 * size  # chunk 0 left DRAM, not the disk
    check_served(tier, chunk(2).key, chunk(2))
    assert (tier.hits, tier.misses) == (1, 0)
    # A disk-only chunk is served right, and promoted; the least recently used (1) leaves DRAM.
    disk.path(chunk(0).key).write_bytes(chunk_bytes(0)[1])
    check_served(tier, chunk(0).key, chunk(0))
    assert (tier.hits, tier.misses) == (1, 1)
    disk.path(chunk(1).key).unlink()  # proves 1 is no longer served from DRAM
    assert tier.open(chunk(1).key) is None
    for i in (0, 2):
        check_served(tier, chunk(i).key, chunk(i))
    assert tier.hits == 3


def test_dram_tier_discard_and_oversized_chunks(tmp_path):
    disk = DiskChunkStore(tmp_path)
    tier = DramTier(disk, capacity_bytes=100)  # smaller than any chunk: DRAM holds nothing
    tier.put(*chunk_bytes(0))
    assert tier.used_bytes == 0 and tier.contains(chunk(0).key)
    check_served(tier, chunk(0).key, chunk(0))
    tier.discard(chunk(0).key)
    assert not tier.contains(chunk(0).key) and tier.open(chunk(0).key) is None
    with pytest.raises(ValueError, match="capacity"):
        DramTier(disk, 0)


def test_file_served_from_dram_outlives_its_eviction(tmp_path):
    size = len(chunk_bytes(0)[1])
    tier = DramTier(DiskChunkStore(tmp_path), capacity_bytes=size)
    key, data = chunk_bytes(0)
    tier.put(key, data)
    f = tier.open(key)
    tier.put(*chunk_bytes(1))  # evicts 0 from DRAM while it is open
    assert tier.used_bytes == size and f.read() == data
