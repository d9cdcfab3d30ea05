"""The start-up self-check: a method broken on purpose (H rebuilt with a wrong RoPE rotation, KV read with
K and V swapped) is caught before serving; ``on`` disables exactly that method, ``strict`` refuses to
start, ``off`` lets it through; a clean engine disables nothing."""

import logging
import tempfile
from types import SimpleNamespace

import pytest
from support.helpers import loaded, random_prompt

import hcache.engine.restore_state as restore_state
import hcache.ops.paged_layout as paged_layout
from hcache.config import HCacheConfig
from hcache.mii.engine_factory import build_engine, resolve_deployment
from hcache.model.loader import model_dir
from hcache.ops.quant import QuantRows
from hcache.planning.plan import Method, RestorePlan
from hcache.planning.profile import Profile
from hcache.resolve import disable_methods, resolve, self_check_methods
from hcache.serving.runtime import HCacheRuntime
from hcache.serving.self_check import SelfCheckFailed, layer_excess

PLAN = "1RE+1H+1KV"  # the random models have 3 layers: the check tries H and KV
DISABLED = 'hcache_self_check_disabled{method="%s"}'


@pytest.fixture
def llama():
    return loaded("random:llama")


@pytest.fixture
def wrong_rope(monkeypatch):
    """The H rebuild rotates K the wrong way (sin negated); the forward's RoPE is untouched."""
    rotate = restore_state.rotate_and_write
    monkeypatch.setattr(
        restore_state,
        "rotate_and_write",
        lambda cache, slots, k, v, cos_sin: rotate(cache, slots, k, v, (cos_sin[0], -cos_sin[1])),
    )
    return Method.H


@pytest.fixture
def swapped_kv(monkeypatch):
    """The KV restore reads the stored layout ``[T, 2, n_kv, head]`` with K and V swapped."""
    write = paged_layout.write_rows

    def swap(part):
        return QuantRows(part.codes.flip(1), part.scale.flip(1)) if isinstance(part, QuantRows) else part.flip(1)

    monkeypatch.setattr(
        paged_layout,
        "write_rows",
        lambda cache, runs, slots, parts, start: write(cache, runs, slots, [swap(p) for p in parts], start),
    )
    return Method.KV


def _restores_like_recompute(runtime: HCacheRuntime, prompt: list[int]) -> tuple[bool, str]:
    """Whether a returning prompt generates what recompute does; and its restore's plan."""
    expected = runtime.generate(prompt, 8, restore=False).output_ids
    runtime.generate(prompt, 1)  # saved
    result = runtime.generate(prompt, 8)
    assert result.restored_tokens == len(prompt) // 64 * 64
    return result.output_ids == expected, result.plan


def test_a_clean_engine_disables_nothing(llama, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with caplog.at_level(logging.INFO, "hcache.serving.self_check"):
        runtime = HCacheRuntime(llama, tmp_path / "store", plan=PLAN)
    assert runtime.config.disabled == frozenset() and runtime.config.verified == {Method.H, Method.KV}
    assert str(runtime.plan) == PLAN and runtime.save_formats == [frozenset(), {"H"}, {"KV"}]
    assert runtime.metrics.snapshot()[DISABLED % "H"] == 0 and runtime.metrics.snapshot()[DISABLED % "KV"] == 0
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "H+KV checked against recompute" in caplog.text
    # the check's store is gone, nothing of it is in the user's, and its sequences are freed
    assert list((tmp_path / "tmp").iterdir()) == [] and not any((tmp_path / "store").rglob("*.safetensors"))
    assert runtime.engine.sequences == {} and runtime.serving.metrics.sequences == 0
    runtime.close()


@pytest.mark.parametrize("stored_dtype", ["8bit", "int8", "fp8"])
def test_state_stored_in_8_bits_passes_within_the_lossy_bound(llama, tmp_path, stored_dtype):
    runtime = HCacheRuntime(llama, tmp_path, plan=PLAN, stored_dtype=stored_dtype, self_check="strict")
    assert runtime.config.disabled == frozenset() and runtime.config.verified == {Method.H, Method.KV}
    runtime.close()


@pytest.mark.parametrize("fault, plan", [("wrong_rope", "1RE+2KV"), ("swapped_kv", "1RE+2H")])
def test_on_disables_the_broken_method_and_serves_by_the_one_that_passed(
    llama, tmp_path, caplog, rng, fault, plan, request
):
    broken = request.getfixturevalue(fault)
    with caplog.at_level(logging.WARNING, "hcache.serving.self_check"):
        runtime = HCacheRuntime(llama, tmp_path, plan=PLAN)
    assert runtime.config.disabled == {broken} and runtime.config.verified == {Method.H, Method.KV} - {broken}
    (line,) = caplog.records  # one line per failed method
    assert (
        f"restores by {broken.value} do not match recompute" in line.getMessage()
        and f"plan now {plan}" in line.getMessage()
    )
    assert "past their bound" in line.getMessage()
    snapshot = runtime.metrics.snapshot()
    assert snapshot[DISABLED % broken.value] == 1 and sum(snapshot[DISABLED % m] for m in ("H", "KV")) == 1
    assert str(runtime.plan) == plan and all(broken.value not in formats for formats in runtime.save_formats)
    assert str(runtime.resolve_plan(broken.value)) in ("3KV", "3H")  # a request's plan falls back too
    prompt = random_prompt(150, llama.spec.vocab_size, rng)
    assert _restores_like_recompute(runtime, prompt) == (True, plan)
    runtime.close()


@pytest.mark.parametrize("fault", ["wrong_rope", "swapped_kv"])
def test_strict_refuses_to_start(llama, tmp_path, fault, request):
    broken = request.getfixturevalue(fault)
    with pytest.raises(
        SelfCheckFailed, match=f"restores by {broken.value} do not match recompute on this engine .*refusing to start"
    ):
        HCacheRuntime(llama, tmp_path, plan=PLAN, self_check="strict")


def test_off_lets_the_fault_through(llama, tmp_path, wrong_rope, rng):
    runtime = HCacheRuntime(llama, tmp_path, plan=PLAN, self_check="off")
    assert runtime.config.disabled == frozenset() and str(runtime.plan) == PLAN
    assert runtime.metrics.snapshot()[DISABLED % "H"] == 0
    # the fault is real: the H layer's restored K is not the forward's
    serving, prompt = runtime.serving, random_prompt(100, llama.spec.vocab_size, rng)
    serving.put([1], [prompt])
    serving.flush(1)
    serving.open(2, restore=False)
    serving.put([2], [prompt])
    serving.put([3], [prompt])
    assert serving.record(3).restored_tokens == 64
    pair = (runtime.engine.kv(3, 1, 64), runtime.engine.kv(2, 1, 64))
    assert layer_excess("reference", Method.H, *pair, llama.spec) > 0.01
    runtime.close()


def test_a_method_the_plan_does_not_use_is_not_checked(llama, tmp_path, wrong_rope):
    runtime = HCacheRuntime(llama, tmp_path, plan="KV", self_check="strict")
    assert runtime.config.verified == {Method.KV} and runtime.config.disabled == frozenset()
    runtime.close()


def test_without_a_method_that_passed_the_layers_recompute(llama):
    config = resolve({"store_dirs": ["unused"], "plan": "H"}, llama.spec, "random:llama")
    assert self_check_methods(config) == {Method.H}
    checked = disable_methods(config, [Method.H], [])
    assert str(checked.plan) == "3RE" and checked.save_formats == (frozenset(),) * 3
    # a request's plan keeps RE first: KV disabled with H not checked leaves 2RE, not RE+H+RE
    checked = disable_methods(
        resolve({"store_dirs": ["unused"], "plan": "KV"}, llama.spec, "random:llama"), [Method.KV], []
    )
    assert checked.policy.request_plan("1RE+1H+1KV") == RestorePlan.parse("3RE", 3)
    assert checked.policy.request_plan("2RE+1H") == RestorePlan.parse("2RE+1H", 3)
    everything = disable_methods(
        resolve({"store_dirs": ["unused"], "plan": PLAN, "save": "all"}, llama.spec, "x"), [Method.KV], [Method.H]
    )
    assert everything.save_formats == (frozenset({"H"}),) * 3 and str(everything.plan) == "1RE+2H"


def test_the_auto_plan_checks_what_it_may_use_and_plans_without_a_disabled_method(llama):
    seconds = {
        "c_token": [0.001, 0.4],
        "c_h": [0.0002, 0.003],
        "c_kv": [0.0, 0.0],
        "io_h": [0.0006, 0.001],
        "io_kv": [0.0012, 0.002],
    }
    profile = Profile.new(llama.name, llama.spec, [64, 256], seconds, {})
    config = resolve({"store_dirs": ["unused"], "profile": profile}, llama.spec, llama.name)
    assert config.plan is None and self_check_methods(config) == {Method.H, Method.KV}
    assert str(config.policy.plan_for(None, 256)) == "1H+2KV"
    without_h = disable_methods(config, [Method.H], [Method.KV])
    assert (
        Method.H not in without_h.policy.plan_for(None, 256).layers
        and Method.H not in without_h.policy.plan_for(None, 64).layers
    )
    assert all("H" not in formats for formats in without_h.save_formats) and any(without_h.save_formats)
    without_kv = disable_methods(config, [Method.KV], [Method.H])
    assert Method.KV not in without_kv.policy.plan_for(None, 256).layers and all(
        "KV" not in f for f in without_kv.save_formats
    )
    assert without_kv.policy.request_plan("auto") is None  # still the profile's, without KV


def test_an_mii_model_server_checks_its_engine(tmp_path, swapped_kv):
    """``hcache serve`` and ``hcache.mii.pipeline`` build their engines in ``build_engine``: the check runs there."""
    try:
        path = str(model_dir("smollm2"))
    except Exception as exc:
        pytest.skip(f"SmolLM2 is not installed here: {exc}")
    model_config = SimpleNamespace(
        model_name_or_path=path, tensor_parallel=1, inference_engine_config=None, max_length=None
    )
    config = resolve_deployment(HCacheConfig.of(store_dirs=[str(tmp_path)], engine="reference"), path)
    serving = build_engine(model_config, config)
    assert serving.config.disabled == {Method.KV} and str(serving.config.plan) == "30RE"  # SmolLM2's default plan is KV
    assert serving.metrics.snapshot()[DISABLED % "KV"] == 1
    serving.close()
    strict = resolve_deployment(config.settings.model_copy(update={"self_check": "strict"}), path)
    with pytest.raises(SelfCheckFailed, match="restores by KV"):
        build_engine(model_config, strict)


def test_hcache_serve_takes_the_mode_as_a_flag(capsys):
    from hcache.cli import build_parser
    from hcache.mii.serve_command import settings

    parser = build_parser()
    assert settings(parser.parse_args(["serve"])).self_check == "on"
    assert settings(parser.parse_args(["serve", "--self-check", "strict"])).self_check == "strict"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--self-check", "maybe"])
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "--self-check {on,strict,off}" in capsys.readouterr().out
