"""What the store stack values a chunk at for cost-aware eviction: its recompute cost, which grows with its
depth in the conversation, in the profile's seconds where there is one."""

import pytest
from support.helpers import loaded

from hcache.planning.profile import COST_NAMES, Profile
from hcache.resolve import resolve
from hcache.serving.store_stack import recompute_cost
from hcache.storage.chunk_key import CHUNK_TOKENS


@pytest.fixture
def spec():
    return loaded("random:llama").spec


def test_with_a_profile_a_chunk_costs_the_layers_times_the_growth_of_c_token(spec):
    seconds = {name: [0.001, 0.001, 0.001] for name in COST_NAMES}
    seconds["c_token"] = [0.01, 0.05, 0.25]  # per layer, at 64, 128 and 256 tokens
    profile = Profile.new("random:llama", spec, [64, 128, 256], seconds, {})
    cost = recompute_cost(resolve({"profile": profile}, spec, "random:llama"))
    layers = spec.num_layers
    assert cost(0, CHUNK_TOKENS) == pytest.approx(layers * 0.01)
    assert cost(64, CHUNK_TOKENS) == pytest.approx(layers * 0.04)
    assert cost(128, CHUNK_TOKENS) == pytest.approx(layers * 0.10)  # 0.15 at 192, interpolated
    assert cost(128, 32) == pytest.approx(layers * 0.05)  # a partial chunk


def test_without_a_profile_a_deeper_chunk_costs_more_flops(spec):
    cost = recompute_cost(resolve({}, spec, "random:llama"))
    d, layers = spec.hidden_size, spec.num_layers
    # one token at position 0 attends to itself: 24·D² for the weights, 4·D for the one token
    assert cost(0, 1) == pytest.approx(layers * (24 * d * d + 4 * d))
    chunks = [cost(i * CHUNK_TOKENS, CHUNK_TOKENS) for i in range(4)]
    assert chunks == sorted(chunks) and chunks[3] > chunks[0]
    assert cost(0, 2 * CHUNK_TOKENS) == pytest.approx(chunks[0] + chunks[1])  # additive over a conversation


def test_a_hybrids_recurrent_layers_cost_their_own_forward():
    """A recurrent layer is valued at its own forward's growth (``c_token_recurrent``), not an attention layer's;
    without a profile, it attends to nothing (its state has a fixed size)."""
    spec = loaded("random:qwen3_next").spec
    recurrent = len(spec.recurrent_layers)
    attention = spec.num_layers - recurrent
    assert recurrent and attention
    seconds = {name: [0.001, 0.001, 0.001] for name in COST_NAMES}
    seconds["c_token"] = [0.01, 0.05, 0.25]
    seconds["c_token_recurrent"] = [0.002, 0.004, 0.008]  # linear in the history
    profile = Profile.new("random:qwen3_next", spec, [64, 128, 256], seconds, {})
    cost = recompute_cost(resolve({"profile": profile}, spec, "random:qwen3_next"))
    assert cost(64, CHUNK_TOKENS) == pytest.approx(attention * 0.04 + recurrent * 0.002)
    flops = recompute_cost(resolve({}, spec, "random:qwen3_next"))
    d = spec.hidden_size
    assert flops(0, 1) == pytest.approx(spec.num_layers * 24 * d * d + attention * 4 * d)
