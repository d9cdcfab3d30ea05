"""The recurrent-state checkpoint rule: which chunks keep a Mamba layer's state, and how far a restore may go."""

from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.planning.checkpoints import StateRule
from hcache.storage.chunk_key import CHUNK_TOKENS


def _spec() -> ModelSpec:
    return ModelSpec.from_config(random_model("granitemoehybrid").config)


def test_a_state_is_kept_at_the_end_of_every_nth_chunk():
    spec = _spec()
    assert spec.recurrent_layers == (0, 2) and [spec.layer_type(layer) for layer in range(4)] == [
        "mamba",
        "full_attention",
        "mamba",
        "full_attention",
    ]
    assert all(StateRule(spec).saves(c) for c in range(5))
    qwen3_next = ModelSpec.from_config(random_model("qwen3_next").config)  # the same rule for gated delta nets
    assert qwen3_next.recurrent_layers == (0, 2) and qwen3_next.layer_type(0) == "gated_delta_net"
    assert [c for c in range(6) if StateRule(spec, every=2).saves(c)] == [1, 3, 5]


def test_a_restore_ends_only_at_a_stored_state():
    spec = _spec()

    def usable(rule, n, holds, layers=(0, 1, 2, 3), first=0, end=lambda m: m * CHUNK_TOKENS):
        return rule.usable(layers, first, n, lambda m: first * CHUNK_TOKENS + end(m), holds)

    every, second = StateRule(spec), StateRule(spec, every=2)
    assert usable(every, 4, lambda j, layer: True) == 4
    assert usable(second, 4, lambda j, layer: j % 2 == 1) == 4
    assert usable(second, 3, lambda j, layer: j % 2 == 1) == 2  # chunk 2 holds none: back to chunk 1's end
    assert usable(second, 1, lambda j, layer: j % 2 == 1) == 0
    assert usable(every, 3, lambda j, layer: not (j == 2 and layer == 2)) == 2  # one layer's state missing
    # A prefix that ends inside its last chunk (a prompt's last token is computed) ends at the chunk before.
    assert usable(every, 3, lambda j, layer: True, end=lambda m: min(m * CHUNK_TOKENS, 191)) == 2
    # Counted from the sequence's chunk ``first``; a plan that recomputes every Mamba layer needs no state.
    assert usable(every, 2, lambda j, layer: True, first=3) == 2
    assert usable(every, 3, lambda j, layer: False, layers=(1, 3)) == 3


def test_an_engine_with_states_at_its_step_ends_keeps_one_only_where_the_opening_step_ends_on_the_chunk():
    rule = StateRule(_spec(), every=2, at_step_end=True)  # vLLM's align mode: a state where a step ended
    assert rule.saves(1, 2 * CHUNK_TOKENS) and rule.saves(3, 4 * CHUNK_TOKENS)
    assert not rule.saves(1, 4 * CHUNK_TOKENS)  # a step that ran past the chunk's end: no state there
    assert not rule.saves(3, 3 * CHUNK_TOKENS + 1)  # opened by a decode step: where its last one ends is not known
    assert not rule.saves(2, 3 * CHUNK_TOKENS)  # not a checkpoint
