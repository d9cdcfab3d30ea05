"""The decode benchmark's comparison (``hcache bench vllm --decode``), without vLLM: paired steps see a small
cost through a drift many times larger."""
import argparse

import numpy as np

from hcache.bench._vllm_decode import _compare, _print, paired_overhead


def test_a_2_percent_cost_is_seen_through_a_drift_of_2x():
    rng = np.random.default_rng(1)
    drift = 0.05 * (1 + np.sin(np.linspace(0, 12, 300))) + 0.05  # 50-150 ms, over the run
    base = drift * rng.normal(1, 0.01, 300)
    slower = drift * 1.02 * rng.normal(1, 0.01, 300)
    overhead, (low, high) = paired_overhead(list(slower), list(base))
    assert abs(overhead - 0.02) < 0.005 and low > 0 and low <= overhead <= high < 0.03
    assert np.median(slower) / np.median(base) - 1 != overhead  # not the unpaired medians' ratio
    same, (low, high) = paired_overhead(list(drift * rng.normal(1, 0.01, 300)), list(base))
    assert abs(same) < 0.005 and low < 0 < high


def test_the_steps_while_loading_are_compared_apart(capsys):
    base = [0.1] * 8
    saving = [0.1] * 4 + [0.15] * 4  # its last four steps ran while loads were in flight
    loading = [False] * 4 + [True] * 4
    out = _compare({"vllm": base, "hcache_saving": saving}, loading, {"host_pool": 128})
    assert out["vllm"]["overhead"] == 0 and out["hcache_saving"]["not_loading_overhead"] == 0
    assert abs(out["hcache_saving"]["loading_overhead"] - 0.5) < 1e-9 and out["hcache_saving"]["loaded_tokens_by_tier"] == {"host_pool": 128}
    assert "loading" not in _compare({"vllm": base, "hcache_saving": base}, [False] * 8, {})["hcache_saving"]
    _print({"1x1024": out}, argparse.Namespace(model="m", dtype="bfloat16", steps=8, repeats=1, block=4))
    saving = next(line for line in capsys.readouterr().out.splitlines() if "hcache_saving" in line)
    assert saving.split()[3:5] == ["+0.0%", "[+0.0,"] and "+50.0%" in saving  # not the +25% of every turn mixed
