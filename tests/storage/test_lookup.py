"""What a store holds, seen from a process that does not own it (vLLM's scheduler): the chunk files of the
local and shared directories and the Redis tiers, read while the owner holds the directory's lock."""
import uuid

from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.redis_store import RedisChunkStore
from hcache.storage.store_config import StoreConfig
from support.storage_chunks import chunk_bytes


def test_the_stored_prefix_is_found_across_directories_and_tiers_without_the_owners_lock(tmp_path, redis_url):
    local, shared = [tmp_path / "a", tmp_path / "b"], tmp_path / "shared"
    url = f"{redis_url}?namespace={uuid.uuid4().hex}"
    chunks = [chunk_bytes(i) for i in range(5)]
    keys = [key for key, _ in chunks]
    owner = DiskChunkStore(local)  # holds the directories' lock, as the worker does
    shared_store = DiskChunkStore(shared, shared=True)
    redis = RedisChunkStore.from_url(url)
    try:
        owner.put(*chunks[0])
        owner.put(*chunks[1])
        assert {owner.path(key).parents[2] for key in keys[:2]} == set(local)  # one in each local directory
        shared_store.put(*chunks[2])
        redis.put(keys[3], memoryview(chunks[3][1]))
        lookup = StoreConfig(tiers=(str(shared), url)).lookup(local)
        try:
            assert lookup.stored_prefix(keys) == 4  # the fifth is stored nowhere
            assert lookup.stored_prefix(keys[:2] + keys[4:] + keys[2:4]) == 2
            assert lookup.stored_prefix([]) == 0
            owner.discard(keys[1])
            assert lookup.stored_prefix(keys) == 1
        finally:
            lookup.close()
        assert StoreConfig().lookup(local).stored_prefix(keys) == 1  # the local directories alone
    finally:
        owner.close()
        shared_store.close()
        redis.close()
