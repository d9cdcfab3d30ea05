import json

import pytest
import torch
from transformers import AutoConfig, GPT2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hcache.errors import UnsupportedModelError
from hcache.model.spec import SUPPORTED_MODEL_TYPES, ModelSpec


def test_smollm2_description(smollm2):
    s = smollm2.spec
    assert (s.model_type, s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_size) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
    )
    assert s.rope.theta == 100000.0 and s.rope.rotary_dim == 64 and s.learned_position_offset is None
    assert s.capture_module == "input_layernorm" and not s.qkv_bias
    assert s.hidden_bytes_per_token_layer == 576 * 4
    assert s.kv_bytes_per_token_layer == 2 * 3 * 64 * 4
    assert s.kv_to_hidden_ratio == pytest.approx(2 / 3)


def test_family_specifics():
    def spec(model_type, **kw):
        return ModelSpec.from_config(AutoConfig.for_model(model_type, **kw))

    llama = spec("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2)
    assert (
        llama.kv_to_hidden_ratio == 2.0 and llama.k_weight.module == "self_attn.k_proj" and llama.k_weight.stop is None
    )
    assert spec("qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2).qkv_bias
    phi3 = spec(
        "phi3",
        hidden_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    assert (phi3.k_weight.module, phi3.k_weight.start, phi3.k_weight.stop) == ("self_attn.qkv_proj", 96, 144)
    assert (phi3.v_weight.start, phi3.v_weight.stop) == (144, 192)
    assert phi3.rope.rotary_dim == 12  # half of head size 24
    opt = spec("opt", hidden_size=64, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64)
    assert opt.rope is None and opt.learned_position_offset == 2 and opt.qkv_bias
    assert opt.capture_module == "self_attn_layer_norm" and opt.layers_prefix == "model.decoder.layers"
    mistral = spec(
        "mistral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=32, num_hidden_layers=2
    )
    assert mistral.sliding_windows == (32, 32)


def test_each_family_windows_the_layers_transformers_windows():
    """Mistral and Phi-3 window every layer by ``sliding_window``, Qwen2 the layers its ``layer_types`` name
    sliding, Llama none: what each family's forward in transformers does, whatever the config carries
    (vLLM windows some of these otherwise; its connector takes vLLM's windows, tests/vllm)."""
    from transformers import AutoConfig

    layer_types = ["sliding_attention", "full_attention"]
    fields = dict(num_hidden_layers=2, sliding_window=32, layer_types=layer_types)
    assert ModelSpec.from_config(AutoConfig.for_model("mistral", **fields)).sliding_windows == (32, 32)
    assert ModelSpec.from_config(AutoConfig.for_model("llama", **fields)).sliding_windows == (None, None)
    assert ModelSpec.from_config(AutoConfig.for_model("qwen2", use_sliding_window=True, **fields)).sliding_windows == (
        32,
        None,
    )
    spec = ModelSpec.from_config(AutoConfig.for_model("qwen2", use_sliding_window=True, **fields))
    assert [spec.layer_type(i) for i in range(2)] == layer_types
    assert [spec.attended_from(i, 100) for i in range(2)] == [68, 0] and spec.attended_from(0, 20) == 0


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as err:
        ModelSpec.from_config(GPT2Config())
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(err.value)


@pytest.mark.parametrize("model_type", ["jamba", "falcon_h1", "nemotron_h"])
def test_hybrid_models_with_recurrent_layers_are_refused_naming_the_missing_rule(model_type):
    """Their Mamba or linear-attention layers carry a recurrent state that is not K/V: restoring attention's
    K/V without it would serve wrong state (LMCache #2845), so they are refused saying so, not only as an
    unknown family. Attention-only layer types (Qwen2's and Gemma's full and sliding) pass that check."""
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModelError, match="no rule for the state other layers carry"):
        ModelSpec.from_config(AutoConfig.for_model(model_type))
    qwen2 = AutoConfig.for_model(
        "qwen2",
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=32,
    )
    assert ModelSpec.from_config(qwen2).sliding_windows == (32, None)


def test_opt_350m_layout_is_rejected():
    with pytest.raises(UnsupportedModelError, match="do_layer_norm_before"):
        ModelSpec.from_config(AutoConfig.for_model("opt", do_layer_norm_before=False))


def test_llama3_rope_scaling_matches_transformers():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = AutoConfig.for_model(
        "llama", hidden_size=256, num_attention_heads=2, rope_parameters=rope, max_position_embeddings=131072
    )
    spec = ModelSpec.from_config(config)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert spec.rope.rope_type == "llama3"
    torch.testing.assert_close(torch.tensor(spec.rope.inv_freq), expected.float())
    default = ModelSpec.from_config(AutoConfig.for_model("llama", hidden_size=256, num_attention_heads=2))
    assert spec.rope.inv_freq != default.rope.inv_freq


def test_length_dependent_rope_is_rejected():
    config = AutoConfig.for_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelSpec.from_config(config)


def test_qwen3_norms_q_and_k_before_rope_and_other_families_keep_their_identity():
    """Qwen3's per-head Q and K norms are named where the engines read weights; a family without them keeps
    the spec identity it had before hcache knew of the fact (fingerprints and profiles are keyed by it)."""
    qwen3 = ModelSpec.from_config(
        AutoConfig.for_model("qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    )
    assert qwen3.qk_norm == ("self_attn.q_norm", "self_attn.k_norm") and qwen3.head_size == 32 and qwen3.kv_dim == 64
    assert '"qk_norm": ["self_attn.q_norm", "self_attn.k_norm"]' in qwen3.to_json()
    llama = ModelSpec.from_config(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4))
    assert llama.qk_norm is None and "qk_norm" not in llama.to_json()


def test_a_family_hcache_does_not_know_is_described_for_kv_alone():
    """vLLM's families past hcache's own engines: refused where a family's weights are needed, described by
    their attention's shape where KV alone is (``any_family``), restoring nothing by H and KV by default."""
    from hcache.planning.plan import Method, default_plan

    config = AutoConfig.for_model(
        "gpt_oss", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2
    )
    with pytest.raises(UnsupportedModelError, match="'gpt_oss' is not supported by hcache's own engines"):
        ModelSpec.from_config(config)
    spec = ModelSpec.from_config(config, any_family=True)
    assert (spec.num_kv_heads, spec.head_size, spec.kv_bytes_per_token_layer) == (2, 64, 2 * 2 * 64 * 4)
    assert not spec.restores_hidden and spec.k_weight is None and spec.rope is None
    assert spec.kv_to_hidden_ratio > 1 and default_plan(spec).layers == (Method.KV, Method.KV)  # H would be the smaller


def test_mla_is_described_for_kv_as_one_latent_row_a_token_and_refused_by_hcaches_own_engines():
    """An MLA layer caches the latent and K's RoPE part as one row a token (one head, no K/V split): its
    chunks' KV rows are shaped so, and its identity says so, where a K/V model's keeps the one it had."""
    from hcache.planning.plan import Method, default_plan, row_shapes

    config = AutoConfig.for_model(
        "deepseek_v2", num_hidden_layers=2, hidden_size=128, kv_lora_rank=64, qk_rope_head_dim=16
    )
    with pytest.raises(UnsupportedModelError, match="multi-head latent rows \\(MLA, kv_lora_rank=64\\)"):
        ModelSpec.from_config(config)
    spec = ModelSpec.from_config(config, any_family=True)
    assert (spec.kv_parts, spec.num_kv_heads, spec.head_size, spec.kv_bytes_per_token_layer) == (1, 1, 80, 80 * 4)
    assert row_shapes(spec)["KV"] == (1, 1, 80) and default_plan(spec).layers == (Method.KV, Method.KV)
    assert '"kv_lora_rank": 64' in spec.to_json()
    llama = ModelSpec.from_config(AutoConfig.for_model("llama", num_hidden_layers=2))
    assert llama.kv_parts == 2 and "kv_lora_rank" not in llama.to_json()


def test_gemma_is_described_with_its_forward_facts_and_two_rope_bases():
    """Gemma 3's sliding layers rotate by the local base and its full layers by the global one (with its
    scaling); its query scale, Gemma 2's soft caps and the sandwich norms are the forward's facts. A family
    without them keeps the identity it had (its fingerprints and profiles stay valid)."""
    layer_types = ["sliding_attention", "full_attention"]
    gemma3 = ModelSpec.from_config(
        AutoConfig.for_model(
            "gemma3_text",
            num_hidden_layers=2,
            head_dim=32,
            query_pre_attn_scalar=64,
            sliding_window=16,
            layer_types=layer_types,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    )
    local, full = gemma3.rope_of(0), gemma3.rope_of(1)
    assert (local.theta, local.rope_type, full.theta, full.rope_type) == (1e4, "default", 1e6, "linear")
    assert full.inv_freq[0] == pytest.approx(1 / 8) and local.inv_freq[0] == 1.0  # linear scaling: 1/factor
    assert gemma3.sliding_windows == (16, None) and gemma3.attention_scale == 64**-0.5
    assert gemma3.qk_norm and gemma3.sandwich and gemma3.attention_softcap is None
    gemma2 = ModelSpec.from_config(AutoConfig.for_model("gemma2", num_hidden_layers=2, head_dim=32))
    assert (gemma2.attention_softcap, gemma2.final_softcap, gemma2.sliding_rope) == (50.0, 30.0, None)
    assert gemma2.rope_of(0) is gemma2.rope_of(1) is gemma2.rope
    llama = ModelSpec.from_config(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4))
    assert not {"sandwich", "attention_scale", "attention_softcap", "final_softcap", "sliding_rope"} & set(
        json.loads(llama.to_json())
    )


def test_granite_4_is_described_with_its_mamba_layers_and_scales():
    """GraniteMoeHybrid's Mamba-2 layers are recurrent (their state's shape known), its attention takes no
    RoPE unless ``position_embedding_type`` says so, and its multipliers are the forward's; vLLM's view of
    it (``any_family``) is refused, its state not stored there. A family without these facts keeps its
    identity."""
    fields = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        attention_multiplier=0.1,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=6.0,
    )
    granite = ModelSpec.from_config(AutoConfig.for_model("granitemoehybrid", **fields))
    assert granite.recurrent_layers == (0, 2) and [granite.is_recurrent(i) for i in range(3)] == [True, False, True]
    assert [granite.layer_type(i) for i in range(3)] == ["mamba", "full_attention", "mamba"]
    assert (granite.mamba.conv_shape, granite.mamba.ssm_shape) == ((128 + 2 * 16, 4), (4, 32, 16))
    assert granite.rope is None and granite.attention_scale == 0.1
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logits_scaling) == (12.0, 0.22, 6.0)
    rotating = AutoConfig.for_model("granitemoehybrid", position_embedding_type="rope", **fields)
    assert ModelSpec.from_config(rotating).rope is not None
    with pytest.raises(UnsupportedModelError, match="no rule for the state other layers carry"):
        ModelSpec.from_config(rotating, any_family=True)
    llama = ModelSpec.from_config(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4))
    later = {"recurrent_layers", "mamba", "embedding_multiplier", "residual_multiplier", "logits_scaling"}
    assert not later & set(json.loads(llama.to_json())) and later <= set(json.loads(granite.to_json()))


def test_qwen3_next_is_described_with_its_gated_delta_nets_and_gated_attention():
    """Qwen3-Next's published shape (transformers' defaults, the 80B model): three gated-delta-net layers to one
    of attention, each keeping a convolution state over Q, K and V and a ``[value heads, key dim, value dim]``
    recurrent state; its attention norms Q and K per head, rotates a quarter of each head and gates its output
    by a second half of Q's projection. vLLM's view (``any_family``) is refused: its state is not stored there."""
    config = AutoConfig.for_model("qwen3_next")
    spec = ModelSpec.from_config(config)
    assert spec.recurrent_layers == tuple(i for i in range(48) if i % 4 != 3)
    assert [spec.layer_type(i) for i in range(4)] == ["gated_delta_net"] * 3 + ["full_attention"]
    assert (spec.mamba.conv_shape, spec.mamba.ssm_shape) == ((2 * 16 * 128 + 32 * 128, 4), (32, 128, 128))
    assert spec.qk_norm == ("self_attn.q_norm", "self_attn.k_norm") and spec.output_gate
    assert (spec.head_size, spec.rope.rotary_dim, spec.num_kv_heads) == (256, 64, 2)
    with pytest.raises(UnsupportedModelError, match="no rule for the state other layers carry"):
        ModelSpec.from_config(config, any_family=True)
    llama = ModelSpec.from_config(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4))
    assert "output_gate" not in json.loads(llama.to_json()) and json.loads(spec.to_json())["output_gate"]
