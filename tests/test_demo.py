import json

from hcache.cli import main


def test_demo_restores_every_turn_by_every_method_with_identical_replies(smollm2, tmp_path, capsys):
    """The demo's default model is SmolLM2: skipped where it is not installed."""
    out = tmp_path / "demo.json"
    assert main(["demo", "--turns", "2", "--max-new-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_identical"] is True and len(report["turns"]) == 2
    last = report["turns"][-1]["methods"]
    assert {"recompute", "RE", "H", "KV"} <= set(last) and any(name.startswith("mixed") for name in last)
    for name, row in last.items():
        assert row["identical"] and row["fallback"] is None
        assert row["restored_tokens"] == (0 if name == "recompute" else (report["turns"][-1]["prompt_tokens"] - 1) // 64 * 64)
    assert last["H"]["stored_bytes_per_token"] == 30 * 576 * 4
    assert last["KV"]["stored_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert "all restored replies identical" in capsys.readouterr().out


def test_demo_rejects_bad_arguments(capsys):
    assert main(["demo", "--turns", "0"]) == 2
    assert "turns must be between" in capsys.readouterr().err


def test_demo_checks_its_arguments_before_touching_the_store(tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["demo", "--max-new-tokens", "-1", "--store", str(store)]) == 2
    assert "max_new_tokens must be at least 1" in capsys.readouterr().err
    assert not store.exists()
