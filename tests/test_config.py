"""Settings are resolved once, at the top: refused there with one message each, and handed down whole."""

import argparse
import json

import pytest
import torch
from support.helpers import loaded

from hcache.config import HCacheConfig, ResolvedConfig
from hcache.resolve import resolve
from hcache.errors import InvalidRequestError, StorageError
from hcache.mii import serve_command
from hcache.planning.plan import RestorePlan
from hcache.planning.profile import Profile
from hcache.model.tensor_parallel import TPGroup, local_spec


def _serve_settings(*argv: str) -> HCacheConfig:
    parser = argparse.ArgumentParser()
    serve_command.add_parser(parser.add_subparsers(dest="command"))
    return serve_command.settings(parser.parse_args(["serve", *argv]))


def test_the_former_name_of_the_shared_stores_is_taken_with_a_warning(tmp_path, capsys):
    with pytest.warns(FutureWarning, match="now called shared"):
        assert HCacheConfig(store={"tiers": [str(tmp_path)]}).store.shared == (str(tmp_path),)
    with pytest.raises(StorageError, match="not also as tiers"):
        HCacheConfig.of({"store": {"tiers": [str(tmp_path)], "shared": [str(tmp_path)]}})
    assert _serve_settings("--tier", "redis://a:1/0", "--shared", "redis://b:1/0").store.shared == (
        "redis://b:1/0",
        "redis://a:1/0",
    )
    assert "--tier is now called --shared" in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"num_blocks": -1}, "hcache setting 'num_blocks': Input should be greater than 0 (given -1)"),
        ({"store": {"writers": "two"}}, "hcache setting 'store.writers'"),
        ({"plan": "2RE++1KV"}, "hcache setting 'plan': cannot parse plan '2RE++1KV'"),
        ({"save": "sometimes"}, "hcache setting 'save': Input should be 'plan', 'all' or 'none'"),
        ({"dtype": "int8"}, "hcache setting 'dtype': unknown dtype 'int8'"),
        ({"metrics_port": 70000}, "hcache setting 'metrics_port'"),
        ({"namespace": "a\nb"}, "hcache setting 'namespace': namespace must be a non-empty string"),
        ({"store_dirs": []}, "store_dirs may be empty only when store.shared names a shared store"),
        ({"pln": "H"}, "hcache setting 'pln': Extra inputs are not permitted"),
        (
            {"kv_events": {"endpoint": "tcp://*"}},
            "hcache setting 'kv_events.endpoint': a ZMQ endpoint is tcp://HOST:PORT",
        ),
        ({"kv_events": {"endpoint": "http://router:5557"}}, "hcache setting 'kv_events.endpoint'"),
        ({"kv_events": {"replay_endpoint": "tcp://*:65536"}}, "hcache setting 'kv_events.replay_endpoint'"),
        ({"kv_events": {"block_size": 0}}, "hcache setting 'kv_events.block_size': Input should be greater than 0"),
        ({"kv_events": {"prefix_caching_hash_algo": "md5"}}, "'kv_events.prefix_caching_hash_algo': Input should be"),
        ({"kv_events": {"publisher": "null"}}, "hcache setting 'kv_events.publisher': Input should be 'zmq'"),
        ({"kv_events": {"hwm": -1}}, "hcache setting 'kv_events.hwm'"),
        ({"kv_events": {"topc": "x"}}, "hcache setting 'kv_events.topc': Extra inputs are not permitted"),
        ({"kv_events": "tcp://*:5557"}, "hcache setting 'kv_events': Input should be a valid dictionary"),
    ],
)
def test_each_bad_setting_is_refused_with_one_message(settings, message):
    with pytest.raises(InvalidRequestError) as refused:
        HCacheConfig.of(settings)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_kv_events_take_vllms_kv_events_config_with_its_block_size_and_hash_and_travel_whole():
    """vLLM's ``--kv-events-config`` as given to vLLM, and the two of vLLM's engine settings its blocks are
    hashed by; ``enable_kv_cache_events=False`` publishes nothing."""
    vllms = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}
    events = HCacheConfig.of(kv_events={**vllms, "block_size": 128, "prefix_caching_hash_algo": "sha256_cbor"})
    assert events.published_events == events.kv_events and events.kv_events.block_size == 128
    assert events.kv_events.listens() == {"endpoint": ("0.0.0.0", 5557)}
    defaults = HCacheConfig.of(kv_events={}).kv_events
    assert (defaults.endpoint, defaults.block_size, defaults.prefix_caching_hash_algo) == ("tcp://*:5557", 16, "sha256")
    assert HCacheConfig.of().published_events is None
    assert HCacheConfig.of(kv_events={"enable_kv_cache_events": False}).published_events is None
    connecting = HCacheConfig.of(
        kv_events={"endpoint": "tcp://router.local:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}
    ).kv_events
    assert connecting.listens() == {"replay_endpoint": ("127.0.0.1", 5558)}  # the endpoint connects to a router
    for endpoint in ("ipc:///tmp/hcache-events", "inproc://events", "tcp://[::1]:5557"):
        assert HCacheConfig.of(kv_events={"endpoint": endpoint}).kv_events.endpoint == endpoint
    spec = loaded("random:llama").spec
    resolved = resolve({"kv_events": vllms}, spec, "m")
    assert ResolvedConfig.model_validate_json(
        resolved.model_dump_json()
    ).settings.kv_events == events.kv_events.model_copy(update={"block_size": 16, "prefix_caching_hash_algo": "sha256"})


def test_kv_events_are_refused_where_one_process_cannot_publish_them_whole():
    spec = loaded("random:llama").spec
    with pytest.raises(
        InvalidRequestError, match="kv_events is published by one model server, and at tensor_parallel=2"
    ):
        resolve({"kv_events": {}}, local_spec(spec, TPGroup(0, 2)), "m", tensor_parallel=2)
    resolve({"kv_events": {"enable_kv_cache_events": False}}, local_spec(spec, TPGroup(0, 2)), "m", tensor_parallel=2)
    # a hybrid's state at checkpoints, and a window rule's last windows, are published in groups of their own
    resolve({"kv_events": {}}, loaded("random:granitemoehybrid").spec, "m")
    resolve({"kv_events": {}}, loaded("random:gemma3_text").spec, "m")


def test_two_bad_settings_are_both_named():
    with pytest.raises(InvalidRequestError, match="'readers'.*; .*'num_blocks'"):
        HCacheConfig.of(num_blocks=0, readers=-1)


def test_the_plan_is_checked_against_the_model_when_resolved():
    spec = loaded("random:llama").spec  # 3 layers
    settings = HCacheConfig.of(plan="2H")  # well formed: the model decides
    with pytest.raises(InvalidRequestError, match="covers 2 layers, the model has 3"):
        resolve(settings, spec, "random:llama")
    resolved = resolve(HCacheConfig.of(plan="1re+2kv"), spec, "random:llama")
    assert str(resolved.plan) == "1RE+2KV" and resolved.profile is None
    assert resolved.save_formats == (frozenset(), frozenset({"KV"}), frozenset({"KV"}))
    assert resolve({"plan": RestorePlan.uniform(3, "H")}, spec, "random:llama").plan == RestorePlan.uniform(3, "H")
    with pytest.raises(InvalidRequestError, match="plan 2KV covers 2 layers, the model has 3"):
        resolve({"plan": RestorePlan.uniform(2, "KV")}, spec, "random:llama")


def test_a_profile_given_makes_auto_the_plan_and_saves_every_format_it_may_use():
    spec = loaded("random:llama").spec
    seconds = {
        "c_token": [0.001, 0.4],
        "c_h": [0.0002, 0.003],
        "c_kv": [0.0, 0.0],
        "io_h": [0.0006, 0.001],
        "io_kv": [0.0012, 0.002],
    }
    profile = Profile.new("random:llama", spec, [64, 256], seconds, {})
    resolved = resolve({"profile": profile}, spec, "random:llama")
    assert resolved.plan is None and resolved.profile is profile
    short, long = resolved.policy.plan_for(None, 64), resolved.policy.plan_for(None, spec.max_positions)
    assert short != long
    for layer, formats in enumerate(resolved.save_formats):
        assert formats >= {m.stored_format for m in (short.layers[layer], long.layers[layer])} - {None}
    assert (
        resolved.policy.request_plan("H") == RestorePlan.uniform(3, "H")
        and resolved.policy.request_plan("auto") is None
    )


def test_the_resolved_config_travels_as_json_whole():
    """What hcache.mii.serve hands its model servers: they rebuild it exactly, and resolve nothing."""
    spec = loaded("random:llama").spec
    seconds = {name: [0.001, 0.004] for name in ("c_token", "c_h", "c_kv", "io_h", "io_kv")}
    resolved = resolve(
        {
            "profile": Profile.new("m", spec, [64, 256], seconds, {}),
            "store": {"shared": ["redis://localhost:1/0"]},
            "namespace": "t1",
        },
        spec,
        "m",
    )
    again = ResolvedConfig.model_validate_json(resolved.model_dump_json())
    assert again.model_dump_json() == resolved.model_dump_json()
    assert again.spec == spec and again.plan is None and again.save_formats == resolved.save_formats
    assert again.profile.seconds == resolved.profile.seconds and again.policy.plan_for(
        None, 256
    ) == resolved.policy.plan_for(None, 256)
    assert again.store.shared == ("redis://localhost:1/0",)


def test_an_engine_of_another_model_is_refused():
    spec = loaded("random:llama").spec
    resolved = resolve({}, spec, "random:llama", tensor_parallel=1)
    resolved.check_engine(spec)
    with pytest.raises(InvalidRequestError, match="not the one the hcache config was resolved for"):
        resolved.check_engine(loaded("random:qwen2").spec)


def test_tensor_parallel_ranks_store_in_directories_of_their_own(tmp_path):
    spec = local_spec(loaded("random:llama").spec, TPGroup(0, 2))
    resolved = resolve(
        {"store_dirs": [str(tmp_path / "a"), str(tmp_path / "b")]}, spec, "random:llama", tensor_parallel=2
    )
    assert resolved.store_dirs(1) == [str(tmp_path / "a" / "tp2-rank1"), str(tmp_path / "b" / "tp2-rank1")]
    assert resolve({"enabled": False}, spec, "m", tensor_parallel=2).store_dirs(0) is None


def test_other_tensor_parallel_layouts_are_found_beside_the_ranks_directories(tmp_path):
    """Where a store of another size wrote (the directory itself at size 1, rank 0's at size N), for the
    anchor logs that tell a miss of another layout; never this layout's own."""
    spec = local_spec(loaded("random:llama").spec, TPGroup(0, 2))
    base = tmp_path / "a"
    for d in ("tp2-rank0", "tp2-rank1", "tp4-rank0", "tp4-rank3"):
        (base / d).mkdir(parents=True)
    settings = {"store_dirs": [str(base), str(tmp_path / "b")]}
    assert resolve(settings, spec, "random:llama", tensor_parallel=2).other_layouts() == [base, base / "tp4-rank0"]
    assert resolve(settings, loaded("random:llama").spec, "random:llama").other_layouts() == [
        base / "tp2-rank0",
        base / "tp4-rank0",
    ]


def test_serve_takes_a_config_file_and_its_flags_override_it(tmp_path):
    path = tmp_path / "hcache.json"
    path.write_text(
        json.dumps({"plan": "KV", "namespace": "tenant", "store": {"quota_bytes": 1 << 30}, "metrics_port": 9500})
    )
    settings = _serve_settings("--config", str(path), "--plan", "H", "--shared", "redis://localhost:6379/0")
    assert settings.plan == "H" and settings.namespace == "tenant" and settings.metrics_port == 9500
    assert settings.store.quota_bytes == 1 << 30 and settings.store.shared == ("redis://localhost:6379/0",)
    assert _serve_settings().metrics_port == serve_command.DEFAULT_METRICS_PORT
    assert _serve_settings("--metrics-port", "0").metrics_port is None and _serve_settings("--off").enabled is False


def test_serve_stored_dtype_flag_overrides_the_config_file(tmp_path):
    (tmp_path / "c.json").write_text('{"stored_dtype": "int8", "plan": "KV"}')
    assert _serve_settings("--config", str(tmp_path / "c.json")).stored_dtype == "int8"
    settings = _serve_settings("--config", str(tmp_path / "c.json"), "--stored-dtype", "H=fp8,KV=int8")
    assert settings.stored_dtype == "H=fp8,KV=int8" and settings.plan == "KV"


def test_the_encodings_travel_to_model_servers_and_steer_the_auto_plan():
    """What hcache.mii.serve hands its model servers as JSON: the setting, and with it the auto plan's
    choice for 8-bit bytes and the formats saved."""
    spec = loaded("random:llama").spec
    seconds = {
        "c_token": [0.01, 0.04],
        "c_h": [0.001, 0.004],
        "c_kv": [0.0, 0.0],
        "io_h": [0.004, 0.016],
        "io_kv": [0.008, 0.032],
    }
    settings = {"profile": Profile.new("m", spec, [64, 256], seconds, {}), "stored_dtype": "H=fp8"}
    resolved = resolve(settings, spec, "m")
    again = ResolvedConfig.model_validate_json(resolved.model_dump_json())
    assert again.encodings == resolved.encodings == {"H": torch.float8_e4m3fn}
    assert again.policy.plan_for(None, 256) == RestorePlan.uniform(3, "H")
    lossless = resolve({**settings, "stored_dtype": "auto"}, spec, "m")
    assert lossless.policy.plan_for(None, 256) == RestorePlan.parse("1RE+2H", 3)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a readable JSON file"),
        ("[1, 2]", "expected a JSON object of hcache settings, not list"),
        ('{"readers": -2}', "hcache setting 'readers'"),
    ],
)
def test_a_bad_config_file_is_refused(tmp_path, content, message):
    path = tmp_path / "hcache.json"
    path.write_text(content)
    with pytest.raises(InvalidRequestError, match=message):
        _serve_settings("--config", str(path))


def test_a_deployment_is_resolved_for_the_dtype_its_engine_runs(tmp_path):
    """FastGen runs a checkpoint in the dtype its config names; the reference engine in float32 on a CPU."""
    from hcache.mii.engine_factory import resolve_deployment
    from hcache.model.random_weights import random_model

    random_model("llama", torch.bfloat16).save_pretrained(tmp_path)
    assert resolve_deployment(HCacheConfig(engine="fastgen"), str(tmp_path)).spec.dtype == "bfloat16"
    assert resolve_deployment(HCacheConfig(engine="fastgen", dtype="float16"), str(tmp_path)).spec.dtype == "float16"
    if not torch.cuda.is_available():
        assert resolve_deployment(HCacheConfig(engine="reference"), str(tmp_path)).spec.dtype == "float32"


def test_hidden_states_are_refused_for_a_family_whose_weights_hcache_does_not_know(tmp_path):
    """A family described for KV alone (vLLM's, past hcache's engines): a plan or a save with H is refused
    where the settings resolve, naming why and what serves; KV resolves."""
    from transformers import AutoConfig

    from hcache.errors import UnsupportedModelError
    from hcache.model.spec import ModelSpec
    from hcache.resolve import resolve

    config = AutoConfig.for_model(
        "gpt_oss", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2
    )
    spec = ModelSpec.from_config(config, any_family=True)
    for settings in ({"plan": "H"}, {"plan": "1H+1KV"}, {"plan": "KV", "save": "all"}):
        with pytest.raises(UnsupportedModelError, match="'gpt_oss': hcache does not know where its layer input"):
            resolve({"store_dirs": [str(tmp_path)], **settings}, spec, "gpt-oss", engine="vllm")
    assert str(resolve({"store_dirs": [str(tmp_path)]}, spec, "gpt-oss", engine="vllm").plan) == "2KV"
