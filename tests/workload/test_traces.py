"""Workload traces reproduce the published statistics, and a ShareGPT file loads as one."""

import json
import random

import numpy as np
import pytest

from hcache.workload.traces import CHAT, LEVAL, chat_trace, leval_trace, load_sharegpt


@pytest.fixture
def seed() -> int:
    """A fresh seed each run; it is in the captured output of a failing test."""
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed={seed}")
    return seed


def _close(measured: float, target: float) -> bool:
    return abs(measured / target - 1) <= 0.10


@pytest.mark.parametrize("preset", sorted(CHAT))
def test_chat_trace_matches_the_published_means(preset, seed):
    stats, rate = CHAT[preset], 2.5
    trace = chat_trace(preset, sessions=20000, rate=rate, seed=seed)
    turns = [t for s in trace.sessions for t in s.turns]
    measured = {
        "turns": np.mean([len(s.turns) for s in trace.sessions]),
        "input_tokens": np.mean([t.input_tokens for t in turns]),
        "output_tokens": np.mean([t.output_tokens for t in turns]),
        "think_s": np.mean([t.think_s for s in trace.sessions for t in s.turns[1:]]),
    }
    for name, value in measured.items():
        assert _close(value, getattr(stats, name)), (name, value, getattr(stats, name))
    assert all(s.turns[0].think_s == 0 for s in trace.sessions)
    assert _close(np.mean(np.diff([s.arrival_s for s in trace.sessions])), 1 / rate)


@pytest.mark.parametrize("preset", sorted(LEVAL))
def test_leval_trace_matches_the_published_means(preset, seed):
    stats = LEVAL[preset]
    trace = leval_trace(preset, sessions=20000, seed=seed)
    turns = [t for s in trace.sessions for t in s.turns]
    assert _close(np.mean([s.context_tokens for s in trace.sessions]), stats.context_tokens)
    assert _close(np.mean([t.input_tokens for t in turns]), stats.input_tokens)
    assert _close(np.mean([t.output_tokens for t in turns]), stats.output_tokens)
    assert _close(np.mean([len(s.turns) for s in trace.sessions]), stats.questions)
    assert len({s.document for s in trace.sessions}) == 20000  # no reuse without zipf


def test_zipf_reuse_follows_zipf_popularity(seed):
    trace = leval_trace("leval-quality", sessions=20000, seed=seed, documents=100, zipf=1.0)
    counts = np.bincount([s.document for s in trace.sessions], minlength=100)
    harmonic = sum(1 / k for k in range(1, 101))
    assert _close(counts[0] / 20000, 1 / harmonic) and _close(counts[1] / 20000, 1 / (2 * harmonic))
    by_doc = {}
    for s in trace.sessions:  # a reused document keeps its length, so its tokens can be shared
        assert by_doc.setdefault(s.document, s.context_tokens) == s.context_tokens


def test_same_seed_same_trace_and_rate_only_rescales_arrivals(seed):
    a, b = chat_trace("sharegpt", 50, rate=1.0, seed=seed), chat_trace("sharegpt", 50, rate=1.0, seed=seed)
    assert a == b
    assert chat_trace("sharegpt", 50, rate=1.0, seed=seed + 1) != a
    faster = chat_trace("sharegpt", 50, rate=4.0, seed=seed)
    assert [s.turns for s in faster.sessions] == [s.turns for s in a.sessions]
    assert np.allclose([s.arrival_s * 4 for s in faster.sessions], [s.arrival_s for s in a.sessions])


def test_scaled_trace_respects_every_cap(seed):
    trace = leval_trace("leval-gsm100", 200, seed=seed).scaled(
        0.05, max_output=3, max_tokens=1024, max_turns=2, think_scale=0.1
    )
    assert trace.sessions
    for s in trace.sessions:
        assert 1 <= len(s.turns) <= 2 and s.total_tokens <= 1024
        assert all(t.output_tokens <= 3 and t.input_tokens >= 1 for t in s.turns)
    full = leval_trace("leval-quality", 200, seed=seed)
    kept = full.scaled(0.1, max_tokens=700)
    first = [
        max(1, round(s.context_tokens * 0.1))
        + sum(max(1, round(n * 0.1)) for n in (s.turns[0].input_tokens, s.turns[0].output_tokens))
        for s in full.sessions
    ]
    assert 0 < len(kept.sessions) == sum(n <= 700 for n in first) < len(full.sessions)  # too long a first turn: dropped
    assert all(s.total_tokens <= 700 for s in kept.sessions)


def test_bad_trace_parameters_are_refused():
    with pytest.raises(ValueError, match="rate"):
        chat_trace("sharegpt", 10, rate=0)
    with pytest.raises(ValueError, match="sessions"):
        chat_trace("sharegpt", 0)
    with pytest.raises(ValueError, match="unknown trace preset"):
        chat_trace("leval-quality")
    with pytest.raises(ValueError, match="caps"):
        chat_trace("sharegpt", 10).scaled(max_output=0)
    with pytest.raises(ValueError, match="scale"):
        chat_trace("sharegpt", 10).scaled(scale=-1)


def test_sharegpt_file_loads_as_a_trace(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "one two three"},
                        {"from": "gpt", "value": "a b"},
                        {"from": "human", "value": "four"},
                        {"from": "gpt", "value": "c d e f"},
                    ]
                },
                {
                    "conversations": [
                        {"from": "gpt", "value": "greeting"},
                        {"from": "human", "value": "x y"},
                        {"from": "gpt", "value": "z"},
                    ]
                },
                {"conversations": [{"from": "human", "value": "unanswered"}]},
            ]
        )
    )
    trace = load_sharegpt(path, lambda text: len(text.split()), rate=2.0, think_s=10.0)
    assert [[(t.input_tokens, t.output_tokens) for t in s.turns] for s in trace.sessions] == [
        [(3, 2), (1, 4)],
        [(2, 1)],
    ]
    assert trace.sessions[0].turns[0].think_s == 0 and trace.sessions[0].turns[1].think_s > 0
    assert trace.sessions[0].arrival_s < trace.sessions[1].arrival_s
    assert load_sharegpt(path).sessions[0].turns[0].input_tokens == 3  # 13 characters at about 4 a token
    with pytest.raises(ValueError, match="no ShareGPT file"):
        load_sharegpt(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="list of conversations"):
        load_sharegpt(tmp_path / "bad.json")
