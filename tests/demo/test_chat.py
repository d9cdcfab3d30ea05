import json

import pytest

import hcache.demo.chat
from hcache.cli import main
from hcache.demo.chat import run_demo
from hcache.errors import InvalidRequestError
from hcache.machine.facts import source_commit


@pytest.mark.slow
def test_demo_restores_every_turn_by_every_method_with_identical_replies(smollm2, tmp_path, capsys):
    """The demo's default model is SmolLM2: skipped where it is not installed. Each method runs three times
    per turn by default (interleaved with the others); its TTFT is their median, shown with their range,
    and every run's reply is checked. The JSON records the source's commit and the machine."""
    out = tmp_path / "demo.json"
    assert main(["demo", "--turns", "2", "--max-new-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_identical"] is True and len(report["turns"]) == 2
    assert report["commit"] == source_commit() and report["machine"]["cpu_count"]
    assert report["demo"]["repeats"] == 3 and report["demo"]["max_new_tokens"] == 12
    last = report["turns"][-1]["methods"]
    assert {"recompute", "RE", "H", "KV"} <= set(last) and any(name.startswith("mixed") for name in last)
    for name, row in last.items():
        assert row["identical"] and row["fallback"] is None and row["runs_differing"] == 0
        assert row["restored_tokens"] == (
            0 if name == "recompute" else (report["turns"][-1]["prompt_tokens"] - 1) // 64 * 64
        )
        runs = row["ttft_s_runs"]
        assert len(runs) == 3 and row["ttft_s"] == sorted(runs)[1]
        assert row["ttft_s_min"] == min(runs) and row["ttft_s_max"] == max(runs) and min(runs) > 0
    assert last["H"]["stored_bytes_per_token"] == 30 * 576 * 4
    assert last["KV"]["stored_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    printed = capsys.readouterr().out
    assert "all restored replies identical" in printed and "min-max ms" in printed
    assert printed.count("TTFT: median of 3 runs per method, interleaved") == 2


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--turns", "0"]) == 2
    assert "turns must be between" in capsys.readouterr().err


def test_demo_checks_its_arguments_before_touching_the_store(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["demo", "--max-new-tokens", "-1", "--store", str(store)]) == 2
    assert "max_new_tokens must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--repeats", "0", "--store", str(store)]) == 2
    assert "repeats must be an integer of at least 1" in capsys.readouterr().err
    assert not store.exists()


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_demo_refuses_fewer_than_one_repeat_before_touching_the_store(tmp_path, repeats):
    store = tmp_path / "store"
    with pytest.raises(ValueError, match="repeats must be an integer of at least 1"):
        run_demo(turns=1, store_dir=str(store), repeats=repeats)
    assert not store.exists()


def test_demo_refuses_a_bad_stored_dtype_before_loading_the_model(monkeypatch):
    monkeypatch.setattr(hcache.demo.chat, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(InvalidRequestError, match="stored_dtype"):
        run_demo(stored_dtype="int4")
