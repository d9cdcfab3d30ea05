"""Profiles: measured, saved, refused when they do not fit; and the runtime's auto plan built on them."""
import json

import pytest
from helpers import loaded, random_prompt

from hcache.cli import main
from hcache.errors import InvalidRequestError
from hcache.profile import PROFILE_VERSION, Profile, ProfileMismatch, default_profile_path
from hcache.runtime import HCacheRuntime

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


def test_auto_plan_follows_the_history_length_and_restores_exactly(llama, synthetic, tmp_path, rng):
    short, long = synthetic.plan(llama.spec, 64), synthetic.plan(llama.spec, 256)
    assert str(short) == "1RE+2H" and str(long) == "1H+2KV"
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

    path.write_text(json.dumps({**data, "seconds": {"c_h": [1.0]}}))
    with pytest.raises(ProfileMismatch, match="not a valid hcache profile"):
        Profile.load(path)
    with pytest.raises(ProfileMismatch, match="run `hcache profile`"):
        Profile.load(tmp_path / "missing.json")


def test_auto_plan_without_a_profile_says_how_to_get_one(llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileMismatch, match="no profile at profiles/.*hcache profile"):
        HCacheRuntime(llama, tmp_path / "store", plan="auto")
    runtime = HCacheRuntime(llama, tmp_path / "store")
    with pytest.raises(InvalidRequestError, match="needs a profile"):
        runtime.generate([1, 2, 3], 1, plan="auto")


def test_profile_cli_measures_a_usable_profile(llama, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "--model", "random:llama", "--tokens", "64,128", "--repeats", "1"]) == 0
    path = default_profile_path(llama.spec, "random:llama")
    assert path.parent.name == "profiles" and path.name.endswith("-random-llama.json")
    profile = Profile.load(path, llama.spec)
    assert profile.tokens == [64, 128]
    assert all(len(v) == 2 and all(s > 0 for s in v) for k, v in profile.seconds.items() if k != "c_kv")
    assert "plan" in capsys.readouterr().out
    with HCacheRuntime(llama, tmp_path / "store", plan="auto") as runtime:  # finds the default path
        assert runtime.profile.tokens == [64, 128]
