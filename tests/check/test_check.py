"""``hcache check`` on the CPU: the reference-engine subset it runs there, and the failures it must catch."""

import json

import pytest
import torch

from hcache.check.correctness import FAMILIES, PLANS, check_restores
from hcache.cli import main
from hcache.engine.reference import ReferenceEngine
from hcache.machine.facts import source_commit


@pytest.mark.slow
def test_check_reports_the_machine_and_passes_every_restore_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "check"
    assert main(["check", "--quick", "--out", str(out), "--store-dir", str(tmp_path / "store")]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    steps = report["steps"]
    assert report["command"].startswith("hcache check --quick") and list(steps) == [
        "environment",
        "floors",
        "correctness",
        "speed",
    ]
    assert report["commit"] == source_commit()  # the source the report speaks for
    assert steps["environment"]["torch"] == torch.__version__ and steps["environment"]["store"]["free_bytes"] > 0
    assert steps["floors"]["host_copy_gbps"] > 0 and steps["floors"]["disk_read_gbps"] > 0
    cases = steps["correctness"]["cases"]
    assert {(c["family"], c["plan"]) for c in cases} == {(f, p) for f in FAMILIES for p in PLANS}
    assert all(c["ok"] and c["restored_tokens"] == c["expected_tokens"] > 0 for c in cases), cases
    assert all(c["lossy"] == c["plan"].endswith(" 8bit") and (c["tokens_equal"] or c["lossy"]) for c in cases), cases
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in steps["speed"]["skipped"]
    table = out.with_suffix(".md").read_text()
    assert "| reference | phi3 | float32 | 1RE+1H+1KV | 191/191 | True |" in table and "**NO**" not in table
    assert "correctness: every case passed" in capsys.readouterr().out


@pytest.mark.slow
def test_a_wrong_restore_fails_its_cases(monkeypatch):
    """Hidden states restored off by a small amount: the plans that use H fail, and only those."""
    restore = ReferenceEngine.restore_from_hidden
    monkeypatch.setattr(
        ReferenceEngine,
        "restore_from_hidden",
        lambda self, uid, layer, hidden, start=0: restore(self, uid, layer, hidden * 1.001, start),
    )
    cases = {c["plan"]: c for c in check_restores(["reference"], ("llama",))}
    assert [plan for plan, c in cases.items() if not c["ok"]] == ["H", "1RE+1H+1KV"]
    assert cases["H"]["worst_excess"] > 0 and cases["KV"]["worst_excess"] <= 0


@pytest.mark.slow
def test_a_wrong_8_bit_restore_fails_its_case(monkeypatch):
    """KV dequantised with scales 20% too large: the 8-bit KV case fails, and the lossless ones pass."""
    import hcache.ops.paged_layout as paged_layout  # the KV restore's cache write, for every engine
    from hcache.ops.quant import QuantRows

    write = paged_layout.write_rows

    def skewed(cache, runs, slots, parts, start):
        write(
            cache,
            runs,
            slots,
            [QuantRows(p.codes, p.scale * 1.2) if isinstance(p, QuantRows) else p for p in parts],
            start,
        )

    monkeypatch.setattr(paged_layout, "write_rows", skewed)
    cases = {c["plan"]: c for c in check_restores(["reference"], ("llama",))}
    assert [plan for plan, c in cases.items() if not c["ok"]] == ["KV 8bit"]
    assert cases["KV 8bit"]["worst_excess"] > 0.1 and cases["KV 8bit"]["lossy"]


def test_a_failed_case_or_step_is_recorded_and_the_command_exits_1(tmp_path, monkeypatch, capsys):
    failing = {
        "engine": "reference",
        "family": "llama",
        "dtype": "float32",
        "plan": "H",
        "restored_tokens": 191,
        "expected_tokens": 191,
        "fallback": None,
        "tokens_equal": False,
        "worst_excess": 0.5,
        "ok": False,
    }
    monkeypatch.setattr("hcache.check.correctness.check_restores", lambda engines, progress=None: [failing])

    def no_disk(*args):
        raise OSError("disk gone")

    monkeypatch.setattr("hcache.check.floors.measure_floors", no_disk)
    out = tmp_path / "check"
    assert main(["check", "--quick", "--out", str(out)]) == 1
    steps = json.loads(out.with_suffix(".json").read_text())["steps"]
    assert (
        steps["floors"]["error"] == "OSError: disk gone"
        and steps["correctness"]["cases"] == [failing]
        and "speed" in steps
    )
    assert "| reference | llama | float32 | H | 191/191 | False | 0.5 | **NO** |" in out.with_suffix(".md").read_text()
    assert "1 case(s) failed: reference llama H" in capsys.readouterr().out


def test_without_out_or_save_the_check_writes_nothing_and_prints_its_report(tmp_path, monkeypatch, capsys):
    case = {
        "engine": "reference",
        "family": "llama",
        "dtype": "float32",
        "plan": "KV",
        "restored_tokens": 191,
        "expected_tokens": 191,
        "fallback": None,
        "tokens_equal": True,
        "worst_excess": -1e-6,
        "ok": True,
    }
    monkeypatch.setattr("hcache.check.correctness.check_restores", lambda engines, progress=None: [case])
    monkeypatch.setattr("hcache.check.floors.measure_floors", lambda store, quick: {"host_copy_gbps": 1.0})
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--quick"]) == 0
    assert not list(tmp_path.iterdir())
    out = capsys.readouterr().out
    assert "| reference | llama | float32 | KV | 191/191 | True |" in out and "| host_copy_gbps | 1 |" in out
    assert "correctness: every case passed (--out PATH or --save keeps this report)" in out


def test_the_check_runs_on_fastgen_the_families_it_serves_and_the_rest_on_the_reference_engine():
    from hcache.check.correctness import families_on
    from hcache.engine.fastgen import check_model_type
    from hcache.errors import UnsupportedModelError

    alone = {"qwen3", "gemma2", "gemma3_text", "granitemoehybrid", "qwen3_next"}  # the reference engine's alone
    assert families_on("reference") == tuple(FAMILIES) and alone <= set(FAMILIES)
    for family in families_on("fastgen"):
        check_model_type(family)  # raises for a family FastGen does not serve
    for family in alone:
        with pytest.raises(UnsupportedModelError):
            check_model_type(family)
    assert set(families_on("fastgen")) == set(FAMILIES) - alone


@pytest.mark.slow
def test_a_family_that_cannot_run_fails_its_cases_and_the_others_still_run(monkeypatch):
    from hcache.check import correctness as module

    build = module._engine

    def engine(kind, family, tmp):
        if family == "qwen2":
            raise RuntimeError("no engine for qwen2")
        return build(kind, family, tmp)

    monkeypatch.setattr(module, "_engine", engine)
    cases = check_restores(["reference"], ("qwen2", "llama"))
    assert [(c["family"], c["ok"]) for c in cases] == [("qwen2", False)] * len(PLANS) + [("llama", True)] * len(PLANS)
    assert cases[0]["error"] == "RuntimeError: no engine for qwen2"
    from hcache.check.command import markdown

    table = markdown(
        {
            "machine": {"gpu": None, "cpu": "x", "date": "d"},
            "command": "c",
            "steps": {"correctness": {"cases": cases, "seconds": 1}},
        }
    )
    assert "| reference | qwen2 | | RE | could not run: `RuntimeError: no engine for qwen2` | | | **NO** |" in table


@pytest.mark.slow
def test_the_speed_step_runs_each_benchmark_as_its_command_and_keeps_its_figures():
    """``hcache bench transfer`` run in a child process, as the speed step runs it on a GPU: its figures come
    back without the record ``--json`` adds (the report has its own commit and machine)."""
    from hcache.check.speed import RECORD, _bench

    result = _bench(
        "transfer", ["--shape", "llama", "--layers", "2", "--history", "128", "--repeats", "1", "--device", "cpu"]
    )
    assert result["history"] == 128 and result["layers"] == 2 and result["kv_restore_vs_copy"] > 0
    assert not set(RECORD) & set(result)


def test_a_benchmark_that_fails_fails_the_speed_step_naming_it():
    import pytest

    from hcache.check.speed import _bench

    with pytest.raises(RuntimeError, match="hcache bench transfer --history 1 exited with status 2"):
        _bench("transfer", ["--history", "1"])  # less than a chunk: the benchmark refuses it


def test_on_a_gpu_the_speed_step_runs_the_benchmarks_the_targets_name(monkeypatch):
    from hcache.check import speed

    ran = []
    monkeypatch.setattr(speed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(speed, "_bench", lambda name, argv: ran.append((name, argv)) or {"figure": len(ran)})
    results = speed.measure_speed(quick=True, progress=lambda name: None)
    assert ran == [
        ("transfer", ["--history", "1024"]),
        ("transfer", ["--history", "4096"]),
        ("paged", ["--history", "1024"]),
        ("paged", ["--history", "4096"]),
        ("ops", ["--tokens", "4096"]),
    ]
    assert results == {
        "transfer_1024": {"figure": 1},
        "transfer_4096": {"figure": 2},
        "vllm_paged_1024": {"figure": 3},
        "vllm_paged_4096": {"figure": 4},
        "ops": {"figure": 5},
    }
    ran.clear()
    assert list(speed.measure_speed(quick=False, progress=lambda name: None)) == [
        "transfer_1024",
        "transfer_4096",
        "transfer_16384",
        "vllm_paged_1024",
        "vllm_paged_4096",
        "vllm_paged_16384",
        "ops",
        "storage",
        "mii_2048",
        "mii_4096",
    ]


def test_a_failing_benchmark_is_recorded_and_the_figures_so_far_are_kept_as_they_come(monkeypatch):
    """A first run on a new GPU says all it can: one benchmark's failure leaves the others running, and
    each result reaches the report as it comes (a run cut off keeps what it measured)."""
    from hcache.check import speed

    monkeypatch.setattr(speed.torch.cuda, "is_available", lambda: True)

    def bench(name, argv):
        if name == "paged":
            raise RuntimeError(f"hcache bench paged {' '.join(argv)} exited with status 1")
        return {"figure": name}

    monkeypatch.setattr(speed, "_bench", bench)
    kept = []
    results = speed.measure_speed(quick=True, progress=lambda name: None, keep=lambda r: kept.append(list(r)))
    assert results["vllm_paged_1024"] == {"error": "hcache bench paged --history 1024 exited with status 1"}
    assert results["ops"] == {"figure": "ops"} and results["transfer_4096"] == {"figure": "transfer"}
    assert kept == [list(results)[:n] for n in range(1, len(results) + 1)]


def test_a_check_cut_off_mid_step_leaves_the_cases_it_finished(tmp_path, monkeypatch):
    from hcache.check import correctness

    out = tmp_path / "check"
    seen = []

    def cut_off(engines, progress=None):
        case = {
            "engine": "reference",
            "family": "llama",
            "dtype": "float32",
            "plan": "RE",
            "restored_tokens": 191,
            "expected_tokens": 191,
            "fallback": None,
            "tokens_equal": True,
            "worst_excess": -1e-6,
            "ok": True,
        }
        progress(case)
        seen.append(json.loads(out.with_suffix(".json").read_text())["steps"]["correctness"])
        raise KeyboardInterrupt  # the lease's end: nothing after this runs

    monkeypatch.setattr(correctness, "check_restores", cut_off)
    monkeypatch.setattr("hcache.check.floors.measure_floors", lambda store, quick: {"host_copy_gbps": 1.0})
    import pytest

    with pytest.raises(KeyboardInterrupt):
        main(["check", "--quick", "--out", str(out)])
    assert seen[0]["unfinished"] and seen[0]["cases"][0]["plan"] == "RE"
    assert (
        "## correctness (" in out.with_suffix(".md").read_text()
        and "unfinished: the run was cut off here" in out.with_suffix(".md").read_text()
    )
