"""The decode benchmark's comparison (``hcache bench vllm --decode``), without vLLM: paired steps see a small
cost through a drift many times larger."""

import argparse
import time
import types

import numpy as np

from hcache.bench._vllm_decode import _compare, _interleaved, _print, paired_overhead


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
    assert abs(out["hcache_saving"]["loading_overhead"] - 0.5) < 1e-9 and out["hcache_saving"][
        "loaded_tokens_by_tier"
    ] == {"host_pool": 128}
    assert "loading" not in _compare({"vllm": base, "hcache_saving": base}, [False] * 8, {})["hcache_saving"]
    _print({"1x1024": out}, argparse.Namespace(model="m", dtype="bfloat16", steps=8, repeats=1, block=4))
    saving = next(line for line in capsys.readouterr().out.splitlines() if "hcache_saving" in line)
    assert saving.split()[3:5] == ["+0.0%", "[+0.0,"] and "+50.0%" in saving  # not the +25% of every turn mixed


class _Engine:
    """vLLM's engine as the turns drive it: decoding requests give a token every step; a returning request
    answers ``wait`` steps after it arrives (the saving engine's, once its load is done) and leaves."""

    def __init__(self, wait: int, clock: list[float]):
        self.wait, self.arrived, self.left, self.clock = wait, [], {}, clock
        self.decoding: set[str] = set()
        self.engine_core = types.SimpleNamespace(call_utility=lambda *args: None)

    def add_request(self, rid, prompt, params):
        if rid.startswith("r"):
            self.arrived.append(len(prompt["prompt_token_ids"]))
            self.left[rid] = self.wait
        else:
            self.decoding.add(rid)

    def step(self):
        self.clock[0] += 1 + len(self.left)  # a step with a returning request in it is slower
        for rid in self.left:
            self.left[rid] -= 1
        answered = [rid for rid, n in self.left.items() if n <= 0]
        for rid in answered:
            del self.left[rid]
        token = [types.SimpleNamespace(token_ids=[1])]
        return [types.SimpleNamespace(request_id=rid, outputs=token) for rid in sorted(self.decoding) + answered]

    def abort_request(self, ids):
        self.decoding -= set(ids)

    def has_unfinished_requests(self):
        return bool(self.decoding or self.left)


def test_every_engine_gets_the_returning_requests_at_the_same_turns_and_their_answering_steps_are_not_timed(
    monkeypatch,
):
    """The saving engine loads their histories; the others are asked the question alone, so that a loading
    turn differs from theirs by the loads only. Steps take the time of a clock the engines advance."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    engines = {"vllm": _Engine(1, clock), "hcache_saving": _Engine(3, clock), "hcache_not_saving": _Engine(1, clock)}
    history, question = [5] * 128, [13] * 8
    means, during = _interleaved(engines, [[1] * 70], [history], steps=16, block=4)
    assert engines["hcache_saving"].arrived == [len(history + question)] * 2  # at the second and fourth turns
    assert engines["vllm"].arrived == engines["hcache_not_saving"].arrived == [1 + len(question)] * 2
    assert during == [False, True, False, True]
    # the saving engine's loads span its turn's first two steps (timed, slower); the answering step is not timed
    assert all(len(m) == 4 for m in means.values()) and means["hcache_saving"][1] > means["hcache_saving"][0]
    assert means["vllm"][1] == means["vllm"][0] == 1  # its one step with the question in it was left out
