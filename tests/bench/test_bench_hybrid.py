"""``hcache bench hybrid``: a hybrid's bytes by layer type and its restores against recompute, beside Qwen3."""

import json

import pytest

from hcache.cli import main


@pytest.mark.slow
def test_bench_hybrid_reports_the_state_bytes_by_layer_type_and_restores_each_history(tmp_path):
    """Qwen3-Next's gated delta nets store their state once a chunk at ``state_every=1`` and a quarter of that at
    4, its attention layers K/V as Qwen3's do; every returning turn restores the whole history."""
    out = tmp_path / "hybrid.json"
    args = ["bench", "hybrid", "--histories", "256", "--layers", "4", "--hidden", "128", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    row = result["histories"]["256"]
    dense, every, fourth = row["qwen3"], row["qwen3_next state_every=1"], row["qwen3_next state_every=4"]
    state = every["stored_bytes_per_token"]["gated_delta_net"]
    assert state == 3 * 4 * result["hybrid"]["mamba"]["conv_dim"] * 4 / 64 + 3 * 4 * 2 * 128 * 128 / 64
    assert fourth["stored_bytes_per_token"]["gated_delta_net"] == state / 4
    assert dense["stored_bytes_per_token"] == {"full_attention": 4 * every["stored_bytes_per_token"]["full_attention"]}
    assert all(r["restored_tokens"] == 256 and r["median_ttft_s"] > 0 for r in row.values())
