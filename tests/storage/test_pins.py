"""A stored prefix held for a load to come (hcache/storage/pins.py): what was found stays found, through the
disk quota's evictions and the pool's, until it is let go."""

from support.storage_chunks import chunk, publish

from hcache.storage.chunk import encode
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.host_pool import PAGE, HostPool
from hcache.storage.host_tier import HostTier
from hcache.storage.pins import PinnedPrefix

KEYS = [chunk(i).key for i in range(9)]


def _tier(path) -> HostTier:
    """A pool of two chunks over a disk store whose quota holds three."""
    size = len(encode(chunk(0)))
    return HostTier([DiskChunkStore(path, fsync=False, quota_bytes=3 * size)], HostPool(2 * (-(-size // PAGE) * PAGE)))


def test_a_pinned_prefix_outlives_the_quota_and_the_pool_until_it_is_let_go(tmp_path):
    tier = _tier(tmp_path)
    disk = tier.stores[0]
    for i in range(2):
        publish(tier, chunk(i))
    tier.flush()
    tier.drop_resident()  # 0 and 1 on disk only, the least recently used there
    publish(tier, chunk(2))  # 2 in the pool too
    tier.flush()
    held = PinnedPrefix(tier, KEYS[:3])
    assert held.count == 3
    for i in range(3, 6):  # three more: the quota evicts its oldest, the pool its least recent
        publish(tier, chunk(i))
        tier.flush()
    assert disk.evictions and tier.evictions
    assert all(tier.contains(key) for key in KEYS[:3])  # 0 and 1 pinned on disk, 2 held in the pool (evicted from disk)
    assert tier.resident(KEYS[2]) and not disk.contains(KEYS[2])
    for i in range(3):
        image = tier.fetch(KEYS[i]).result()
        assert image.tokens == chunk(i).tokens
        tier.release(image)
    held.release()
    held.release()  # once is enough
    for i in range(6, 9):  # three more evict the three
        publish(tier, chunk(i))
        tier.flush()
    assert not disk.contains(KEYS[0]) and not disk.contains(KEYS[1])  # let go, and evicted as any other
    tier.close()


def test_a_pinned_prefix_ends_at_the_first_chunk_no_tier_holds(tmp_path):
    tier = _tier(tmp_path)
    for i in (0, 2):
        publish(tier, chunk(i))
    tier.flush()
    held = PinnedPrefix(tier, KEYS[:3])
    assert held.count == 1
    held.release()
    tier.close()
