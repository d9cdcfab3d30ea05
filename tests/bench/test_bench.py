"""Benchmarks run end to end on a tiny model and report the figures their issues name."""

import json
import shutil
import subprocess

import pytest

from hcache.cli import main
from hcache.machine.facts import SOURCE_ROOT, source_commit
from hcache.version import __version__


def _git(root, *args: str) -> str:
    command = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_source_commit_names_the_checkouts_commit_dirty_if_tracked_files_changed(tmp_path, monkeypatch):
    """Every kept result records source_commit(): the short commit of hcache's own checkout, "+dirty" when a
    tracked file has uncommitted changes (an untracked file does not count), else the package version: for a
    directory that is no repository, one inside another repository (a wheel in site-packages under some
    project's checkout), a repository with no commit yet, and a machine without git."""
    repo = tmp_path / "repo"
    (repo / "hcache").mkdir(parents=True)
    _git(repo, "init", "-q")
    assert source_commit(repo) == __version__  # no commit yet
    (repo / "hcache" / "a.py").write_text("x = 1\n")
    _git(repo, "add", "hcache/a.py")
    _git(repo, "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert source_commit(repo) == head
    (repo / "results.json").write_text("{}")
    assert source_commit(repo) == head  # untracked
    (repo / "hcache" / "a.py").write_text("x = 2\n")
    assert source_commit(repo) == head + "+dirty"
    assert source_commit(repo / "hcache") == __version__  # inside another repository
    assert source_commit(tmp_path) == __version__  # not a repository
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert source_commit(repo) == __version__  # no git


def test_source_commit_of_this_source():
    if not (SOURCE_ROOT / ".git").exists() or shutil.which("git") is None:
        assert source_commit() == __version__
        return
    head = _git(SOURCE_ROOT, "rev-parse", "--short", "HEAD")
    assert source_commit() in (head, head + "+dirty")


@pytest.mark.slow
def test_bench_restore_reports_every_method_the_bound_and_the_regret(tmp_path):
    out = tmp_path / "restore.json"
    args = [
        "bench",
        "restore",
        "--model",
        "random:llama",
        "--histories",
        "64,128",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"RE", "H", "KV", "RE+KV", "auto"}
    for method in result["methods"].values():
        assert len(method["tokens_per_s"]) == 2 and all(x > 0 for x in method["tokens_per_s"])
    assert "H" not in result["methods"]["RE+KV"]["plans"][0]
    assert len(result["bound_tokens_per_s"]) == 2 and result["auto_regret"] == max(result["auto_regret_by_history"])
    assert result["machine"]["cpu_count"] and result["command"].startswith("hcache bench restore")
    assert result["commit"] == source_commit() and result["machine"]["torch_threads"] >= 1
    assert (tmp_path / "restore.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_mii_compares_methods_through_mii(tmp_path):
    """Through MII's own pipeline: every method gives the same tokens, and kv and h restore the history."""
    out = tmp_path / "mii.json"
    args = [
        "bench",
        "mii",
        "--engine",
        "reference",
        "--model",
        "random:llama",
        "--history",
        "192",
        "--turn",
        "16",
        "--new-tokens",
        "16",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]  # decode time well above the calls' noise
    assert main(args) == 0
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert set(methods) == {"recompute", "kv", "h"} and result["engine"] == "reference"
    assert all(m["tokens_match"] and m["ttft_s_median"] > 0 for m in methods.values())
    assert methods["recompute"]["restored_tokens"] == 0
    assert methods["kv"]["restored_tokens"] == methods["h"]["restored_tokens"] == 192
    assert all(m["prefill_s"] > 0 and m["decode_s_per_token"] > 0 and m["prefill_cost"] > 0 for m in methods.values())
    assert methods["recompute"]["prefill_cost"] == methods["recompute"]["decode_cost"] == 1


def test_bench_transfer_reports_the_data_path_against_a_copy(tmp_path):
    out = tmp_path / "transfer.json"
    args = [
        "bench",
        "transfer",
        "--shape",
        "llama",
        "--layers",
        "2",
        "--history",
        "256",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for name in ("kv_restore_vs_copy", "saver_ingest_vs_copy", "h_vs_kv", "h_vs_recompute", "h_vs_bound", "copy_gb_s"):
        assert result[name] > 0, name
    assert set(result["restore_s"]) == {"KV", "H", "RE"} and result["history"] == 256 and result["layers"] == 2


def test_bench_paged_reports_the_vllm_connectors_core_against_its_floors(tmp_path):
    """``hcache check``'s section for vLLM's connector, at CI's size: the paged loader's KV and H loads into a
    FlashAttention-layout cache, without vLLM, against the copy of the same bytes and H's bound."""
    out = tmp_path / "paged.json"
    args = [
        "bench",
        "paged",
        "--shape",
        "llama",
        "--layers",
        "2",
        "--history",
        "256",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for name in ("kv_load_vs_copy", "h_load_vs_bound", "h_vs_kv", "copy_gb_s", "kv_load_gb_s"):
        assert result[name] > 0, name
    assert set(result["load_s"]) == {"KV", "H"} and result["history"] == 256 and result["layers"] == 2


@pytest.mark.slow
def test_bench_window_compares_the_window_rule_with_storing_every_token(tmp_path):
    """Sliding-window layers by Jenga's rule store and read fewer bytes a token than storing every token,
    and restore the same tokens: on Gemma 3, whose sliding and full layers rotate by two RoPE bases."""
    out = tmp_path / "window.json"
    args = [
        "bench",
        "window",
        "--family",
        "gemma3_text",
        "--window",
        "128",
        "--multiples",
        "2,4",
        "--layers",
        "4",
        "--hidden",
        "128",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["family"] == "gemma3_text" and result["model"]["sliding_rope"] is not None
    assert set(result["histories"]) == {"256", "512"}
    for history, row in result["histories"].items():
        window, every = row["window"], row["all"]
        assert window["restored_tokens"] == every["restored_tokens"] == int(history)
        assert window["stored_bytes_per_token"] < every["stored_bytes_per_token"], history
        assert (
            window["read_bytes_per_token"]["sliding_attention"] < every["read_bytes_per_token"]["sliding_attention"]
        ), history
        assert window["read_bytes_per_token"]["full_attention"] == every["read_bytes_per_token"]["full_attention"], (
            history
        )
        assert row["window_over_all"]["stored_bytes"] < 1 and window["median_ttft_s"] > 0


@pytest.mark.slow
def test_bench_storage_measures_the_disk_store_against_raw_o_direct_io(tmp_path):
    """The default path: the chunk store on a directory against raw sequential I/O of the same bytes, and the
    saver's cost on a decode loop (O_DIRECT where the file system allows it; the result says which)."""
    out = tmp_path / "storage.json"
    args = [
        "bench",
        "storage",
        "--dirs",
        str(tmp_path / "store"),
        "--chunks",
        "4",
        "--layers",
        "2",
        "--repeats",
        "1",
        "--model",
        "random:llama",
        "--batch",
        "2",
        "--steps",
        "3",
        "--rounds",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for name in ("write_ratio", "read_ratio", "store_write_mb_s", "raw_write_mb_s", "store_read_mb_s", "raw_read_mb_s"):
        assert result[name] > 0, name
    assert result["directories"] == 1 and set(result["direct_io"]) == {"store", "raw"}
    assert result["saver_chunks_published"] > 0 and result["step_ms_on"] > 0 and result["step_ms_off"] > 0
    assert result["commit"] == source_commit() and result["command"].startswith("hcache bench storage")
    assert not list((tmp_path / "store").glob("hcache-bench-*"))  # its files removed


@pytest.mark.slow
def test_bench_storage_measures_a_redis_tier_of_its_own_against_redis_py(tmp_path):
    from hcache.storage.redis_server import redis_missing

    if why := redis_missing():
        pytest.skip(why)
    out = tmp_path / "storage.json"
    args = [
        "bench",
        "storage",
        "--tier",
        "redis",
        "--chunks",
        "4",
        "--layers",
        "2",
        "--repeats",
        "1",
        "--model",
        "random:llama",
        "--batch",
        "2",
        "--steps",
        "3",
        "--rounds",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    for name in (
        "redis_read_ratio",
        "redis_write_ratio",
        "redis_layer_values_ratio",
        "store_read_mb_s",
        "raw_read_mb_s",
    ):
        assert result[name] > 0, name
    assert result["saver_chunks_published"] > 0 and "step_ms_on" in result


@pytest.mark.slow
def test_bench_quota_counts_the_tokens_a_quota_keeps_restorable_across_a_restart(tmp_path):
    out = tmp_path / "quota.json"
    assert main(["bench", "quota", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shared_chunk_kept"] and result["chunks_kept"] == 4
    # every prompt restores the shared chunk, and three their own; which three depends on the order in
    # which the two write-back threads put the first round's chunks, each evicting the oldest
    assert sorted(result["restored_tokens_per_prompt"]) == [64, 64, 64, 128, 128, 128]


@pytest.mark.slow
def test_bench_startup_times_start_ups_with_the_self_check_off_and_on_and_the_check_alone(tmp_path):
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--model", "random:llama", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["methods_checked"] == ["H"]  # the MHA default plan stores H
    assert len(result["startup_off_s"]) == len(result["startup_on_s"]) == len(result["check_s"]) == 2
    assert 0 < result["median_check_s"] and result["cost"] == result["median_check_s"] / result["median_startup_off_s"]
    assert "stop_s" not in result  # a runtime is closed, not stopped by a signal


@pytest.mark.slow
def test_bench_cold_reads_a_quarter_of_the_bytes_from_each_tier_in_8_bits(tmp_path):
    """Cold restores (nothing in the host pool) of each plan from the disk store, lossless against 8-bit;
    every restore must be whole (the bench refuses a short one), and the 8-bit one reads about a quarter of a
    float32 model's bytes, scales and headers included."""
    out = tmp_path / "cold.json"
    args = [
        "bench",
        "cold",
        "--model",
        "random:llama",
        "--history",
        "128",
        "--tiers",
        "disk",
        "--repeats",
        "2",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["history"] == 128 and result["stored_dtype"] == "8bit"
    for plan in ("KV", "H"):
        row = result["tiers"]["disk"][plan]
        assert all(s > 0 for s in row["seconds"].values())
        assert 0.25 <= row["bytes_ratio"] <= 0.3 and row["bytes_read"]["8bit"] < row["bytes_read"]["lossless"]


@pytest.mark.slow
def test_bench_quality_scores_8_bit_restores_of_real_text_against_lossless(tmp_path):
    """A short run on SmolLM2 over the real text: the 8-bit restore is scored at every position after a
    restored history, agrees with the lossless one nearly everywhere without being identical, and the
    measurements behind the choice of encodings are there (fp8 H closer than int8 H; a quarter of float32's
    bytes, about half of bfloat16's)."""
    out = tmp_path / "quality.json"
    args = [
        "bench",
        "quality",
        "--document-tokens",
        "128",
        "--reply-tokens",
        "32",
        "--rows",
        "H fp8",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads(out.read_text())
    row = result["quality"]["H fp8"]
    assert row["positions"] == result["positions"] > 200 and list(result["quality"]) == ["H fp8"]
    assert 0.95 <= row["top1"] <= 1 and not row["identical"] and 0 < row["kl_mean"] <= row["kl_max"]
    assert abs(row["ppl_increase"]) < 0.02
    errors = result["relative_rms_error"]["H"]
    assert len(errors["fp8"]) == 30 and max(errors["fp8"]) < max(errors["int8"])
    ratios = result["stored_bytes_ratio"]
    assert 0.25 <= ratios["H fp8 vs float32"] < 0.26 and 0.5 <= ratios["KV int8 vs bfloat16"] <= 0.52
