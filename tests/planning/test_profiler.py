"""The profiler on a hybrid: its restore costs are measured on an attention layer, where a recurrent first layer
(Granite 4's and Qwen3-Next's) has no K/V to rebuild, and the forward of each kind of layer on its first."""

import pytest
from support.helpers import loaded

from hcache.planning.profiler import measure_profile


@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next"])
def test_a_hybrid_is_profiled_on_its_attention_layers(family, tmp_path):
    model = loaded(f"random:{family}")
    assert model.spec.is_recurrent(0)
    profile = measure_profile(model, [64, 128], repeats=1, readers=1, store_dirs=[str(tmp_path)])
    assert profile.tokens == [64, 128]
    names = ("c_token", "c_token_recurrent", "c_h", "c_kv", "c_h8", "c_kv8")
    assert all(s > 0 for name in names for s in profile.seconds[name])
    profile.check(model.spec)  # the hybrid's costs are all there
    assert profile.plan(model.spec, 128).layers
