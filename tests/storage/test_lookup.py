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
        lookup = StoreConfig(shared=(str(shared), url)).lookup(local)
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


def test_a_lookup_stops_at_the_first_chunk_no_tier_holds(tmp_path, monkeypatch):
    """A prompt nobody stored costs one file look-up per directory and one question to Redis, not one per
    chunk: the scheduler asks for every new request."""
    from pathlib import Path

    chunks = [chunk_bytes(i) for i in range(6)]
    keys = [key for key, _ in chunks]
    owner = DiskChunkStore(tmp_path)
    try:
        owner.put(*chunks[0])
        lookup = StoreConfig().lookup([tmp_path])
        seen = []
        is_file = Path.is_file
        monkeypatch.setattr(Path, "is_file", lambda path: seen.append(path.name) or is_file(path))
        assert lookup.stored_prefix(keys) == 1 and len(seen) == 2  # the first, held; the second, not: the end
        seen.clear()
        assert lookup.stored_prefix(keys[1:]) == 0 and len(seen) == 1
    finally:
        owner.close()


def test_a_lookup_says_when_redis_did_not_answer(redis_server):
    lookup = StoreConfig(shared=(redis_server.url,)).lookup(None)
    try:
        assert lookup.stored_prefix(["ab" * 16]) == 0 and lookup.available
        redis_server.stop()
        assert lookup.stored_prefix(["ab" * 16]) == 0 and not lookup.available
    finally:
        lookup.close()
