"""Two serving nodes, one history: node A (a process of its own) saves, node B (this process) restores
what A saved through a shared store, with tokens identical to recompute; a shared store that fails or lies
costs a recompute, never a wrong token."""

import json
import subprocess
import sys
import uuid

import pytest
import redis
from support import SUPPORT
from support.helpers import loaded, random_prompt

from hcache.serving.runtime import HCacheRuntime
from hcache.storage.store_config import StoreConfig

MODEL = "random:llama"
NEW_TOKENS = 4


def _node_a(shared: list[str], store_dir, prompts: list[list[int]]) -> list[dict]:
    config = {
        "model": MODEL,
        "store_dir": str(store_dir),
        "shared": shared,
        "prompts": prompts,
        "new_tokens": NEW_TOKENS,
    }
    script = SUPPORT / "shared_node.py"
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(config)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def shared_store(request, tmp_path):
    kind = request.param
    if kind == "shared-dir":
        return str(tmp_path / "shared")
    base = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster_url")
    return f"{base}?namespace={uuid.uuid4().hex[:12]}"


# A redis-server or a Redis Cluster started for the test makes it slow (pytest.ini), as the fixtures that
# start them mark a test that names them (tests/conftest.py); the fixture here takes them by name at run time.
@pytest.mark.parametrize(
    "shared_store",
    [
        pytest.param("redis", marks=pytest.mark.slow),
        pytest.param("redis-cluster", marks=pytest.mark.slow),
        "shared-dir",
    ],
    indirect=True,
)
def test_node_b_restores_what_node_a_saved(shared_store, tmp_path, rng, request):
    kind = request.node.callspec.params["shared_store"]
    prompt = random_prompt(200, 256, rng)
    saved = _node_a([shared_store], tmp_path / "a", [prompt])[0]
    assert saved["restored_tokens"] == 0
    store = StoreConfig(shared=(shared_store,), fsync=False)
    with HCacheRuntime(loaded(MODEL), tmp_path / "b", store=store) as b:
        result = b.generate(prompt, NEW_TOKENS)
        assert result.restored_tokens == 192 and result.fallback is None
        assert result.tier_tokens == {"shared_disk" if kind == "shared-dir" else "redis": 192}
        assert result.output_ids == saved["output_ids"] == b.generate(prompt, NEW_TOKENS, restore=False).output_ids
        b.store.flush()
        assert len(b.store.stores[0].keys()) >= 3  # promoted to B's own disk
        # another tenant on the same shared store finds nothing of A's
        assert b.generate(prompt, NEW_TOKENS, namespace="tenant-b").restored_tokens == 0


def _restore_again(runtime: HCacheRuntime, prompt: list[int]):
    """Serve ``prompt`` with the host pool emptied first, so that the restore must read the shared store."""
    runtime.store.flush()
    runtime.store.drop_resident()
    return runtime.generate(prompt, NEW_TOKENS)


def test_a_redis_killed_mid_run_turns_restores_into_recomputes(redis_server, rng):
    llama = loaded(MODEL)
    prompts = [random_prompt(150, 256, rng) for _ in range(2)]
    with HCacheRuntime(llama, None, store=StoreConfig(shared=(redis_server.url,))) as runtime:
        expected = [runtime.generate(p, NEW_TOKENS, restore=False).output_ids for p in prompts]
        assert _restore_again(runtime, prompts[0]).restored_tokens == 128
        redis_server.stop()
        for p, want in zip(prompts, expected):
            result = _restore_again(runtime, p)
            assert result.restored_tokens == 0 and result.output_ids == want
        assert runtime.store.stats()["stores"][0]["errors"] >= 1


def test_a_corrupt_value_in_redis_falls_back_with_identical_tokens(redis_url, rng):
    url = f"{redis_url}?namespace={uuid.uuid4().hex[:12]}"
    prompt = random_prompt(150, 256, rng)
    with HCacheRuntime(loaded(MODEL), None, store=StoreConfig(shared=(url,))) as runtime:
        expected = runtime.generate(prompt, NEW_TOKENS).output_ids
        runtime.store.flush()
        client = redis.Redis.from_url(redis_url)
        name = next(k for k in client.scan_iter(match=f"hcache:{url.rpartition('=')[2]}:*"))
        value = bytearray(client.get(name))
        value[-5] ^= 0xFF  # inside the last tensor: only its checksum can tell
        client.set(name, bytes(value))
        result = _restore_again(runtime, prompt)
        assert result.output_ids == expected and result.fallback is not None
        runtime.store.flush()
        assert client.get(name) != bytes(value)  # dropped, and saved again whole by the recompute
        assert _restore_again(runtime, prompt).restored_tokens == 128


def test_a_redis_restarted_empty_gives_misses_and_no_errors(redis_server, rng):
    prompt = random_prompt(150, 256, rng)
    with HCacheRuntime(loaded(MODEL), None, store=StoreConfig(shared=(redis_server.url,))) as runtime:
        expected = runtime.generate(prompt, NEW_TOKENS).output_ids
        runtime.store.flush()
        redis_server.stop()
        redis_server.start()
        result = _restore_again(runtime, prompt)
        assert result.restored_tokens == 0 and result.output_ids == expected and result.fallback is None
        assert runtime.store.stats()["stores"][0]["errors"] == 0
        again = _restore_again(runtime, prompt)
        assert again.restored_tokens == 128 and again.tier_tokens == {"redis": 128}  # saved again, to the new server
        assert runtime.generate(prompt, NEW_TOKENS).tier_tokens == {"host": 128}  # in the pool since
