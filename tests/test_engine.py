"""The reference engine against transformers' own forward: the ground truth everything else is checked on."""
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as hf_partial_rope

from hcache.engine import ReferenceEngine
from hcache.errors import CacheFullError, InvalidRequestError
from hcache.model_spec import RopeSpec
from hcache.ops import apply_rope, rope_cos_sin

from helpers import random_prompt

# float32 on CPU; the paged attention sums in another order than transformers' SDPA call.
ATOL = 1e-4


def test_prefill_and_decode_match_transformers(tiny, rng):
    ids = random_prompt(90, tiny.spec.vocab_size, rng)
    with torch.no_grad():
        expected = tiny.model(torch.tensor([ids])).logits[0]
    engine = ReferenceEngine(tiny.model, tiny.spec, num_blocks=8)
    torch.testing.assert_close(engine.step([(0, ids)])[0], expected[-1], atol=ATOL, rtol=0)
    engine.step([(1, ids[:50])])
    for i in range(50, 90):
        logits = engine.step([(1, [ids[i]])])
        torch.testing.assert_close(logits[0], expected[i], atol=ATOL, rtol=0)
    assert engine.sequences[1].tokens == ids


def test_ragged_batch_equals_each_sequence_alone(tiny, rng):
    prompts = [random_prompt(n, tiny.spec.vocab_size, rng) for n in (70, 5, 130)]
    engine = ReferenceEngine(tiny.model, tiny.spec, num_blocks=16)
    batched = engine.step([(i, p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        alone = engine.step([(10 + i, p)])
        torch.testing.assert_close(batched[i], alone[0], atol=ATOL, rtol=0)
        for layer in range(tiny.spec.num_layers):
            torch.testing.assert_close(engine.kv(i, layer), engine.kv(10 + i, layer), atol=ATOL, rtol=0)


def test_blocks_are_freed_and_exhaustion_is_a_clear_error(tiny, rng):
    engine = ReferenceEngine(tiny.model, tiny.spec, num_blocks=2, block_size=64)
    engine.step([(0, random_prompt(100, tiny.spec.vocab_size, rng))])
    assert engine.cache.free_blocks == 0
    with pytest.raises(CacheFullError, match="KV cache full"):
        engine.step([(1, [1, 2, 3])])
    engine.flush(0)
    assert engine.cache.free_blocks == 2
    with pytest.raises(InvalidRequestError, match="limit"):
        engine.step([(2, [1] * (tiny.spec.max_positions + 1))])


@pytest.mark.parametrize("rotary_dim, hf_apply", [(64, hf_rope), (32, hf_partial_rope)])
def test_rope_equals_transformers(rotary_dim, hf_apply, rng):
    theta = 10000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    rope = RopeSpec(theta, "default", rotary_dim, tuple(inv_freq.tolist()))
    positions = torch.randint(0, 4096, (37,), generator=rng)
    q, k = torch.randn(2, 37, 4, 64, generator=rng)
    cos, sin = rope_cos_sin(rope, positions, torch.float32)
    # transformers rotates [batch, heads, seq, dim] with cos/sin [batch, seq, rotary_dim]
    q_hf, k_hf = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), q_hf[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin), k_hf[0].transpose(0, 1))
