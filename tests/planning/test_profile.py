"""Profiles: measured, saved, refused when they do not fit; and the runtime's auto plan built on them."""

import dataclasses
import json
import logging

import pytest
import torch
from support.helpers import loaded, random_prompt

import hcache.planning.profiler
from hcache.cli import main
from hcache.errors import InvalidRequestError
from hcache.planning.checkpoints import StateRule
from hcache.planning.plan import Method, RestorePlan, default_plan, state_bytes
from hcache.planning.profile import PROFILE_VERSION, Profile, ProfileMismatch, default_profile_path
from hcache.serving.runtime import HCacheRuntime

# Per-layer seconds at 64 and 256 tokens. Short histories are I/O-bound (RE + H); long ones compute-bound
# (H + KV), so the auto plan changes with the history length.
SECONDS = {
    "c_token": [0.001, 0.4],
    "c_h": [0.0002, 0.003],
    "c_kv": [0.0, 0.0],
    "io_h": [0.0006, 0.001],
    "io_kv": [0.0012, 0.002],
}


@pytest.fixture
def llama():
    return loaded("random:llama")


@pytest.fixture
def synthetic(llama) -> Profile:
    return Profile.new(llama.name, llama.spec, [64, 256], SECONDS, {})


@pytest.fixture
def new_machine(tmp_path, monkeypatch) -> str:
    """This process on a machine named 'cpu2-amd-epyc', with an empty profile cache and working directory."""
    monkeypatch.setenv("HCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("hcache.planning.profile.machine_name", lambda: "cpu2-amd-epyc")
    return "cpu2-amd-epyc"


def test_auto_plan_follows_the_history_length_and_restores_exactly(llama, synthetic, tmp_path, rng):
    short, long = synthetic.plan(llama.spec, 64), synthetic.plan(llama.spec, 256)
    assert str(short) == "1RE+2H" and str(long) == "1H+2KV"
    # the plans before hybrids' layers were costed by kind, at more lengths: a model without them plans as it did
    lengths = (64, 100, 128, 192, 256, 1024, 4096)
    assert [str(synthetic.plan(llama.spec, n)) for n in lengths] == [
        *("1RE+2H", "3H", "2H+1KV", "2H+1KV"),
        *("1H+2KV", "1H+2KV", "3KV"),
    ]
    assert [str(synthetic.plan(llama.spec, n, allow_h=False)) for n in lengths[::2]] == ["2RE+1KV", *["3KV"] * 3]
    runtime = HCacheRuntime(llama, tmp_path, profile=synthetic)
    # save="plan" keeps every format the auto plan needs at some length (2H+1KV at 128 tokens)
    assert runtime.save_formats == [frozenset({"H"}), frozenset({"H", "KV"}), frozenset({"H", "KV"})]
    prompt = random_prompt(300, llama.spec.vocab_size, rng)
    expected = runtime.generate(prompt, 6, restore=False).output_ids
    result = runtime.generate(prompt, 6)
    assert result.restored_tokens == 256 and result.plan == str(long) and result.fallback is None
    assert result.output_ids == expected
    short_prompt = prompt[:70]
    assert runtime.generate(short_prompt, 6).plan == str(short)
    runtime.close()


def test_profile_round_trip_and_refusals(llama, synthetic, tmp_path):
    path = tmp_path / "p.json"
    synthetic.save(path)
    assert Profile.load(path, llama.spec).costs(160) == synthetic.costs(160)
    assert synthetic.costs(160).c_token == pytest.approx(0.2005)  # interpolated

    with pytest.raises(ProfileMismatch, match="measured for model_type=llama.*not for this model.*qwen2"):
        Profile.load(path, loaded("random:qwen2").spec)

    data = json.loads(path.read_text())
    for field, value, message in [
        ("machine_name", "h100-sxm", "measured on 'h100-sxm'"),
        ("version", PROFILE_VERSION - 1, "stale"),
    ]:
        path.write_text(json.dumps({**data, field: value}))
        with pytest.raises(ProfileMismatch, match=message):
            Profile.load(path, llama.spec)

    path.write_text(json.dumps({**data, "seconds": {**data["seconds"], "c_token_recurrent": [0.1, 0.2]}}))
    assert Profile.load(path, llama.spec).costs(160) == synthetic.costs(160)  # a hybrid's cost, unused here
    path.write_text(json.dumps({**data, "seconds": {"c_h": [1.0]}}))
    with pytest.raises(ProfileMismatch, match="not a valid hcache profile"):
        Profile.load(path)
    with pytest.raises(ProfileMismatch, match="run `hcache profile --model ...` to measure one"):
        Profile.load(tmp_path / "missing.json")


def test_a_profile_from_another_machine_leaves_auto_on_the_default_plan(
    llama, synthetic, new_machine, tmp_path, caplog, rng
):
    """The cache holds a profile measured on another machine (a copied HCACHE_HOME, say): auto serves the default
    plan with one warning that says why and how to profile. Given explicitly, the profile is refused."""
    synthetic.machine_name = "cpu2-intel-xeon"
    path = default_profile_path("random:llama")
    synthetic.save(path)
    command = "hcache profile --model random:llama --dtype float32"
    with caplog.at_level(logging.WARNING, logger="hcache"):
        runtime = HCacheRuntime(llama, tmp_path / "store", plan="auto", measure_profile=False)
    [warning] = caplog.records
    assert "measured on 'cpu2-intel-xeon', this machine is 'cpu2-amd-epyc'" in warning.message
    assert "serving the default plan" in warning.message and command in warning.message
    default = default_plan(llama.spec)
    assert runtime.profile is None and runtime.plan == default
    prompt = random_prompt(2 * 64 + 5, llama.spec.vocab_size, rng)
    runtime.generate(prompt, 2)
    assert runtime.generate(prompt, 2).restores[0].plan == str(default)
    with pytest.raises(InvalidRequestError, match="needs a profile"):
        runtime.generate(prompt, 1, plan="auto")
    runtime.close()
    with pytest.raises(ProfileMismatch, match=f"measured on 'cpu2-intel-xeon'.*run `{command}` here"):
        HCacheRuntime(llama, tmp_path / "store", profile=path)


def test_first_use_on_a_new_machine_measures_a_short_profile_and_the_next_start_uses_it(
    llama, new_machine, tmp_path, monkeypatch, capsys, caplog
):
    with HCacheRuntime(llama, tmp_path / "store", plan="auto") as runtime:
        assert runtime.profile.tokens == [256, 512]  # the short grid, capped at the tiny model's context
    assert "profiling random:llama" in capsys.readouterr().err  # the progress bar
    assert "found no profile of random:llama for this machine; measuring a short one" in caplog.text
    path = tmp_path / "home" / "profiles" / "cpu2-amd-epyc-random-llama.json"
    assert Profile.load(path, llama.spec).seconds == runtime.profile.seconds

    def measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(hcache.planning.profiler, "measure_profile", measure)
    with HCacheRuntime(llama, tmp_path / "store", plan="auto") as runtime:
        assert runtime.profile.seconds == Profile.load(path).seconds


def test_profile_cli_measures_a_usable_profile(llama, new_machine, tmp_path, capsys):
    assert main(["profile", "--model", "random:llama", "--short", "--repeats", "1"]) == 0
    path = default_profile_path("random:llama")
    assert path == tmp_path / "home" / "profiles" / "cpu2-amd-epyc-random-llama.json"
    profile = Profile.load(path, llama.spec)
    assert profile.tokens == [256, 512] and "c_token_recurrent" not in profile.seconds  # llama has no such layer
    assert all(len(v) == 2 and all(s > 0 for s in v) for k, v in profile.seconds.items() if k != "c_kv")
    assert "plan" in capsys.readouterr().out
    with HCacheRuntime(llama, tmp_path / "store", plan="auto", measure_profile=False) as runtime:  # finds it
        assert runtime.profile.tokens == [256, 512]
    assert main(["profile", "--model", "random:llama", "--short", "--tokens", "64"]) == 2
    assert "give one" in capsys.readouterr().err
    missing = tmp_path / "no-such-disk"
    assert main(["profile", "--model", "random:llama", "--short", "--store-dir", str(missing)]) == 2
    assert f"--store-dir '{missing}' is not a directory" in capsys.readouterr().err and not missing.exists()


def test_a_sliding_window_layer_costs_its_window(llama, synthetic):
    """Its H and KV restore the tokens it reads (planning/window.py), its RE the whole history."""
    from hcache.planning.scheduler import LayerCosts
    from hcache.planning.window import WindowRule

    spec = dataclasses.replace(llama.spec, sliding_windows=(64, None, None))
    layers, _, _ = synthetic._stored_costs(spec, 256, None)
    full, windowed = synthetic.costs(256), synthetic.costs(64)
    assert WindowRule(spec).read_tokens(0, 0, 256) == 64 and layers[1] == layers[2] == full
    assert layers[0] == LayerCosts(**{**dataclasses.asdict(windowed), "c_token": full.c_token})


def test_auto_plan_weighs_the_encodings_bytes_and_dequantisation_cost(llama):
    spec = llama.spec
    seconds = {
        "c_token": [0.01, 0.04],
        "c_h": [0.001, 0.004],
        "c_kv": [0.0, 0.0],
        "io_h": [0.004, 0.016],
        "io_kv": [0.008, 0.032],
    }
    profile = Profile.new(llama.name, spec, [64, 256], seconds, {})
    fp8, int8 = {"H": torch.float8_e4m3fn}, {"KV": torch.int8}
    assert Method.H.bytes_per_token_layer(spec, fp8["H"]) == spec.hidden_size + 2  # codes and one float16 scale
    assert Method.KV.bytes_per_token_layer(spec, int8["KV"]) == 2 * spec.num_kv_heads * (spec.head_size + 2)
    # I/O-bound lossless: a layer recomputed; H at a quarter of the bytes is compute-bound: all H
    assert profile.plan(spec, 256) == RestorePlan.parse("1RE+2H", 3)
    assert profile.plan(spec, 256, fp8) == RestorePlan.uniform(3, "H")
    ratio = (spec.hidden_size + 2) / spec.hidden_bytes_per_token_layer
    assert profile.costs(256, {"H": ratio}).io_h == pytest.approx(0.016 * ratio)
    # RE+KV (bench restore's hybrid) and the bound weigh the encoding too: KV at a quarter of the bytes is
    # no longer worth recomputing a layer for
    assert profile.plan(spec, 256, allow_h=False) == RestorePlan.parse("1RE+2KV", 3)
    assert profile.plan(spec, 256, int8, allow_h=False) == RestorePlan.uniform(3, "KV")
    assert profile.bound_seconds(spec, 256, int8) < profile.bound_seconds(spec, 256)
    # a measured dequantisation cost replaces the lossless compute cost: here, one too dear to take H
    priced = Profile.new(llama.name, spec, [64, 256], {**seconds, "c_h8": [0.05, 0.2], "c_kv8": [0.0, 0.0]}, {})
    assert priced.costs(256, {"H": ratio}).c_h == 0.2
    assert priced.plan(spec, 256, fp8).count(Method.H) < 3


def test_profile_with_and_without_8bit_costs_loads(llama, tmp_path):
    seconds = {"c_token": [0.01], "c_h": [0.001], "c_kv": [0.0], "io_h": [0.004], "io_kv": [0.008]}
    for extra in ({}, {"c_h8": [0.002], "c_kv8": [0.001]}):
        Profile.new(llama.name, llama.spec, [64], {**seconds, **extra}, {}).save(tmp_path / "p.json")
        assert Profile.load(tmp_path / "p.json", llama.spec).seconds.keys() == {**seconds, **extra}.keys()


@pytest.fixture
def hybrid():
    return loaded("random:qwen3_next")  # gated delta nets in layers 0 and 2, attention in 1 and 3


def hybrid_profile(model, **extra) -> Profile:
    return Profile.new(model.name, model.spec, [64, 256], {**SECONDS, "c_token_recurrent": [0.002, 0.3], **extra}, {})


def test_a_recurrent_layer_costs_its_state_and_its_own_forward(hybrid):
    """As the restore treats it (restore/reads.py): H and KV alike read its state at the prefix's end, as many bytes
    whatever the history, at the KV reads' rate, and compute nothing more; RE runs its own forward. Its stored bytes
    per token are its state's over the chunks a state stands for; an attention layer's costs are the profile's."""
    spec, profile = hybrid.spec, hybrid_profile(hybrid)
    assert spec.recurrent_layers == (0, 2) and state_bytes(spec) == 64 * 24 * 4  # 1536 float32 values, in 24 columns
    state_tokens = state_bytes(spec) / spec.kv_bytes_per_token_layer  # as many bytes as this many tokens' K/V
    recurrent_forward = {64: 0.002, 256: 0.3, 4096: 0.3 + (0.3 - 0.002) / 192 * (4096 - 256)}  # interpolated
    for history, c_token in recurrent_forward.items():
        layers, bytes_h, bytes_kv = profile._stored_costs(spec, history, None, states=StateRule(spec, every=4))
        io = profile.costs(state_tokens).io_kv
        assert dataclasses.astuple(layers[0]) == pytest.approx((c_token, 0.0, 0.0, io, io, 0.0))
        assert layers[0] == layers[2] and layers[1] == layers[3] == profile.costs(history)
        assert bytes_h[0] == bytes_kv[0] == bytes_h[2] == state_bytes(spec) / (4 * 64)
        assert bytes_h[1] == spec.hidden_bytes_per_token_layer and bytes_kv[3] == spec.kv_bytes_per_token_layer


def test_a_hybrids_auto_plan_follows_its_state_bytes(hybrid):
    """A small state restores by reading it; one so large its read outlasts the layer's forward is recomputed,
    and the predicted time follows the state's bytes, whatever the history (a recurrent layer has no rows)."""
    profile = hybrid_profile(hybrid, c_token_recurrent=[0.001, 0.004])
    small = hybrid.spec
    large = dataclasses.replace(small, mamba=dataclasses.replace(small.mamba, heads=4096))
    assert profile.plan(small, 256).count(Method.RE) == 0
    # layer 0 recomputed; layer 2 cannot be without layer 1's dear forward, and I/O-bound, all read the fewest bytes
    assert profile.plan(large, 256) == RestorePlan.parse("1RE+3H", 4)
    assert profile.bound_seconds(large, 256) > profile.bound_seconds(small, 256)


def test_a_hybrid_profile_without_the_recurrent_forward_is_refused(hybrid, tmp_path):
    """One measured before recurrent layers were costed apart: its ``c_token`` was the first layer's, a recurrent
    one's, and none is an attention layer's alone."""
    profile = hybrid_profile(hybrid)
    del profile.seconds["c_token_recurrent"]
    profile.save(tmp_path / "p.json")
    with pytest.raises(ProfileMismatch, match="before hcache costed a recurrent layer apart.*run `hcache profile"):
        Profile.load(tmp_path / "p.json", hybrid.spec)
    hybrid_profile(hybrid).save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json", hybrid.spec).seconds["c_token_recurrent"] == [0.002, 0.3]
