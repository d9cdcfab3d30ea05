"""``hcache bench vllm --family``'s pieces, without vLLM (seven engines of a hybrid take minutes to start): the
model it remakes, and its stored bytes by layer type."""

import torch

from hcache.bench._vllm_model import family_fields, stored_bytes_by_type
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.storage.chunk import Chunk, encode

SIZE = {  # a checkpoint's config, as --model's: two query heads of 64 to one K/V head
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}


def _hybrid():
    return random_model("qwen3_next", torch.bfloat16, **family_fields("qwen3_next", SIZE, 64))


def test_a_remade_qwen3_next_keeps_the_size_and_is_the_hybrid_vllms_cpu_build_takes():
    config = _hybrid().config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (
        128,
        4,
        1,
        64,
    )
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]  # Qwen3-Next's pattern
    assert (config.linear_key_head_dim, config.linear_value_head_dim) == (128, 128)  # the CPU gated delta net's
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (1, 2)
    assert not config.tie_word_embeddings and config.mlp_only_layers == []
    assert ModelSpec.from_config(config).recurrent_layers == (0, 1, 2)
    qwen3 = random_model("qwen3", **family_fields("qwen3", SIZE, 64)).config
    assert (qwen3.model_type, qwen3.num_hidden_layers, qwen3.head_dim) == ("qwen3", 4, 64)


def test_stored_bytes_are_counted_by_the_type_of_their_layer(tmp_path):
    spec = ModelSpec.from_config(_hybrid().config)
    state, kv = torch.ones(64, 3, 100, dtype=torch.bfloat16), torch.ones(64, 2, 64, dtype=torch.bfloat16)
    files = []
    for i in range(2):
        key = f"{i:064x}"
        tensors = {(0, "state"): state, (2, "state"): state, (3, "kv"): kv}
        path = tmp_path / "chunks" / key[:2] / f"{key}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode(Chunk(key, list(range(64)), "f", tensors)))
        files.append(path)
    by_type = stored_bytes_by_type(files, spec)
    assert by_type == {"gated_delta_net": 2 * 2 * state.nbytes, "full_attention": 2 * kv.nbytes}
