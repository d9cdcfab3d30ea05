import pytest

from hcache.errors import InvalidRequestError
from hcache.planning.plan import Method, RestorePlan, default_plan


def test_parse_and_shape():
    plan = RestorePlan.parse("2RE+5H+3KV", 10)
    assert plan.layers == (Method.RE,) * 2 + (Method.H,) * 5 + (Method.KV,) * 3
    assert str(plan) == "2RE+5H+3KV"
    assert RestorePlan.parse("kv", 4) == RestorePlan.uniform(4, Method.KV)
    assert RestorePlan.parse("3RE+1KV", 4) == RestorePlan.split(4, re=3, kv=1)


@pytest.mark.parametrize(
    "text", ["", "2RE+2H", "H+KV", "6RE", "1KV+4H", "nonsense", "1RE++4KV", "5H+", "+5H", "\uff15H", "2H+3H", "5", None]
)
def test_bad_plans_are_clear_errors(text):
    with pytest.raises(InvalidRequestError):
        RestorePlan.parse(text, 5)


def test_plan_order_is_enforced():
    with pytest.raises(InvalidRequestError, match="RE first"):
        RestorePlan((Method.KV, Method.H))


def test_stored_bytes_and_default_plan(smollm2, tiny):
    s = smollm2.spec
    plan = RestorePlan.split(30, re=6, kv=12)
    assert plan.stored_bytes_per_token(s) == 12 * s.hidden_bytes_per_token_layer + 12 * s.kv_bytes_per_token_layer
    assert default_plan(s) == RestorePlan.uniform(30, Method.KV)  # GQA, r = 0.67: hidden states never win
    t = tiny.spec
    expected = Method.H if t.kv_to_hidden_ratio > 1 else Method.KV
    assert default_plan(t) == RestorePlan.uniform(t.num_layers, expected)


def test_a_recurrent_layer_stores_its_state_by_h_and_kv_alike():
    """Its stored bytes per token are its state's (one chunk's rows of float32 values, ``state_bytes``) over the
    tokens of the chunks one state stands for; an attention layer's are its rows'."""
    from hcache.model.random_weights import random_model
    from hcache.model.spec import ModelSpec
    from hcache.planning.plan import row_shapes, state_bytes
    from hcache.storage.chunk import ChunkLayout
    from hcache.storage.stored_state import STATE, STATE_DTYPE, TensorSpec

    spec = ModelSpec.from_config(random_model("granitemoehybrid").config)  # Mamba-2 in layers 0 and 2
    layout = ChunkLayout.plan([TensorSpec(0, STATE, row_shapes(spec)[STATE], STATE_DTYPE)], "")  # as a chunk holds it
    assert state_bytes(spec) == layout.entries[(0, STATE)].nbytes
    rows = spec.hidden_bytes_per_token_layer + spec.kv_bytes_per_token_layer  # layer 1 by H, layer 3 by KV
    plan = RestorePlan.parse("2H+2KV", 4)
    assert plan.stored_bytes_per_token(spec) == 2 * state_bytes(spec) / 64 + rows
    assert plan.stored_bytes_per_token(spec, state_every=4) == 2 * state_bytes(spec) / 256 + rows
    assert RestorePlan.parse("1RE+3KV", 4).stored_bytes_per_token(spec) == state_bytes(spec) / 64 + 2 * (
        spec.kv_bytes_per_token_layer
    )
