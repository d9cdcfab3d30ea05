"""``hcache bench workload`` reports every method, through the runtime and through MII."""

import argparse
import json

import pytest

from hcache.cli import main


@pytest.mark.slow
def test_bench_workload_reports_every_method(tmp_path):
    out = tmp_path / "workload.json"
    args = [
        "bench",
        "workload",
        "--model",
        "random:llama",
        "--sessions",
        "3",
        "--rates",
        "1,8",
        "--scale",
        "1",
        "--max-output",
        "8",
        "--max-tokens",
        "384",
        "--max-turns",
        "4",
        "--json",
        str(out),
    ]
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


@pytest.mark.slow
def test_bench_workload_replays_each_eviction_policy_side_by_side(tmp_path, capsys):
    out = tmp_path / "eviction.json"
    args = [
        "bench",
        "workload",
        "--model",
        "random:llama",
        "--sessions",
        "3",
        "--rates",
        "2",
        "--scale",
        "1",
        "--max-output",
        "8",
        "--max-tokens",
        "384",
        "--max-turns",
        "4",
        "--methods",
        "auto_gpu_cache",
        "--eviction",
        "cost,lru",
        "--kv-blocks",
        "6",
        "--host-mib",
        "1",
        "--json",
        str(out),
    ]
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


@pytest.mark.parametrize(
    "bad",
    [
        ["--rates", "0,1"],
        ["--rates", "fast"],
        ["--max-tokens", "4096"],
        ["--methods", "kv,magic"],
        ["--kv-blocks", "3"],
        ["--eviction", "lfu"],
        ["--host-mib", "0"],
    ],
)
def test_bench_workload_refuses_bad_options(bad, capsys):
    assert main(["bench", "workload", "--model", "random:llama", "--sessions", "2", *bad]) == 2
    assert "hcache: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_workload_replays_through_mii(tmp_path):
    out = tmp_path / "mii.json"
    args = [
        "bench",
        "workload",
        "--through",
        "mii",
        "--engine",
        "reference",
        "--model",
        "random:llama",
        "--sessions",
        "2",
        "--rates",
        "4",
        "--scale",
        "1",
        "--max-output",
        "4",
        "--max-tokens",
        "384",
        "--max-turns",
        "3",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert set(methods) == {"recompute", "kv", "auto", "auto_gpu_cache"} and result["through"] == "mii (reference)"
    for m in methods.values():
        assert m["ttft_p50_s"] > 0 and m["tbt_mean_s"] > 0 and m["requests"] == result["trace"]["requests"]
    runs = {name: m["by_rate"][0] for name, m in methods.items()}
    assert (
        len({json.dumps(r["replies"], sort_keys=True) for r in runs.values()}) == 1
    )  # greedy: restoring changes no reply
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
