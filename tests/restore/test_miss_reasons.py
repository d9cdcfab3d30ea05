"""Miss reasons (issue 34, part 1): each way a stored prefix can end early, forced on a real store, and what
is reported for it: the request's ``miss_tokens``, its request-log line, the response's ``hcache`` object
made from that record (carried to a live server's client in tests/openai), and the Prometheus counter."""

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from support.damage import KINDS, RESIZED, damage
from support.helpers import corrupt_tensor, loaded, random_prompt

from hcache.model.tensor_parallel import TPGroup
from hcache.restore.records import MissReason, SequenceRecord
from hcache.restore.miss_reasons import anchor_label, first_chunk_miss
from hcache.serving.runtime import HCacheRuntime
from hcache.storage.anchor_log import AnchorLog
from hcache.storage.chunk_key import CHUNK_TOKENS, LAYOUT_VERSION, KeyChain, chunk_keys, content_key, root_key
from hcache.storage.command import verify

CHUNKS = 3
PROMPT = CHUNKS * CHUNK_TOKENS + 10  # three full chunks and a tail that is never stored


@pytest.fixture(scope="module")
def llama():
    return loaded("random:llama")


def _prompt(llama) -> list[int]:
    return random_prompt(PROMPT, llama.spec.vocab_size, torch.Generator().manual_seed(7))


@pytest.fixture
def prompt(llama):
    return _prompt(llama)


def _turn(runtime: HCacheRuntime, prompt: list[int], **kw):
    return runtime.generate(prompt, 2, stop_token_ids=set(), **kw)


def _reported(
    runtime: HCacheRuntime, log, result, expected: dict[str, int], told: dict[str, int] | None = None
) -> None:
    """The request, its log line and the counters all say ``expected``; the response's ``hcache`` object
    (made from the record the log line writes out) says ``told`` (by default, the same)."""
    assert result.miss_tokens == expected
    assert all(type(reason) is MissReason for reason in result.miss_tokens)  # carried as a type, printed as a word
    logged = json.loads(log.read_text().splitlines()[-1])
    assert logged["miss_tokens"] == expected
    fields = ("restored_tokens", "gpu_tokens", "tier_tokens", "miss_tokens", "plan", "lossy")
    assert SequenceRecord(**{name: logged[name] for name in fields}).reply()["miss_tokens"] == (
        expected if told is None else told
    )
    counters = runtime.metrics.snapshot()  # the reason a test forces is met once in its runtime
    for reason, tokens in expected.items():
        assert counters[f'hcache_miss_tokens_total{{reason="{reason}"}}'] == tokens
    assert {f'hcache_miss_tokens_total{{reason="{r.value}"}}' for r in MissReason} <= counters.keys()


def _cold(runtime: HCacheRuntime) -> None:
    """Nothing of the store left in memory: the next restore reads the chunk files."""
    runtime.store.flush()
    runtime.store.drop_resident()


def _chunk_file(store_dir, key: str):
    [path] = store_dir.glob(f"chunks/*/{key}.safetensors")
    return path


def test_a_first_turn_misses_every_full_chunk_as_never_stored(llama, prompt, tmp_path, caplog):
    log = tmp_path / "requests.jsonl"
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", request_log=str(log)) as runtime:
        with caplog.at_level("INFO", logger="hcache.serving.engine"):  # what -v shows
            first = _turn(runtime, prompt)
        _reported(runtime, log, first, {"never_stored": CHUNKS * CHUNK_TOKENS})
        assert any(
            f"{CHUNKS * CHUNK_TOKENS} stored-prefix tokens missed: never_stored" in r.getMessage()
            for r in caplog.records
        )
        assert runtime.metrics.snapshot()['hcache_miss_tokens_total{reason="never_stored"}'] == CHUNKS * CHUNK_TOKENS
        again = _turn(runtime, prompt)
    assert again.restored_tokens == CHUNKS * CHUNK_TOKENS and again.miss_tokens == {}


def test_a_chunk_the_quota_evicted_is_reported_evicted(llama, prompt, tmp_path):
    with HCacheRuntime(llama, tmp_path / "sizing", plan="KV") as runtime:
        _turn(runtime, prompt)
    size = max(p.stat().st_size for p in (tmp_path / "sizing").glob("chunks/*/*.safetensors"))
    log = tmp_path / "requests.jsonl"
    quota = {"quota_bytes": 2 * size + size // 2}  # two of the three chunks
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", request_log=str(log), store=quota) as runtime:
        _turn(runtime, prompt)
        _cold(runtime)
        second = _turn(runtime, prompt)
        # The chain's start is kept: the quota refuses the third chunk rather than evict the two it continues.
        assert second.restored_tokens == (CHUNKS - 1) * CHUNK_TOKENS
        _reported(runtime, log, second, {"evicted": CHUNK_TOKENS})


def test_a_corrupt_chunk_is_reported_failed_verification(llama, prompt, tmp_path):
    log = tmp_path / "requests.jsonl"
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", request_log=str(log)) as runtime:
        _turn(runtime, prompt)
        _cold(runtime)
        corrupt_tensor(runtime.store, chunk_keys(prompt, root_key(runtime.fingerprint))[1], 0, "KV")
        second = _turn(runtime, prompt)
        _reported(runtime, log, second, {"failed_verification": (CHUNKS - 1) * CHUNK_TOKENS})
    assert second.restored_tokens == CHUNK_TOKENS


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    """The prompt's first turn saved once for the module: its store (copied by each test that damages it),
    its chunk keys and its reply."""
    store, prompt = tmp_path_factory.mktemp("saved") / "store", _prompt(llama)
    with HCacheRuntime(llama, store, plan="KV") as runtime:
        first = _turn(runtime, prompt)
        keys = chunk_keys(prompt, root_key(runtime.fingerprint))
    assert first.miss_tokens == {"never_stored": CHUNKS * CHUNK_TOKENS}
    return store, keys, first.output_ids


@pytest.mark.parametrize("when", ["cold", "warm"])
@pytest.mark.parametrize("kind", KINDS + RESIZED)
def test_a_damaged_chunk_file_is_failed_verification_and_replaced(llama, prompt, saved, tmp_path, kind, when):
    """Issue 42: however a chunk file is damaged, found at start-up (``cold``: the store opens on it) or on
    a read (``warm``: indexed before the damage), its miss is ``failed_verification``, the reply is
    recompute's, and the next write-back leaves a file that verifies. Issue 67: a header rewritten at
    another length that it describes (``resized``) was taken warm for another writer's chunk and reported
    ``evicted``. The first turn is saved once (:func:`saved`) and its store copied here; the runtime's start-up
    self-check, which runs in a store of its own, is left to the tests of it."""
    log, store, (saved_store, keys, first_output) = tmp_path / "requests.jsonl", tmp_path / "store", saved
    shutil.copytree(saved_store, store)

    def damaged() -> None:
        damage(_chunk_file(store, keys[1]), kind, _chunk_file(store, keys[2]))

    if when == "cold":
        damaged()
    runtime = HCacheRuntime(llama, store, plan="KV", request_log=str(log), self_check="off")
    try:
        if when == "warm":  # every chunk indexed by the store as it opened, none of it in memory
            _cold(runtime)
            damaged()
        second = _turn(runtime, prompt)
        assert second.output_ids == first_output
        _reported(runtime, log, second, {"failed_verification": (CHUNKS - 1) * CHUNK_TOKENS})
        runtime.store.flush()
    finally:
        runtime.close()
    assert verify(store, repair=False) == 0 and all(_chunk_file(store, key) for key in keys)


def test_a_chunk_of_another_layout_version_is_reported_other_version(llama, prompt, tmp_path):
    log, store = tmp_path / "requests.jsonl", tmp_path / "store"
    with HCacheRuntime(llama, store, plan="KV", request_log=str(log)) as runtime:
        _turn(runtime, prompt)
        _cold(runtime)
        path = _chunk_file(store, chunk_keys(prompt, root_key(runtime.fingerprint))[1])
        old, new = f'"layout_version":"{LAYOUT_VERSION}"'.encode(), f'"layout_version":"{LAYOUT_VERSION + 1}"'.encode()
        image = path.read_bytes()
        assert image.count(old) == 1
        path.write_bytes(image.replace(old, new))  # a newer hcache's chunk, met on the read path
        second = _turn(runtime, prompt)
        _reported(runtime, log, second, {"other_version": (CHUNKS - 1) * CHUNK_TOKENS})
        runtime.store.flush()
        assert runtime.store.write_errors == 1  # the recompute's save of that chunk, refused
    assert path.read_bytes() == image.replace(old, new)  # issue 67: left alone, not overwritten


def test_a_chunk_saved_without_the_plans_format_is_reported_other_settings(llama, prompt, tmp_path):
    log = tmp_path / "requests.jsonl"
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", request_log=str(log)) as runtime:  # saves KV only
        _turn(runtime, prompt)
        second = _turn(runtime, prompt, plan="H")
        _reported(runtime, log, second, {"other_settings": CHUNKS * CHUNK_TOKENS})


def test_a_shared_store_that_is_down_is_reported_tier_unavailable(llama, prompt, tmp_path, redis_server):
    log, shared = tmp_path / "requests.jsonl", {"shared": [redis_server.url]}
    with HCacheRuntime(llama, None, plan="KV", request_log=str(log), store=shared) as runtime:  # Redis alone
        _turn(runtime, prompt)
        _cold(runtime)
        redis_server.stop()
        second = _turn(runtime, prompt)
        _reported(runtime, log, second, {"tier_unavailable": CHUNKS * CHUNK_TOKENS})
    assert second.restored_tokens == 0


def test_a_plan_that_recomputes_every_layer_is_reported(llama, prompt, tmp_path):
    log = tmp_path / "requests.jsonl"
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", request_log=str(log)) as runtime:
        _turn(runtime, prompt)
        second = _turn(runtime, prompt, plan="RE")
        _reported(runtime, log, second, {"plan_recompute": CHUNKS * CHUNK_TOKENS})


def test_a_prefix_stored_under_another_cache_salt_is_reported_but_not_told_to_the_client(llama, prompt, tmp_path):
    log, store = tmp_path / "requests.jsonl", tmp_path / "store"
    with HCacheRuntime(llama, store, plan="KV", request_log=str(log)) as runtime:
        _turn(runtime, prompt, namespace="alice")
        other = _turn(runtime, prompt, namespace="bob")
        # bob learns nothing of alice
        _reported(
            runtime,
            log,
            other,
            {"other_cache_salt": CHUNKS * CHUNK_TOKENS},
            told={"never_stored": CHUNKS * CHUNK_TOKENS},
        )
    with HCacheRuntime(llama, store, plan="KV", request_log=str(log)) as runtime:  # the anchor log outlives the server
        again = _turn(runtime, prompt, namespace="carol")
        assert again.miss_tokens == {"other_cache_salt": CHUNKS * CHUNK_TOKENS}
        assert _turn(runtime, prompt, namespace="alice").restored_tokens == CHUNKS * CHUNK_TOKENS


def test_a_prefix_stored_under_another_model_is_reported_other_model(llama, prompt, tmp_path):
    log, store = tmp_path / "requests.jsonl", tmp_path / "store"
    with HCacheRuntime(llama, store, plan="KV") as runtime:
        _turn(runtime, prompt)
    retrained = dataclasses.replace(llama, model=copy.deepcopy(llama.model))
    with torch.no_grad():
        next(retrained.model.parameters()).add_(0.01)  # other weights: another fingerprint
    with HCacheRuntime(retrained, store, plan="KV", request_log=str(log)) as runtime:
        other = _turn(runtime, prompt)
        _reported(
            runtime, log, other, {"other_model": CHUNKS * CHUNK_TOKENS}, told={"never_stored": CHUNKS * CHUNK_TOKENS}
        )


def test_a_first_chunk_stored_at_another_tensor_parallel_size_is_other_layout(tmp_path):
    """A rank's keys are rooted in its own fingerprint: a store of another size holds the same turn under
    other keys. The anchor logs of the other layouts, consulted, tell it apart from a model's or a
    namespace's, and are never written."""
    tokens, never = list(range(CHUNK_TOKENS)), {"never_stored": CHUNK_TOKENS}
    tp1 = tmp_path / "tp1.log"
    AnchorLog(tp1).add(content_key(tokens), anchor_label("model", "alice"))
    written = tp1.read_bytes()
    anchors = AnchorLog(tmp_path / "own.log", consult=[tp1, tmp_path / "absent.log"])
    rank1 = TPGroup(1, 2).fingerprint("model")

    def miss(fingerprint: str, namespace: str) -> dict[str, int]:
        return first_chunk_miss(
            anchors,
            anchor_label(fingerprint, namespace),
            KeyChain(root_key(fingerprint, namespace)),
            tokens,
            dict(never),
        )

    assert miss(rank1, "alice") == {"other_layout": CHUNK_TOKENS}
    assert miss(rank1, "bob") == {"other_cache_salt": CHUNK_TOKENS}
    assert miss(TPGroup(1, 2).fingerprint("other"), "alice") == {"other_model": CHUNK_TOKENS}
    assert miss("model", "alice") == never  # stored under its own root: gone since, as far as it can tell
    anchors.add(content_key(tokens), anchor_label(rank1, "alice"))
    assert tp1.read_bytes() == written and (tmp_path / "own.log").read_text().split() == [
        content_key(tokens),
        anchor_label(rank1, "alice"),
    ]
    assert SequenceRecord(miss_tokens={"other_layout": 64}).reply()["miss_tokens"] == {"never_stored": 64}
