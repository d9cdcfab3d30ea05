"""The reference engine against transformers' own forward: the ground truth everything else is checked on."""

import dataclasses

import pytest
import torch
from support.helpers import loaded, random_prompt
from torch import nn

from hcache.engine.reference import ReferenceEngine, _Decoder
from hcache.errors import CacheFullError, InvalidRequestError
from hcache.model.families import FAMILIES
from hcache.model.loader import load_model

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


def test_score_gives_every_position_as_transformers_and_extends_the_sequence(tiny, rng):
    """``score``: the next-token logits after each of a continuation's last tokens, as transformers' forward of
    the whole text gives them, and the sequence grown by the continuation, as ``step`` grows it."""
    ids = random_prompt(90, tiny.spec.vocab_size, rng)
    with torch.no_grad():
        expected = tiny.model(torch.tensor([ids])).logits[0]
    engine = ReferenceEngine(tiny.model, tiny.spec, num_blocks=8)
    engine.step([(0, ids[:40])])
    torch.testing.assert_close(engine.score(0, ids[40:], 30), expected[60:], atol=ATOL, rtol=0)
    assert engine.sequences[0].tokens == ids
    with pytest.raises(InvalidRequestError, match="cannot score"):
        engine.score(0, ids[:5], 6)


def test_attention_in_query_tiles_equals_one_call(tiny, rng, monkeypatch):
    """A long prefill's attention is taken in tiles of queries (its scores bounded): the same logits and
    cache as one call, for a prefill and for a continuation after it, in a ragged batch."""
    import hcache.engine.reference as reference

    prompts = [random_prompt(n, tiny.spec.vocab_size, rng) for n in (90, 37)]
    whole = ReferenceEngine(tiny.model, tiny.spec, num_blocks=16)
    want = [whole.step([(0, prompts[0][:60]), (1, prompts[1])]), whole.step([(0, prompts[0][60:])])]
    monkeypatch.setattr(reference, "SCORES", 7 * tiny.spec.num_heads * 90)  # a few queries a tile
    tiled = ReferenceEngine(tiny.model, tiny.spec, num_blocks=16)
    got = [tiled.step([(0, prompts[0][:60]), (1, prompts[1])]), tiled.step([(0, prompts[0][60:])])]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    for layer in range(tiny.spec.num_layers):
        torch.testing.assert_close(tiled.kv(0, layer), whole.kv(0, layer), atol=1e-5, rtol=0)


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


def test_the_mlp_takes_a_batch_dimension_where_the_family_table_says(monkeypatch):
    """Once the engine named Qwen3-Next where the family table holds each family's facts."""

    class Shapes(nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, h):
            self.seen.append(tuple(h.shape))
            return h

    # A model of its own, not the session's: pytest 9.2's monkeypatch restores only an instance's __dict__,
    # and a torch submodule lives in _modules, so undoing it would delete the shared model's MLP.
    tiny = load_model("random:llama")
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], batched_mlp=True))
    decoder = _Decoder(tiny.model, tiny.spec)
    layer = decoder.layers[0]
    layer.mlp = Shapes()
    out = decoder.mlp_block(layer, torch.zeros(3, tiny.spec.hidden_size))
    assert layer.mlp.seen == [(1, 3, tiny.spec.hidden_size)] and out.shape == (3, tiny.spec.hidden_size)
