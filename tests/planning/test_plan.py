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
