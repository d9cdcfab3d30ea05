"""Models of random weights: restore speed and correctness depend on a model's shape, not its weights.

A tiny model of each supported family for tests, a full-size named shape (``llama-2-7b``, ``llama-3-8b``) for
GPU benchmarks, a model shaped as a checkpoint, and a random model saved as a checkpoint with a word-level
tokenizer, for the engines that load checkpoints themselves (MII, vLLM). Weights are seeded: a shape and a
seed give the same model everywhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelNotFoundError

RANDOM_PREFIX = "random:"  # a model name that asks for random weights: ``random:<shape>``


# Small shapes for tests: every supported family, MHA and GQA, biases, fused QKV, partial rotary, Q/K norms; and
# families vLLM serves that hcache's engines do not.
_GEMMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=48,
    sliding_window=48,
)
_TINY: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4),
    "mistral": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, sliding_window=48
    ),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    # Q/K norms, and heads wider than hidden_size / num_attention_heads, as Qwen3's are
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "phi3": dict(
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "opt": dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64, enable_bias=True),
    # Gemma: sandwich norms, scaled embeddings, a query scale of its own, sliding and full layers; Gemma 2's soft
    # caps, Gemma 3's Q/K norms and its two RoPE bases (local 10K, global 1M)
    "gemma2": _GEMMA,
    "gemma3_text": {**_GEMMA, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    # Granite 4: Mamba-2 and attention layers, MoE beside a shared MLP, Granite's scales; no RoPE, as Granite 4's
    "granitemoehybrid": dict(
        hidden_size=64,
        intermediate_size=64,
        shared_intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_chunk_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=3.0,
    ),
    # Qwen3-Next: gated-delta-net and gated attention layers (Q/K norms, a quarter of each head rotating), sparse MoE
    # with a gated shared expert beside a dense MLP (layer 2)
    "qwen3_next": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[2],
    ),
    # families hcache's own engines do not run, which vLLM serves and hcache stores by KV there
    "gpt_oss": dict(
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # MLA: the latent 512 wide and K's RoPE part 64, the one shape vLLM's CPU MLA kernel takes; every layer dense
    # (vLLM's CPU router of DeepSeek's experts needs groups), the output embedding apart (vLLM's DeepSeek-V2 ties
    # none: a tied checkpoint gives it no lm_head, and every logit comes out equal)
    "deepseek_v2": dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=64,
    ),
}


# Each hybrid's layer pattern, as its released models repeat it over their layers.
HYBRID_LAYERS = {
    "qwen3_next": ("linear_attention", "linear_attention", "linear_attention", "full_attention"),
    "granitemoehybrid": ("mamba", "mamba", "mamba", "attention"),
}


def hybrid_layer_types(family: str, layers: int) -> list[str]:
    """``layers`` layer types in ``family``'s pattern (:data:`HYBRID_LAYERS`)."""
    pattern = HYBRID_LAYERS[family]
    return [pattern[i % len(pattern)] for i in range(layers)]


# What vLLM's CPU build takes of a Qwen3-Next beyond its shape (and bfloat16, its gated delta net's one dtype):
# linear heads of 128, which its CPU gated delta net takes alone, and experts in every layer. random_model unties
# the output embedding, as vLLM's Qwen3-Next needs (it leaves a tied one unloaded: every logit equal).
QWEN3_NEXT_FOR_VLLM = dict(linear_key_head_dim=128, linear_value_head_dim=128, mlp_only_layers=[])


# Full-size shapes for GPU benchmarks: restore speed depends on the shape, not on the weights. The context is
# widened to 32K so that histories up to 16K fit.
_FULL: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-2-7b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_attention_heads=32,
            num_key_value_heads=32,
            num_hidden_layers=32,
            vocab_size=32000,
            max_position_embeddings=32768,
        ),
    ),
    "llama-3-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=32,
            vocab_size=128256,
            max_position_embeddings=32768,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
}


def random_model(
    shape: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu", **overrides: Any
) -> torch.nn.Module:
    """A random-weight model: a tiny one of model type ``shape``, or a full-size named shape such as
    ``llama-2-7b``; ``overrides`` change any config field."""
    from transformers import AutoConfig

    if shape in _FULL:
        model_type, fields = _FULL[shape][0], dict(_FULL[shape][1], tie_word_embeddings=False)
    elif shape in _TINY:
        model_type = shape
        fields = dict(num_hidden_layers=3, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)
        fields.update(_TINY[shape])
    else:
        raise ModelNotFoundError(
            f"no random shape {shape!r}; choose a model type ({', '.join(_TINY)}) or a full shape ({', '.join(_FULL)})"
        )
    return _randomised(AutoConfig.for_model(model_type, **{**fields, **overrides}), dtype, seed, device)


def _randomised(config, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # transformers' SDPA attention drops Gemma 2's soft cap on scores: eager keeps the model's own arithmetic,
    # against which tests hold the engines.
    eager = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    with torch.device(device):  # a 7B model is built where it will run, not copied there
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **eager)
    # HF initialises with std 0.02, which makes every logit nearly equal; widen so greedy decoding has clear winners.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            elif name.endswith("linear_attn.A_log"):
                # A gated delta net's decay rates: transformers draws A in [0.01, 16], which forgets a token within
                # one or two; [0.01, 0.1] remembers ~10 to ~100, so the state a restore carries over a chunk's end
                # matters (and the gated norm no longer scales float noise up from near-zero outputs).
                p.uniform_(math.log(0.01), math.log(0.1))
    return model.eval()


def random_like(directory: str | Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A float32 model of random weights shaped as the checkpoint in ``directory``, its config changed by
    ``overrides`` (``num_key_value_heads`` = its query heads: an MHA model of its size)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    for field, value in overrides.items():
        setattr(config, field, value)
    return _randomised(config, torch.float32, seed)


def save_random_model(name: str, dtype: torch.dtype, path: Path) -> Path:
    """A random-weight model of shape ``random:<shape>`` and a word-level tokenizer over its vocabulary, saved
    in ``path``: text of words ``w0. w1. ...`` tokenizes to exactly the ids it was made of."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(name.removeprefix(RANDOM_PREFIX), dtype=dtype, device=device)
    model.save_pretrained(path)
    # Special tokens are matched inside words, so no word may contain another: "w1." is not in "w17.".
    vocab = {f"w{i}.": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0."))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0.", eos_token="w1.").save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path
