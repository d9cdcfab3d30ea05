"""Hybrids served with exact restores, by one rule for both kinds of recurrent layer (a Mamba-2 hybrid,
GraniteMoeHybrid, and a gated-delta-net hybrid, Qwen3-Next): attention layers by KV, H or RE, recurrent layers
from the state kept at chunk ends (planning/checkpoints.py), and never a prefix without its state."""

import pytest
import torch
from support.helpers import corrupt_tensor, family_params, loaded, random_prompt

from hcache.errors import UnsupportedModelError
from hcache.model.loader import LoadedModel
from hcache.model.spec import ModelSpec
from hcache.planning.plan import state_bytes
from hcache.resolve import resolve
from hcache.serving.restore import restore_prefix
from hcache.serving.runtime import HCacheRuntime
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from hcache.storage.stored_state import STATE

# float32. Where the stored chunks were computed by prefills, a recompute of the prefix runs the recurrent layers in
# the same pieces (they end at chunk ends), so the restored K/V and state are recompute's within float rounding.
# Where decode steps computed them, transformers' mixer took its recurrent path, and a recompute its chunked
# scan: the two agree to about 1e-5 of the state's size, and that reaches the K/V of the layers above, so there
# the bound is the logits' (tests/engine/test_reference.py). A state sums a whole prefix: the attention layers
# below it see the prefix in a prefill of another length there (the turn's whole prompt, against the prefix
# alone), which can round their outputs apart in the last bits, and the sum carries that to a few 1e-5 of a state
# of a few units (seed after seed, about a third of them failed an absolute 1e-5): its bound is relative too.
ATOL = 1e-5
DECODED_ATOL = 1e-4
STATE_RTOL = 1e-4


@pytest.fixture(scope="module", params=family_params(["granitemoehybrid", "qwen3_next"]))
def hybrid(request) -> LoadedModel:
    return loaded(f"random:{request.param}")


def assert_restore_equals_recompute(runtime: HCacheRuntime, prompt: list[int], plan, atol: float = ATOL) -> int:
    """Restore ``prompt``'s stored prefix by ``plan`` and recompute it in another sequence: every attention
    layer's K/V and every recurrent layer's state (convolution and recurrent) agree within ``atol``; the tokens
    restored."""
    engine, spec = runtime.engine, runtime.spec
    keys = chunk_keys(prompt[:-1], root_key(runtime.fingerprint))
    outcome = restore_prefix(engine, runtime.store, 1000, prompt, keys, runtime.fingerprint, plan, runtime.stack.copier)
    assert outcome.fallback is None and outcome.tokens == CHUNK_TOKENS * len(keys)
    engine.step([(1001, prompt[: outcome.tokens])])
    for layer in range(spec.num_layers):
        if spec.is_recurrent(layer):
            got, want = engine.states[1000].rows(layer), engine.states[1001].rows(layer)
            torch.testing.assert_close(got, want, atol=atol, rtol=STATE_RTOL, msg=lambda m: f"layer {layer} state: {m}")
        else:
            for got, want in zip(engine.kv(1000, layer), engine.kv(1001, layer)):
                torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"layer {layer} K/V: {m}")
    engine.flush_all()
    return outcome.tokens


def test_a_returning_conversation_restores_as_recompute(hybrid, tmp_path, rng):
    """A conversation resent with a new turn, twice: by KV, H, and mixed plans (RE over a recurrent layer and an
    attention layer, H, KV), the restored K/V and state are recompute's (within float rounding where prefills
    computed the chunks, within the mixer's two paths' noise where decode steps did), the greedy tokens too,
    and a recurrent layer reads its state from the last chunk alone."""
    spec = hybrid.spec
    runtime = HCacheRuntime(hybrid, tmp_path, save="all")
    assert not runtime.config.disabled  # the start-up self-check restored by every method, state included
    history = random_prompt(200, spec.vocab_size, rng)
    # Turn 2 restores the 3 chunks turn 1's prefill computed; turn 3 also chunk 3, computed by decode steps.
    for turn, (chunks, atol) in enumerate(((3, ATOL), (4, DECODED_ATOL)), 2):
        reply = runtime.generate(history, 40, stop_token_ids=set())
        history = history + reply.output_ids[:-1] + random_prompt(5, spec.vocab_size, rng)
        expected = runtime.generate(history, 12, restore=False).output_ids
        for text in ("KV", "H", "1RE+3KV", "2RE+1H+1KV"):
            plan = runtime.resolve_plan(text)
            assert assert_restore_equals_recompute(runtime, history, plan, atol) == chunks * CHUNK_TOKENS
            result = runtime.generate(history, 12, plan=plan)
            assert result.output_ids == expected, f"turn {turn}, plan {plan}"
            assert result.restored_tokens == chunks * CHUNK_TOKENS and result.fallback is None
            assert not result.miss_tokens
            restored_state = [layer for layer in spec.recurrent_layers if plan.layers[layer].value != "RE"]
            kind = spec.layer_type(spec.recurrent_layers[0])  # "mamba" or "gated_delta_net"
            assert result.type_bytes.get(kind, 0) == len(restored_state) * state_bytes(spec)  # as the plan costs it


def test_a_state_every_second_chunk_restores_a_branch_to_its_last_checkpoint(hybrid, tmp_path, rng):
    """``state_every=2``: chunks 1, 3, ... hold the recurrent layers' state. A conversation that branches from a
    saved one restores the longest prefix that ends at a stored state, names the rest ``no_state``, and
    answers as recompute does."""
    spec = hybrid.spec
    runtime = HCacheRuntime(hybrid, tmp_path, save="plan", plan="KV", state_every=2)
    prompt = random_prompt(5 * CHUNK_TOKENS + 10, spec.vocab_size, rng)
    runtime.generate(prompt, 1, restore=False)
    runtime.store.flush()
    for index, key in enumerate(chunk_keys(prompt, root_key(runtime.fingerprint))):
        image = runtime.store.fetch(key).result()
        try:
            assert {layer for layer in spec.recurrent_layers if image.has(layer, STATE)} == (
                set(spec.recurrent_layers) if index % 2 else set()
            ), f"chunk {index}"
            assert all(image.has(layer, "KV") for layer in range(spec.num_layers) if not spec.is_recurrent(layer))
        finally:
            runtime.store.release(image)
    plain = HCacheRuntime(hybrid, tmp_path / "plain", save="none")
    for branch_at, restored in ((3 * CHUNK_TOKENS + 20, 2 * CHUNK_TOKENS), (CHUNK_TOKENS + 30, 0)):
        branch = prompt[:branch_at] + random_prompt(20, spec.vocab_size, rng)
        expected = plain.generate(branch, 8, restore=False).output_ids
        result = runtime.generate(branch, 8)
        assert result.output_ids == expected
        assert result.restored_tokens == restored
        assert result.miss_tokens == {"no_state": branch_at // CHUNK_TOKENS * CHUNK_TOKENS - restored}
    # The whole conversation resent: its fifth chunk holds a state, so all five restore.
    result = runtime.generate(prompt + random_prompt(3, spec.vocab_size, rng), 1)
    assert result.restored_tokens == 4 * CHUNK_TOKENS and result.miss_tokens == {"no_state": CHUNK_TOKENS}


def test_a_damaged_state_is_never_served(hybrid, tmp_path, rng):
    """One recurrent layer's state damaged in the last chunk on disk: the chunk fails its checksum, the prefix
    ends at the chunk before (whose state is stored), the miss is ``failed_verification``, and the reply is
    recompute's."""
    spec = hybrid.spec
    runtime = HCacheRuntime(hybrid, tmp_path, save="plan", plan="KV")
    prompt = random_prompt(4 * CHUNK_TOKENS + 3, spec.vocab_size, rng)
    runtime.generate(prompt, 1, restore=False)
    resent = prompt + random_prompt(4, spec.vocab_size, rng)
    expected = HCacheRuntime(hybrid, tmp_path / "plain", save="none").generate(resent, 8, restore=False).output_ids
    corrupt_tensor(
        runtime.store, chunk_keys(prompt, root_key(runtime.fingerprint))[3], spec.recurrent_layers[-1], STATE
    )
    result = runtime.generate(resent, 8)
    assert result.output_ids == expected
    assert result.restored_tokens == 3 * CHUNK_TOKENS
    assert result.miss_tokens == {"failed_verification": CHUNK_TOKENS}


def test_a_hybrid_is_refused_where_its_state_cannot_be_kept(hybrid):
    """The GPU prefix cache and tensor parallelism would serve K/V without the state; vLLM's connector stores
    K/V alone (issue 65)."""
    spec, name = hybrid.spec, f"random:{hybrid.spec.model_type}"
    for settings, tp in (({"gpu_cache": True}, 1), ({}, 2)):
        with pytest.raises(UnsupportedModelError, match="recurrent"):
            resolve({"plan": "KV", "engine": "reference", **settings}, spec, name, tensor_parallel=tp)
    with pytest.raises(UnsupportedModelError, match="linear_attention layers beside attention"):
        ModelSpec.from_config(hybrid.model.config, any_family=True)
