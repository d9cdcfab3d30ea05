"""The serving engine under FastGen's interface: restore before prefill, in steps when a prompt arrives in
parts (Dynamic SplitFuse), and exact either way."""

import json
import os

import pytest
import torch
from support.helpers import loaded, random_prompt, serving_engine

from hcache.engine.reference import ReferenceEngine
from hcache.errors import CacheFullError, InvalidRequestError
from hcache.model.fingerprint import model_fingerprint
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.planning.profile import Profile
from hcache.serving.engine import ServingEngine
from hcache.storage.chunk_key import CHUNK_TOKENS

PROMPT = 5 * CHUNK_TOKENS + 10


def _serving(store_dir, **kwargs) -> ServingEngine:
    lm = loaded("random:llama")
    engine = ReferenceEngine(lm.model, lm.spec, num_blocks=32)
    return serving_engine(
        engine, model_fingerprint(lm.model, lm.spec), store_dir, model_name=lm.name, readers=0, **kwargs
    )


def _put_in_parts(serving: ServingEngine, uid: int, prompt: list[int], part: int) -> torch.Tensor:
    """What MII does with a long prompt: one put per ``part`` tokens; the last put's logits are the answer."""
    for start in range(0, len(prompt), part):
        logits = serving.put([uid], [torch.tensor(prompt[start : start + part])])
    return logits


def _kv(serving: ServingEngine, uid: int) -> list[torch.Tensor]:
    return [torch.stack(serving.engine.kv(uid, layer)) for layer in range(serving.spec.num_layers)]


@pytest.mark.parametrize("part", [PROMPT, 128, 100])
@pytest.mark.parametrize("plan", ["KV", "H", "1RE+1H+1KV"])
def test_restore_in_steps_equals_recompute(tmp_path, rng, part, plan):
    """Restored in one put or over several (chunk-aligned or not), the cache and the next-token logits
    equal a recompute's, and everything stored was restored but the last token's chunk tail."""
    prompt = random_prompt(PROMPT, loaded("random:llama").spec.vocab_size, rng)
    with _serving(tmp_path, plan=plan, save="all") as serving:
        ref_logits = _put_in_parts(serving, 0, prompt, PROMPT)  # saves every full chunk
        ref_kv = _kv(serving, 0)
        serving.flush(0)

        logits = _put_in_parts(serving, 1, prompt, part)
        record = serving.record(1)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        for got, want in zip(_kv(serving, 1), ref_kv):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # Each put restores what is stored of its tokens but its last one, from the middle of a chunk if it
        # starts there. 128: 127 + 127 + 64 (the rest of the prompt is not a full chunk); 100: 64 (not 99:
        # a chunk is keyed by all its tokens, and those of the second have not all arrived) + 92 + 56 + 20.
        expected = {PROMPT: 5 * CHUNK_TOKENS, 128: 127 + 127 + 64, 100: 64 + 92 + 56 + 20}[part]
        assert record.restored_tokens == expected
        assert record.computed_tokens == PROMPT - expected
        assert (
            record.plan == str(serving.config.policy.request_plan(plan))
            and record.fallback is None
            and record.bytes_read > 0
        )


@pytest.mark.parametrize("part", [None, 100])
def test_chunks_saved_after_a_restore_continue_the_chain(tmp_path, rng, part):
    """A sequence restored in part (in one put, or in several that end inside chunks), then extended, saves
    its new chunks under the right keys: a third request finds the whole longer prefix and restores exactly."""
    vocab = loaded("random:llama").spec.vocab_size
    prompt = random_prompt(3 * CHUNK_TOKENS + 5, vocab, rng)
    longer = prompt + random_prompt(2 * CHUNK_TOKENS, vocab, rng)
    with _serving(tmp_path, plan="KV") as serving:
        logits = []
        for uid, tokens in enumerate((prompt, longer, longer)):
            logits.append(_put_in_parts(serving, uid, tokens, part or len(tokens)))
            restored = serving.record(uid).restored_tokens
            serving.flush(uid)
            # in parts of 100, a put restores only chunks whose tokens have all arrived (see above)
            assert restored == ([0, 192, 320] if part is None else [0, 64 + 92, 64 + 92 + 56 + 20])[uid]
        torch.testing.assert_close(logits[2], logits[1], atol=1e-5, rtol=1e-5)


def test_each_restore_is_logged_at_info_with_its_plan_and_tiers(tmp_path, rng, caplog):
    """``hcache -v``: one INFO line per put that restored, saying the plan, the tokens restored of the put's
    and where they were read from; nothing for a put that restored nothing, and nothing below INFO."""
    prompt = random_prompt(2 * CHUNK_TOKENS + 3, loaded("random:llama").spec.vocab_size, rng)
    with _serving(tmp_path, plan="KV") as serving:
        with caplog.at_level("WARNING", logger="hcache.serving.engine"):
            serving.put([0], [prompt])
            serving.flush(0)
            serving.put([1], [prompt])
            serving.flush(1)
        assert not caplog.records
        with caplog.at_level("INFO", logger="hcache.serving.engine"):
            serving.put([2], [prompt])
            serving.put([2], [[1]])  # a decode step restores nothing
            tiers = serving.record(2).tier_tokens
            serving.flush(2)
    lines = [r.getMessage() for r in caplog.records if r.name == "hcache.serving.engine"]
    assert sum(tiers.values()) == 2 * CHUNK_TOKENS
    where = ", ".join(f"{name} {n}" for name, n in tiers.items())
    assert lines == [
        f"sequence 2: restored {2 * CHUNK_TOKENS} of {len(prompt)} tokens ({where}; plan 3KV), computing 3"
    ]


def test_without_a_store_nothing_is_restored_or_saved(tmp_path, rng):
    prompt = random_prompt(2 * CHUNK_TOKENS + 3, loaded("random:llama").spec.vocab_size, rng)
    with _serving(None, enabled=False) as serving:
        assert serving.stack.store is None and serving.stack.saver is None and serving.stack.capture is None
        for uid in range(2):
            serving.put([uid], [prompt])
            assert serving.record(uid).restored_tokens == 0
            serving.flush(uid)


def test_request_log_has_a_line_per_finished_sequence_and_is_private(tmp_path, rng):
    prompt = random_prompt(CHUNK_TOKENS + 2, loaded("random:llama").spec.vocab_size, rng)
    log = tmp_path / "requests.jsonl"
    umask = os.umask(0o022)
    try:
        with _serving(tmp_path / "store", plan="KV", request_log=log) as serving:
            for uid in (7, 8):
                serving.put([uid], [prompt])
                serving.put([uid], [[1]])  # a decode step
                serving.flush(uid)
    finally:
        os.umask(umask)
    assert log.stat().st_mode & 0o777 == 0o600  # token counts per conversation, like the store's files
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["uid"], r["restored_tokens"], r["computed_tokens"]) for r in lines] == [
        (7, 0, CHUNK_TOKENS + 3),
        (8, CHUNK_TOKENS, 3),
    ]


def test_capacity_follows_fastgen(tmp_path):
    """``query`` answers as FastGen's ``get_kv_requirements`` does: all tokens if the blocks allow,
    else as many as fit in the blocks granted."""
    with _serving(None, enabled=False) as serving:
        assert serving.query(0, 100, 10) == (100, 2)
        assert serving.query(0, 200, 2) == (128, 2)
        serving.put([0], [list(range(1, 71))])  # 70 tokens: 2 blocks, 58 free slots in the last
        assert serving.get_remaining_block_capacity(0) == 58
        assert serving.query(0, 58, 0) == (58, 0)
        assert serving.query(0, 60, 1) == (60, 1)
        assert int(min(serving.free_blocks)) == 30
        serving.flush(0)
        assert int(min(serving.free_blocks)) == 32


def test_bad_input_is_refused(tmp_path):
    with _serving(tmp_path) as serving:
        with pytest.raises(InvalidRequestError, match="no tokens"):
            serving.put([0], [[]])
        serving.open(1)
        with pytest.raises(InvalidRequestError, match="already open"):
            serving.open(1)


def test_a_failed_put_saves_nothing_wrong(tmp_path, rng):
    """A put that fails (the KV cache is full) leaves its sequence refused until flushed, and stores nothing
    under the wrong key: after a retry, a later request restores exactly what recompute gives."""
    vocab = loaded("random:llama").spec.vocab_size
    prompt = random_prompt(3 * CHUNK_TOKENS + 5, vocab, rng)
    lm = loaded("random:llama")
    small = ReferenceEngine(lm.model, lm.spec, num_blocks=4)  # 256 tokens: the prompt plus 64 decode steps do not fit
    with serving_engine(
        small, model_fingerprint(lm.model, lm.spec), tmp_path, model_name=lm.name, plan="KV", readers=0
    ) as serving:
        serving.put([0], [prompt[:150]])
        with pytest.raises(CacheFullError):
            serving.put([0], [prompt[150:] + [1] * 64])
        with pytest.raises(InvalidRequestError, match="flush it"):
            serving.put([0], [[1]])
        serving.flush(0)
        want = serving.put([1], [prompt])  # recompute: what was stored before the failure ends at 128
        assert serving.record(1).restored_tokens == 2 * CHUNK_TOKENS
        want_kv = _kv(serving, 1)
        serving.flush(1)
        got = serving.put([2], [prompt])
        assert serving.record(2).restored_tokens == 3 * CHUNK_TOKENS
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for g, w in zip(_kv(serving, 2), want_kv):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_auto_plan_is_chosen_once_per_history_in_pieces_as_in_one_put(tmp_path, rng):
    """The issue's case: a 2,176-token prompt, stored, comes back in one put and in MII's pieces of 100. The
    profile plans short histories RE + H and long ones H + KV; every piece restores by the one put's plan, and
    the request log lists each piece's restore."""
    model = random_model("llama", max_position_embeddings=4096)
    spec = ModelSpec.from_config(model.config, torch.float32)
    seconds = {
        "c_token": [0.001, 0.4],
        "c_h": [0.0002, 0.003],
        "c_kv": [0.0, 0.0],
        "io_h": [0.0006, 0.001],
        "io_kv": [0.0012, 0.002],
    }
    profile = Profile.new("llama-4k", spec, [64, 256], seconds, {})
    prompt = random_prompt(34 * CHUNK_TOKENS, spec.vocab_size, rng)
    long, short = profile.plan(spec, len(prompt)), profile.plan(spec, CHUNK_TOKENS)
    assert str(long) == "3KV" and str(short) == "1RE+2H"
    log = tmp_path / "requests.jsonl"
    engine = ReferenceEngine(model, spec, num_blocks=40)
    with serving_engine(
        engine,
        model_fingerprint(model, spec),
        tmp_path / "store",
        model_name="llama-4k",
        profile=profile,
        readers=0,
        request_log=log,
    ) as serving:
        _put_in_parts(serving, 0, prompt, len(prompt))  # stores every chunk
        serving.flush(0)
        one_put = _put_in_parts(serving, 1, prompt, len(prompt))
        serving.flush(1)
        serving.query(2, len(prompt), 40)  # as MII asks before the first piece: the prompt's length
        pieces = _put_in_parts(serving, 2, prompt, 100)
        serving.flush(2)
        _put_in_parts(serving, 3, prompt, 100)  # unannounced: only the arrived 64 tokens are known
        serving.flush(3)
    torch.testing.assert_close(pieces, one_put, atol=1e-5, rtol=1e-5)
    records = {r["uid"]: r for r in map(json.loads, log.read_text().splitlines())}
    assert records[0]["restores"] == [] and records[0]["plan"] == ""
    assert records[1]["restores"] == [{"plan": str(long), "tokens": len(prompt) - 1, "gpu_tokens": 0, "hidden_s": 0.0}]
    steps = records[2]["restores"]
    assert len(steps) == 22 and {s["plan"] for s in steps} == {str(long)} == {records[2]["plan"]}  # one per piece
    assert (
        sum(s["tokens"] for s in steps) == records[2]["restored_tokens"] == len(prompt) - records[2]["computed_tokens"]
    )
    assert {s["plan"] for s in records[3]["restores"]} == {str(short)}
