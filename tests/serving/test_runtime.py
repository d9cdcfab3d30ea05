import hashlib
import logging
import threading

import numpy as np
import pytest
import torch
from support.helpers import corrupt_tensor, loaded, random_prompt
from support.storage_chunks import read_back

from hcache.engine.reference import ReferenceEngine
from hcache.errors import InvalidRequestError, ModelNotFoundError, StorageError
from hcache.model.loader import load_model
from hcache.model.random_weights import random_model
from hcache.serving.runtime import HCacheRuntime
from hcache.storage.chunk import Chunk, decode, encode
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from hcache.storage.store_config import StoreConfig

NO_STOP = set()


@pytest.fixture
def llama():
    return loaded("random:llama")


def _store_digest(runtime: HCacheRuntime) -> dict[str, str]:
    runtime.store.flush()
    return {key: hashlib.sha256(read_back(runtime.store.stores[0], key)).hexdigest() for key in runtime.store.keys()}


def _chunk_path(runtime: HCacheRuntime, key: str):
    """The chunk's file, once written back; evicted from the host pool, so that a restore reads the file."""
    runtime.store.flush()
    runtime.store.drop_resident()
    return runtime.store.stores[0].path(key)


def test_conversations_sharing_a_system_prompt_share_its_chunks(smollm2, tmp_path):
    runtime = HCacheRuntime(smollm2, tmp_path)
    tok = smollm2.tokenizer
    system = [{"role": "system", "content": "You answer questions about European geography. " * 24}]

    def chat(question: str) -> list[int]:
        messages = system + [{"role": "user", "content": question}]
        return tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]

    first, second = chat("Capital of France?"), chat("Longest river in Spain?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 128
    runtime.generate(first, 4)
    written = runtime.saver.chunks_published
    result = runtime.generate(second, 4)
    assert result.restored_tokens == shared // 64 * 64
    # restored chunks are not saved again; new chunks: the rest of the prompt plus the generated tokens fed
    # back (all but the last)
    processed = len(second) + len(result.output_ids) - 1
    assert runtime.saver.chunks_published - written == processed // 64 - result.restored_tokens // 64
    assert result.output_ids == runtime.generate(second, 4, restore=False).output_ids


def test_a_disk_quota_keeps_the_chunk_every_conversation_starts_with(llama, tmp_path, rng):
    """Issue 25: the shared chunk is restored from the host pool, so unless those hits count as uses on the
    disk it looks least recently used there, is evicted first, and after a restart nothing restores."""
    with HCacheRuntime(llama, tmp_path / "probe") as runtime:  # the size of one chunk file
        runtime.generate(random_prompt(65, 256, rng), 1)
        runtime.store.flush()
        chunk_file = runtime.store.stores[0].used_bytes
    system = random_prompt(64, 256, rng)
    prompts = [system + random_prompt(70, 256, rng) for _ in range(6)]  # 2 chunks each, the first shared
    store = StoreConfig(quota_bytes=4 * chunk_file)
    with HCacheRuntime(llama, tmp_path / "store", store=store) as runtime:
        for _ in range(3):
            for prompt in prompts:
                runtime.generate(prompt, 2)
    keys = [chunk_keys(prompt[:-1], root_key(runtime.fingerprint)) for prompt in prompts]
    with HCacheRuntime(llama, tmp_path / "store", store=store) as runtime:
        # the shared chunk, and the last three prompts' own (each of them evicted the oldest of the others)
        assert set(runtime.store.keys()) == {keys[0][0]} | {k[1] for k in keys[3:]}
        restored = [runtime.generate(prompt, 2).restored_tokens for prompt in reversed(prompts)]
    assert restored == [128, 128, 128, 64, 64, 64]


def test_a_reopen_under_a_smaller_quota_keeps_the_shared_first_chunk(llama, tmp_path, rng):
    """Issue 42: six conversations share a system-prompt chunk, saved without a quota and replayed; reopened
    at once under a 4-chunk quota, the store keeps that chunk (every kept chunk hangs from it) and the
    latest conversations whole, which restore all they restored before, and the others their shared start."""
    system = random_prompt(64, 256, rng)
    prompts = [system + random_prompt(70, 256, rng) for _ in range(6)]  # 2 chunks each, the first shared
    with HCacheRuntime(llama, tmp_path / "store") as runtime:
        for prompt in prompts:
            runtime.generate(prompt, 2)
        before = [runtime.generate(prompt, 2).restored_tokens for prompt in prompts]
        runtime.store.flush()
        chunk_file = runtime.store.stores[0].used_bytes // 7
    with HCacheRuntime(llama, tmp_path / "store", store=StoreConfig(quota_bytes=4 * chunk_file)) as runtime:
        after = [runtime.generate(prompt, 2).restored_tokens for prompt in reversed(prompts)]  # the kept first
    assert before == [128] * 6 and after == [128, 128, 128, 64, 64, 64]


def test_namespaces_never_share_state(llama, tmp_path, rng):
    runtime = HCacheRuntime(llama, tmp_path)
    prompt = random_prompt(150, 256, rng)
    runtime.generate(prompt, 2, namespace="tenant-a")
    assert runtime.generate(prompt, 2, namespace="tenant-a").restored_tokens == 128
    assert runtime.generate(prompt, 2, namespace="tenant-b").restored_tokens == 0


@pytest.fixture
def stored(llama, tmp_path, rng):
    """A runtime whose store holds 3 chunks of ``prompt``, and the recompute output for it."""
    runtime = HCacheRuntime(llama, tmp_path, save="all")
    prompt = random_prompt(200, 256, rng)
    expected = runtime.generate(prompt, 8, restore=False, stop_token_ids=NO_STOP).output_ids
    keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
    assert len(keys) == 3 and all(runtime.store.contains(k) for k in keys)
    return runtime, prompt, keys, expected


def test_missing_chunk_recomputes_from_there(stored):
    runtime, prompt, keys, expected = stored
    _chunk_path(runtime, keys[1]).unlink()
    result = runtime.generate(prompt, 8, plan="H", stop_token_ids=NO_STOP)
    assert result.restored_tokens == 64 and result.output_ids == expected
    assert runtime.store.contains(keys[1])  # the recompute saved it again


@pytest.mark.parametrize("where", ["header", "data"])
def test_corrupt_chunk_is_logged_discarded_and_recomputed(stored, caplog, where):
    runtime, prompt, keys, expected = stored
    path = _chunk_path(runtime, keys[1])
    data = bytearray(path.read_bytes())
    data[20 if where == "header" else -3] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hcache.restore.stored_prefix"):
        result = runtime.generate(prompt, 8, plan="KV", stop_token_ids=NO_STOP)
    assert result.restored_tokens == 64 and result.output_ids == expected
    assert result.fallback and "recomputing from token 64" in caplog.text
    runtime.store.flush()
    assert (
        decode(read_back(runtime.store.stores[0], keys[1]), keys[1]).tokens == prompt[64:128]
    )  # replaced by a good chunk


def test_corruption_found_mid_restore_still_gives_exact_output(stored):
    """Layers 0-1 restore all 3 chunks; layer 2 of chunk 2 is corrupt, so the prefix shrinks to 2 chunks
    after some layers already hold chunk 2's state: the prefill must overwrite it."""
    runtime, prompt, keys, expected = stored
    corrupt_tensor(runtime.store, keys[2], 2, "H")
    result = runtime.generate(prompt, 8, plan="H", stop_token_ids=NO_STOP)
    assert result.restored_tokens == 128 and "checksum" in result.fallback
    assert result.output_ids == expected


def test_state_of_another_model_is_never_served(stored, tmp_path, rng):
    runtime, prompt, keys, _ = stored
    other = load_model("random:llama")
    other.model = random_model("llama", seed=1)
    runtime_b = HCacheRuntime(other, runtime.store.stores[0].root, save="none")
    expected_b = runtime_b.generate(prompt, 8, restore=False, stop_token_ids=NO_STOP).output_ids
    assert runtime_b.fingerprint != runtime.fingerprint
    assert runtime_b.generate(prompt, 8, stop_token_ids=NO_STOP).restored_tokens == 0  # keys differ
    # Even a chunk filed under B's key is refused when its header names A's weights.
    key_b = chunk_keys(prompt[:64], root_key(runtime_b.fingerprint))[0]
    runtime.store.flush()
    tensors = decode(read_back(runtime.store.stores[0], keys[0]), keys[0]).tensors
    runtime.store.stores[0].put(key_b, encode(Chunk(key_b, prompt[:64], runtime.fingerprint, tensors)))
    result = runtime_b.generate(prompt, 8, plan="KV", stop_token_ids=NO_STOP)
    assert result.restored_tokens == 0 and "another model" in result.fallback
    assert result.output_ids == expected_b


def test_plan_needing_unsaved_state_recomputes(llama, tmp_path, rng):
    runtime = HCacheRuntime(llama, tmp_path, plan="H")  # saves hidden states only
    prompt = random_prompt(150, 256, rng)
    expected = runtime.generate(prompt, 6, restore=False, stop_token_ids=NO_STOP).output_ids
    result = runtime.generate(prompt, 6, plan="KV", stop_token_ids=NO_STOP)
    assert result.restored_tokens == 0 and "saved without ['KV']" in result.fallback
    assert result.output_ids == expected
    assert runtime.generate(prompt, 6, stop_token_ids=NO_STOP).restored_tokens == 128


def test_batch_equals_requests_one_by_one(llama, tmp_path, rng):
    runtime = HCacheRuntime(llama, tmp_path)
    prompts = [random_prompt(n, 256, rng) for n in (140, 20, 90)]
    runtime.generate_batch(prompts, 5, stop_token_ids=NO_STOP)
    batched = runtime.generate_batch(prompts, 5, stop_token_ids=NO_STOP)
    assert [r.restored_tokens for r in batched] == [128, 0, 64]
    for prompt, r in zip(prompts, batched):
        assert r.output_ids == runtime.generate(prompt, 5, restore=False, stop_token_ids=NO_STOP).output_ids


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "empty prompt"),
        ([1] * 600, {}, "context limit"),
        ([1] * 500, {"max_new_tokens": 20}, "context limit"),
        ([1, 256, 3], {}, "outside the vocabulary"),
        ([1, -1, 3], {}, "outside the vocabulary"),
        ([1, 2.5, 3], {}, "not integers"),
        ([1, "5", 3], {}, "not integers"),
        ([1, None, 3], {}, "not integers"),
        ([1, True, 3], {}, "not integers"),
        (torch.tensor([1, 2, 3]), {}, "not Tensor"),
        (np.array([1, 2, 3]), {}, "not ndarray"),
        ([1, 2, 3], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2, 3], {"max_new_tokens": -5}, "max_new_tokens"),
        ([1, 2, 3], {"max_new_tokens": "5"}, "max_new_tokens"),
        ([1, 2, 3], {"max_new_tokens": None}, "max_new_tokens"),
        ([1, 2, 3], {"max_new_tokens": 2.5}, "max_new_tokens"),
        ([1, 2, 3], {"max_new_tokens": True}, "max_new_tokens"),
        ([1, 2, 3], {"plan": "2H"}, "covers 2 layers"),
        ([1, 2, 3], {"plan": "1RE++2KV"}, "cannot parse plan"),
        ([1, 2, 3], {"plan": "3H+"}, "cannot parse plan"),
        ([1, 2, 3], {"plan": "+3H"}, "cannot parse plan"),
        ([1, 2, 3], {"plan": "\uff13H"}, "cannot parse plan"),  # a full-width 3
        ([1, 2, 3], {"plan": 3}, "plan is a string"),
        ([1, 2, 3], {"plan": ["KV"]}, "plan is a string"),
        ([1, 2, 3], {"namespace": 123}, "namespace must be a non-empty string.* not 123"),
        ([1, 2, 3], {"namespace": b"x"}, "namespace must be a non-empty string.* not b'x'"),
        ([1, 2, 3], {"namespace": ["a"]}, "namespace must be a non-empty string"),
        ([1, 2, 3], {"namespace": ""}, "namespace must be a non-empty string"),
        ([1, 2, 3], {"namespace": "a\nb"}, "printable"),
        ([1, 2, 3], {"restore": "no"}, "restore is True or False"),
        ([1, 2, 3], {"stop_token_ids": 5}, "stop_token_ids is a set of token ids, not int"),
        ([1, 2, 3], {"stop_token_ids": {"a"}}, "stop_token_ids holds token ids"),
        ([1, 2, 3], {"stop_token_ids": [1.5]}, "stop_token_ids holds token ids"),
        ([1, 2, 3], {"stop_token_ids": [-1]}, "stop_token_ids holds token ids"),
    ],
)
def test_bad_requests_are_clear_errors_and_damage_nothing(stored, prompt, kwargs, message):
    runtime = stored[0]
    before = _store_digest(runtime)
    with pytest.raises(InvalidRequestError, match=message):
        runtime.generate(prompt, **kwargs)
    assert _store_digest(runtime) == before
    assert runtime.engine.cache.free_blocks == runtime.engine.cache.num_blocks


def test_a_bad_namespace_to_prefetch_is_refused_and_none_is_the_deployments(llama, tmp_path, rng):
    """``namespace=None`` is the deployment's namespace (``settings.namespace``), not a namespace of its
    own; with none set, requests without one share chunks. ``""`` is refused, as ``cache_salt`` is."""
    prompt = torch.randint(0, llama.spec.vocab_size, (2 * CHUNK_TOKENS + 3,), generator=rng).tolist()
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", namespace="acme") as runtime:
        with pytest.raises(InvalidRequestError, match="namespace must be a non-empty string"):
            runtime.prefetch(prompt, namespace=7)
        with pytest.raises(InvalidRequestError, match="a prompt is a list of token ids"):
            runtime.prefetch("hello")
        runtime.generate(prompt, 1, namespace="acme")
        assert runtime.generate(prompt, 1).restored_tokens == 2 * CHUNK_TOKENS  # None: the deployment's, acme's
        assert runtime.generate(prompt, 1, namespace="other").restored_tokens == 0
    with HCacheRuntime(llama, tmp_path / "store", plan="KV") as runtime:
        runtime.generate(prompt, 1)
        assert runtime.generate(prompt, 1).restored_tokens == 2 * CHUNK_TOKENS  # no namespace: shared
        assert runtime.generate(prompt, 1, namespace="acme").restored_tokens == 2 * CHUNK_TOKENS  # acme's own


def test_bad_model_or_store_is_a_clear_error(llama, tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model at"):
        HCacheRuntime(str(tmp_path / "nowhere"), tmp_path / "store")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelNotFoundError, match="cannot read the model config"):
        HCacheRuntime(str(corrupt), tmp_path / "store")
    no_weights = tmp_path / "no-weights"
    random_model("llama").config.save_pretrained(no_weights)
    with pytest.raises(ModelNotFoundError, match="cannot load the model weights in"):
        HCacheRuntime(str(no_weights), tmp_path / "store")
    for blocks in (0, -1):  # the runtime's setting is refused before; an engine built directly refuses it too
        with pytest.raises(InvalidRequestError, match=f"not num_blocks={blocks} of block_size=64 tokens"):
            ReferenceEngine(llama.model, llama.spec, num_blocks=blocks)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequestError, match="no usable CUDA GPU"):
            HCacheRuntime("random:llama", tmp_path / "store", device="cuda")
    assert not (tmp_path / "store").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StorageError):
        HCacheRuntime(llama, blocker / "store")
    # Bad settings are refused before the model loads (a missing model would be the error otherwise).
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(InvalidRequestError, match="setting 'save': Input should be 'plan', 'all' or 'none'"):
        HCacheRuntime(nowhere, tmp_path / "store", save="sometimes")
    with pytest.raises(InvalidRequestError, match="setting 'readers': Input should be greater than or equal to 0"):
        HCacheRuntime(nowhere, tmp_path / "store", readers=-1)
    with pytest.raises(InvalidRequestError, match="setting 'num_blocks': Input should be greater than 0"):
        HCacheRuntime(nowhere, tmp_path / "store", num_blocks=0)
    with pytest.raises(InvalidRequestError, match="setting 'plan': cannot parse plan"):
        HCacheRuntime(nowhere, tmp_path / "store", plan="3H+")
    with pytest.raises(InvalidRequestError, match="setting 'colour': Extra inputs are not permitted"):
        HCacheRuntime(nowhere, tmp_path / "store", colour="blue")
    assert not (tmp_path / "store").exists()


def test_threads_sharing_a_runtime_are_refused_not_corrupted(llama, tmp_path, rng):
    """Concurrent calls on one runtime: each either completes exactly or is refused at once, and what
    the store holds afterwards restores the exact outputs."""
    runtime = HCacheRuntime(llama, tmp_path)
    prompts = [random_prompt(130 + 10 * i, 256, rng) for i in range(4)]
    expected = [runtime.generate(p, 20, restore=False, stop_token_ids=NO_STOP).output_ids for p in prompts]
    start, outcomes = threading.Barrier(len(prompts)), [[] for _ in prompts]

    def client(i: int) -> None:
        start.wait()
        for _ in range(5):
            try:
                outcomes[i].append(runtime.generate(prompts[i], 20, stop_token_ids=NO_STOP).output_ids)
            except InvalidRequestError as exc:
                outcomes[i].append(str(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    refused = [o for outs in outcomes for o in outs if isinstance(o, str)]
    assert refused and all("already serving a generate() call" in o for o in refused)
    for i, outs in enumerate(outcomes):
        assert all(o == expected[i] for o in outs if not isinstance(o, str))
    for prompt, output in zip(prompts, expected):
        result = runtime.generate(prompt, 20, stop_token_ids=NO_STOP)
        assert result.restored_tokens >= 128 and result.output_ids == output
    runtime.close()


def test_a_chunk_short_of_the_plans_format_heals(llama, tmp_path, rng):
    """Chunks stored by a KV plan lack hidden states: an H plan recomputes once, and its save completes them."""
    prompt = random_prompt(200, 256, rng)
    with HCacheRuntime(llama, tmp_path, plan="KV") as runtime:
        expected = runtime.generate(prompt, 4, stop_token_ids=NO_STOP).output_ids
    with HCacheRuntime(llama, tmp_path, plan="H") as runtime:
        first = runtime.generate(prompt, 4, stop_token_ids=NO_STOP)
        assert first.restored_tokens == 0 and "saved without ['H']" in first.fallback
        runtime.store.flush()
        runtime.store.drop_resident()  # from the rewritten files
        second = runtime.generate(prompt, 4, stop_token_ids=NO_STOP)
        assert second.restored_tokens == 192 and second.fallback is None
        assert first.output_ids == second.output_ids == expected


def test_a_chunk_of_another_shape_is_refused_not_broadcast(stored):
    """Right key, tokens, fingerprint and checksums, but K/V of one head where the model has more: a copy
    would broadcast it into place, so it is refused and recomputed."""
    runtime, prompt, keys, expected = stored
    runtime.store.flush()
    tensors = decode(read_back(runtime.store.stores[0], keys[0]), keys[0]).tensors
    tensors = {name: t[:, :, :1].contiguous() if name[1] == "KV" else t for name, t in tensors.items()}
    runtime.store.drop_resident()
    runtime.store.stores[0].put(keys[0], encode(Chunk(keys[0], prompt[:64], runtime.fingerprint, tensors)))
    result = runtime.generate(prompt, 8, plan="KV", stop_token_ids=NO_STOP)
    assert result.restored_tokens == 0 and "the model's is" in result.fallback
    assert result.output_ids == expected
