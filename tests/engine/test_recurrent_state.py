"""A hybrid's recurrent layers on the reference engine (Granite 4's Mamba-2, Qwen3-Next's gated delta nets): each
sequence's state kept per layer, continued by transformers' own mixer, so the logits are transformers' over a
ragged batch and several turns."""

import pytest
import torch
from support.helpers import random_prompt

from hcache.engine.reference import ReferenceEngine
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.storage.chunk_key import CHUNK_TOKENS

ATOL = 1e-4  # float32, as tests/engine/test_reference.py


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("granitemoehybrid", {"position_embedding_type": "rope"}),
        ("granitemoehybrid", {"position_embedding_type": None}),
        ("qwen3_next", {}),
    ],
)
def test_turns_of_a_ragged_batch_equal_transformers(family, overrides, rng):
    """Two conversations in one batch, over turns that cross chunk ends mid-prefill and decode steps between,
    Granite with RoPE and without (Granite 4's), Qwen3-Next with its gated attention; each turn's logits are
    transformers' over the whole text."""
    model = random_model(family, **overrides)
    spec = ModelSpec.from_config(model.config)
    assert (spec.rope is not None) == (overrides.get("position_embedding_type", "rope") == "rope")
    texts = [random_prompt(230, spec.vocab_size, rng), random_prompt(150, spec.vocab_size, rng)]
    with torch.no_grad():
        expected = [model(torch.tensor([t])).logits[0] for t in texts]
    engine = ReferenceEngine(model, spec, num_blocks=16)
    turns = [(100, 30), (101, 31), (102, 32), (170, 100), (171, 101), (230, 150)]  # where each text is after it
    done = [0, 0]
    for ends in turns:
        requests = [(uid, texts[uid][done[uid] : end]) for uid, end in enumerate(ends) if end > done[uid]]
        logits = engine.step(requests)
        for row, (uid, tokens) in enumerate(requests):
            done[uid] += len(tokens)
            torch.testing.assert_close(logits[row], expected[uid][done[uid] - 1], atol=ATOL, rtol=0)
    assert set(engine.states) == {0, 1} and set(engine.states[0].layers) == set(spec.recurrent_layers)
    engine.flush(0)
    assert set(engine.states) == {1}


@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next"])
def test_a_state_at_a_chunk_end_is_the_same_whatever_the_puts(family, rng):
    """The forward runs a recurrent layer in pieces that end at chunk ends, so a prefill in one put and in puts
    that end at chunk ends keep the same state bit for bit there (what a save stores and a restore continues
    from); puts that end mid-chunk sum in another order, within float32's noise."""
    model = random_model(family)
    spec = ModelSpec.from_config(model.config)
    ids = random_prompt(2 * CHUNK_TOKENS, spec.vocab_size, rng)
    engine = ReferenceEngine(model, spec, num_blocks=8)
    for uid, cuts in enumerate(([], [CHUNK_TOKENS], [40, 100])):
        for a, b in zip([0, *cuts], [*cuts, len(ids)]):
            engine.step([(uid, ids[a:b])])
    for layer in spec.recurrent_layers:
        assert torch.equal(engine.states[1].rows(layer), engine.states[0].rows(layer))
        torch.testing.assert_close(engine.states[2].rows(layer), engine.states[0].rows(layer), atol=ATOL, rtol=0)
