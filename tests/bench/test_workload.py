"""Workload traces reproduce the published statistics, and ``hcache bench workload`` reports every method."""
import argparse
import json
import random

import numpy as np
import pytest

from hcache.cli import main
from hcache.bench.traces import CHAT, LEVAL, chat_trace, leval_trace, load_sharegpt


@pytest.fixture
def seed() -> int:
    """A fresh seed each run; it is in the captured output of a failing test."""
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed={seed}")
    return seed


def _close(measured: float, target: float) -> bool:
    return abs(measured / target - 1) <= 0.10


@pytest.mark.parametrize("preset", sorted(CHAT))
def test_chat_trace_matches_the_published_means(preset, seed):
    stats, rate = CHAT[preset], 2.5
    trace = chat_trace(preset, sessions=20000, rate=rate, seed=seed)
    turns = [t for s in trace.sessions for t in s.turns]
    measured = {
        "turns": np.mean([len(s.turns) for s in trace.sessions]),
        "input_tokens": np.mean([t.input_tokens for t in turns]),
        "output_tokens": np.mean([t.output_tokens for t in turns]),
        "think_s": np.mean([t.think_s for s in trace.sessions for t in s.turns[1:]]),
    }
    for name, value in measured.items():
        assert _close(value, getattr(stats, name)), (name, value, getattr(stats, name))
    assert all(s.turns[0].think_s == 0 for s in trace.sessions)
    assert _close(np.mean(np.diff([s.arrival_s for s in trace.sessions])), 1 / rate)


@pytest.mark.parametrize("preset", sorted(LEVAL))
def test_leval_trace_matches_the_published_means(preset, seed):
    stats = LEVAL[preset]
    trace = leval_trace(preset, sessions=20000, seed=seed)
    turns = [t for s in trace.sessions for t in s.turns]
    assert _close(np.mean([s.context_tokens for s in trace.sessions]), stats.context_tokens)
    assert _close(np.mean([t.input_tokens for t in turns]), stats.input_tokens)
    assert _close(np.mean([t.output_tokens for t in turns]), stats.output_tokens)
    assert _close(np.mean([len(s.turns) for s in trace.sessions]), stats.questions)
    assert len({s.document for s in trace.sessions}) == 20000  # no reuse without zipf


def test_zipf_reuse_follows_zipf_popularity(seed):
    trace = leval_trace("leval-quality", sessions=20000, seed=seed, documents=100, zipf=1.0)
    counts = np.bincount([s.document for s in trace.sessions], minlength=100)
    harmonic = sum(1 / k for k in range(1, 101))
    assert _close(counts[0] / 20000, 1 / harmonic) and _close(counts[1] / 20000, 1 / (2 * harmonic))
    by_doc = {}
    for s in trace.sessions:  # a reused document keeps its length, so its tokens can be shared
        assert by_doc.setdefault(s.document, s.context_tokens) == s.context_tokens


def test_same_seed_same_trace_and_rate_only_rescales_arrivals(seed):
    a, b = chat_trace("sharegpt", 50, rate=1.0, seed=seed), chat_trace("sharegpt", 50, rate=1.0, seed=seed)
    assert a == b
    assert chat_trace("sharegpt", 50, rate=1.0, seed=seed + 1) != a
    faster = chat_trace("sharegpt", 50, rate=4.0, seed=seed)
    assert [s.turns for s in faster.sessions] == [s.turns for s in a.sessions]
    assert np.allclose([s.arrival_s * 4 for s in faster.sessions], [s.arrival_s for s in a.sessions])


def test_scaled_trace_respects_every_cap(seed):
    trace = leval_trace("leval-gsm100", 200, seed=seed).scaled(0.05, max_output=3, max_tokens=1024, max_turns=2, think_scale=0.1)
    assert trace.sessions
    for s in trace.sessions:
        assert 1 <= len(s.turns) <= 2 and s.total_tokens <= 1024
        assert all(t.output_tokens <= 3 and t.input_tokens >= 1 for t in s.turns)
    full = leval_trace("leval-quality", 200, seed=seed)
    kept = full.scaled(0.1, max_tokens=700)
    first = [max(1, round(s.context_tokens * 0.1)) + sum(max(1, round(n * 0.1)) for n in (s.turns[0].input_tokens, s.turns[0].output_tokens))
             for s in full.sessions]
    assert 0 < len(kept.sessions) == sum(n <= 700 for n in first) < len(full.sessions)  # too long a first turn: dropped
    assert all(s.total_tokens <= 700 for s in kept.sessions)


def test_bad_trace_parameters_are_refused():
    with pytest.raises(ValueError, match="rate"):
        chat_trace("sharegpt", 10, rate=0)
    with pytest.raises(ValueError, match="sessions"):
        chat_trace("sharegpt", 0)
    with pytest.raises(ValueError, match="unknown trace preset"):
        chat_trace("leval-quality")
    with pytest.raises(ValueError, match="caps"):
        chat_trace("sharegpt", 10).scaled(max_output=0)
    with pytest.raises(ValueError, match="scale"):
        chat_trace("sharegpt", 10).scaled(scale=-1)


def test_sharegpt_file_loads_as_a_trace(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [
            {"from": "human", "value": "one two three"}, {"from": "gpt", "value": "a b"},
            {"from": "human", "value": "four"}, {"from": "gpt", "value": "c d e f"},
        ]},
        {"conversations": [{"from": "gpt", "value": "greeting"}, {"from": "human", "value": "x y"}, {"from": "gpt", "value": "z"}]},
        {"conversations": [{"from": "human", "value": "unanswered"}]},
    ]))
    trace = load_sharegpt(path, lambda text: len(text.split()), rate=2.0, think_s=10.0)
    assert [[(t.input_tokens, t.output_tokens) for t in s.turns] for s in trace.sessions] == [[(3, 2), (1, 4)], [(2, 1)]]
    assert trace.sessions[0].turns[0].think_s == 0 and trace.sessions[0].turns[1].think_s > 0
    assert trace.sessions[0].arrival_s < trace.sessions[1].arrival_s
    assert load_sharegpt(path).sessions[0].turns[0].input_tokens == 3  # 13 characters at about 4 a token
    with pytest.raises(ValueError, match="no ShareGPT file"):
        load_sharegpt(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="list of conversations"):
        load_sharegpt(tmp_path / "bad.json")


def test_bench_workload_reports_every_method(tmp_path):
    out = tmp_path / "workload.json"
    args = ["bench", "workload", "--model", "random:llama", "--sessions", "3", "--rates", "1,8", "--scale", "1",
            "--max-output", "8", "--max-tokens", "384", "--max-turns", "4", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert set(methods) == {"ideal", "recompute", "kv", "auto", "auto_gpu_cache"} and result["rates"] == [1.0, 8.0]
    for m in methods.values():
        for key in ("ttft_p50_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s", "throughput_tok_s"):
            assert m[key] > 0, key
        assert m["ttft_p99_s"] >= m["ttft_p50_s"] and m["requests"] == result["trace"]["requests"]
        assert [r["rate"] for r in m["by_rate"]] == [1.0, 8.0]
    assert methods["recompute"]["bytes_per_token"] == 0 and methods["ideal"]["bytes_per_token"] == 0
    assert methods["kv"]["bytes_per_token"] > 0 and methods["auto"]["bytes_per_token"] > 0
    assert methods["recompute"]["by_rate"][0]["restored_tokens"] == 0 < methods["kv"]["by_rate"][0]["restored_tokens"]
    assert methods["kv"]["restore_tokens_per_s"] > 0 and methods["recompute"]["restore_tokens_per_s"] is None
    assert methods["kv"]["restore_share"] > 0 and methods["ideal"]["restore_share"] == 0
    # every returning turn finds its history in the GPU cache (4 histories fit), and the tokens it adopts
    # are more than auto alone restores (the partial last chunk too)
    cached, alone = methods["auto_gpu_cache"]["by_rate"][0], methods["auto"]["by_rate"][0]
    assert cached["gpu_cache_hit_rate"] > 0 and methods["auto"]["gpu_cache_hit_rate"] is None
    assert cached["restored_tokens"] > alone["restored_tokens"] and cached["gpu_tokens"] > 0
    rows = (tmp_path / "workload.csv").read_text().splitlines()
    assert rows[0].startswith("method,rate,ttft_p50_s") and len(rows) == 1 + 5 * 2
    assert (tmp_path / "workload.png").stat().st_size > 0


def test_bench_workload_replays_each_eviction_policy_side_by_side(tmp_path, capsys):
    out = tmp_path / "eviction.json"
    args = ["bench", "workload", "--model", "random:llama", "--sessions", "3", "--rates", "2", "--scale", "1", "--max-output", "8",
            "--max-tokens", "384", "--max-turns", "4", "--methods", "auto_gpu_cache", "--eviction", "cost,lru", "--kv-blocks", "6",
            "--host-mib", "1", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["eviction"] == ["cost", "lru"] and result["trace"]["host_mib"] == 1
    runs = {name: m["by_rate"][0] for name, m in result["methods"].items()}
    assert set(runs) == {"auto_gpu_cache:cost", "auto_gpu_cache:lru"}
    assert runs["auto_gpu_cache:cost"]["replies"] == runs["auto_gpu_cache:lru"]["replies"]  # eviction changes no reply
    for r in runs.values():
        assert r["tier_tokens"]["gpu_cache"] == r["gpu_tokens"] > 0
        assert sum(r["tier_tokens"].values()) == r["restored_tokens"]
    assert "cost/lru: TTFT p50" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--rates", "0,1"], ["--rates", "fast"], ["--max-tokens", "4096"], ["--methods", "kv,magic"], ["--kv-blocks", "3"],
                                 ["--eviction", "lfu"], ["--host-mib", "0"]])
def test_bench_workload_refuses_bad_options(bad, capsys):
    assert main(["bench", "workload", "--model", "random:llama", "--sessions", "2", *bad]) == 2
    assert "hcache: error:" in capsys.readouterr().err


def test_bench_workload_replays_through_mii(tmp_path):
    out = tmp_path / "mii.json"
    args = ["bench", "workload", "--through", "mii", "--engine", "reference", "--model", "random:llama", "--sessions", "2",
            "--rates", "4", "--scale", "1", "--max-output", "4", "--max-tokens", "384", "--max-turns", "3", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert set(methods) == {"recompute", "kv", "auto", "auto_gpu_cache"} and result["through"] == "mii (reference)"
    for m in methods.values():
        assert m["ttft_p50_s"] > 0 and m["tbt_mean_s"] > 0 and m["requests"] == result["trace"]["requests"]
    runs = {name: m["by_rate"][0] for name, m in methods.items()}
    assert len({json.dumps(r["replies"], sort_keys=True) for r in runs.values()}) == 1  # greedy: restoring changes no reply
    assert runs["recompute"]["restored_tokens"] == 0 and methods["recompute"]["bytes_per_token"] == 0
    assert runs["kv"]["restored_tokens"] > 0 and runs["auto"]["restored_tokens"] > 0
    assert runs["auto_gpu_cache"]["gpu_cache_hit_rate"] > 0 and runs["auto_gpu_cache"]["gpu_tokens"] > 0


def test_bench_workload_through_mii_refuses_runtime_only_methods(capsys):
    assert main(["bench", "workload", "--through", "mii", "--engine", "reference", "--methods", "ideal,kv"]) == 2
    assert "--through mii" in capsys.readouterr().err


def test_through_mii_fastgen_gets_kv_blocks_in_its_own_block_size(monkeypatch):
    """FastGen sizes its cache from MII's engine config, in blocks of its own size (128 rows for a head size
    of 64, 64 for 128): ``--kv-blocks`` of 64 tokens are converted, rounding up."""
    from deepspeed.inference.v2.kernels.ragged_ops.blocked_flash import blocked_flash

    from hcache.bench.workload import _fastgen_memory

    monkeypatch.setattr(blocked_flash, "get_kv_block_size", lambda head_size: 128 if head_size <= 64 else 64)
    args = argparse.Namespace(kv_blocks=5, max_tokens=1024)
    assert _fastgen_memory(args, 64) == {"state_manager": {"memory_config": {"mode": "allocate", "size": 3}}}
    assert _fastgen_memory(args, 128)["state_manager"]["memory_config"]["size"] == 5
