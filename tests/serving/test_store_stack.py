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
