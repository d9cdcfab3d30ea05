"""Every restore method and mixed plans rebuild exactly the KV cache that recompute produces."""

import errno

import pytest
import torch
from support.helpers import loaded, random_prompt

from hcache.model.loader import LoadedModel
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.planning.plan import RestorePlan
from hcache.serving.restore import restore_prefix
from hcache.serving.runtime import HCacheRuntime
from hcache.storage.chunk_key import chunk_keys, root_key
from hcache.storage.host_pool import HostPool
from hcache.storage.host_tier import HostTier
from hcache.transfer.copier import Copier

# float32: K/V from a saved hidden state go through the same GEMM and RoPE as the forward, but the GEMM
# may block rows differently, and decode-time rows were produced one token at a time.
KV_ATOL = 1e-5
DECODED_ATOL = 1e-4


def plans(num_layers: int) -> list[str]:
    n = num_layers
    return ["RE", "H", "KV", f"1RE+{n - 1}H", f"{n - 1}H+1KV", f"1RE+{n - 2}H+1KV", f"1RE+{n - 1}KV"]


def assert_restored_kv_equals_recompute(
    runtime: HCacheRuntime, prompt: list[int], plan: RestorePlan, atol: float = KV_ATOL, rtol: float = 0.0
) -> int:
    engine, spec = runtime.engine, runtime.spec
    keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
    outcome = restore_prefix(engine, runtime.store, 1000, prompt, keys, runtime.fingerprint, plan, runtime.stack.copier)
    assert outcome.fallback is None and outcome.tokens == 64 * len(keys)
    engine.step([(1001, prompt[: outcome.tokens])])
    for layer in range(spec.num_layers):
        attended = spec.attended_from(layer, outcome.tokens)  # a sliding-window layer's positions before are never read
        for got, want in zip(engine.kv(1000, layer), engine.kv(1001, layer)):
            torch.testing.assert_close(
                got[attended:], want[attended:], atol=atol, rtol=rtol, msg=lambda m: f"layer {layer}: {m}"
            )
    engine.flush_all()
    return outcome.tokens


def test_every_method_and_mixed_plan_on_every_family(tiny, tmp_path, rng):
    runtime = HCacheRuntime(tiny, tmp_path, save="all")
    prompt = random_prompt(100, tiny.spec.vocab_size, rng)
    # Saves chunk 0 from the prefill and chunk 1 from prefill rows 64-99 plus decode rows 100-127.
    reference = runtime.generate(prompt, 40, restore=False, stop_token_ids=set())
    history = prompt + reference.output_ids[:-1]  # the next turn resends this history
    follow_up = history + random_prompt(7, tiny.spec.vocab_size, rng)
    expected = runtime.generate(follow_up, 12, restore=False).output_ids
    # A hybrid's chunk 1, computed by decode steps, went through its Mamba mixer's recurrent path where a
    # recompute takes the chunked scan: the K/V above differ by that noise (tests/serving/test_hybrid.py).
    atol = DECODED_ATOL if tiny.spec.recurrent_layers else KV_ATOL
    for text in plans(tiny.spec.num_layers):
        plan = runtime.resolve_plan(text)
        assert assert_restored_kv_equals_recompute(runtime, follow_up, plan, atol) == 128
        result = runtime.generate(follow_up, 12, plan=plan)
        assert result.restored_tokens == 128 and result.fallback is None
        assert result.output_ids == expected, f"plan {plan}"


@pytest.mark.parametrize("plan", ["RE", "H", "KV", "6RE+12H+12KV", "10H+20KV", "5RE+25KV"])
@pytest.mark.slow
def test_smollm2_restore_is_exact(smollm2, tmp_path, plan):
    runtime = HCacheRuntime(smollm2, tmp_path, save="all")
    tok = smollm2.tokenizer
    text = "The history of the French capital spans two millennia. " * 12 + "Summarise it:"
    prompt = tok.encode(text)
    expected = runtime.generate(prompt, 10, restore=False).output_ids
    restored = assert_restored_kv_equals_recompute(runtime, prompt, runtime.resolve_plan(plan))
    assert restored >= 64
    result = runtime.generate(prompt, 10, plan=plan)
    assert result.restored_tokens == restored and result.output_ids == expected


@pytest.mark.parametrize("plan", ["2RE+3H+3KV", "H", "KV", "3RE+5KV"])
def test_pipelined_restore_equals_sequential(tmp_path, rng, plan):
    """Chunks loaded by reader threads while the RE layers run, loaded inline, or served from the host pool,
    with copies issued layers ahead of the compute: the same cache, bit for bit."""
    model = random_model("llama", num_hidden_layers=8)  # more layers than the copier's depth
    lm = LoadedModel("random:llama", model, ModelSpec.from_config(model.config, torch.float32), None)
    with HCacheRuntime(lm, tmp_path, save="all", readers=3) as runtime:  # 5 chunks over 3 readers
        prompt = random_prompt(330, lm.spec.vocab_size, rng)
        runtime.generate(prompt, 1, restore=False)
        runtime.store.flush()
        keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
        engine, plan = runtime.engine, runtime.resolve_plan(plan)
        inline = HostTier(runtime.store.stores, HostPool(16 << 20), readers=0)
        runtime.store.drop_resident()
        for uid, tier in ((1, inline), (2, runtime.store), (3, runtime.store)):  # 3: from the pool
            outcome = restore_prefix(
                engine, tier, uid, prompt, keys, runtime.fingerprint, plan, Copier(engine.device, depth=2)
            )
            assert outcome.tokens == 320 and outcome.fallback is None
        assert runtime.store.misses == 5 and runtime.store.hits == 5 and inline.misses == 5
        for layer in range(lm.spec.num_layers):
            for sequential, pipelined, resident in zip(engine.kv(1, layer), engine.kv(2, layer), engine.kv(3, layer)):
                assert torch.equal(sequential, pipelined) and torch.equal(sequential, resident), f"layer {layer}"


def test_io_errors_while_restoring_fall_back_to_recompute(tmp_path, rng, monkeypatch):
    lm = loaded("random:llama")
    with HCacheRuntime(lm, tmp_path, save="all") as runtime:
        prompt = random_prompt(200, lm.spec.vocab_size, rng)
        expected = runtime.generate(prompt, 6, restore=False).output_ids
        keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
        runtime.store.flush()
        runtime.store.drop_resident()
        read_into = runtime.store.stores[0].read_into

        def failing_read(key, take):
            if key == keys[1]:
                raise OSError(errno.EIO, "Input/output error")
            return read_into(key, take)

        monkeypatch.setattr(runtime.store.stores[0], "read_into", failing_read)
        discarded = []
        monkeypatch.setattr(runtime.store, "discard", discarded.append)
        result = runtime.generate(prompt, 6, plan="H")
        assert result.restored_tokens == 64 and "cannot read" in result.fallback
        assert result.output_ids == expected
        assert discarded == []  # an I/O error proves nothing about the chunk: it is kept
        runtime.store.drop_resident()

        def refused(key, take):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(runtime.store.stores[0], "read_into", refused)
        result = runtime.generate(prompt, 6, plan="KV")
        assert result.restored_tokens == 0 and "Permission denied" in result.fallback
        assert result.output_ids == expected
