"""Workload traces: multi-turn chat (ShareGPT-like) and long-context question answering (L-Eval-like).

A trace is a list of sessions. A session arrives at a time, may start from a shared document, and sends
its turns one after another: a turn is sent ``think_s`` after the previous reply arrives, so its arrival
depends on how fast the server answered and is decided by the replay, not here.

The generators are calibrated to the published means in ``shared/MISSION.md`` (ShareGPT (Pensieve),
ShareGPT4 (HCache), UltraChat, L-Eval). The papers publish means only, so the shapes are our choice:
- token lengths are lognormal with the published mean (``LENGTH_SIGMA`` sets the tail);
- turns per conversation and questions per document are geometric on 1, 2, ... with the published mean;
- think times are exponential; session arrivals are Poisson (exponential gaps at ``rate`` per second);
- L-Eval documents are reused with Zipf popularity (HCache §6.4) when ``zipf`` is set.
Arrival gaps come from their own random stream, so the same seed at another rate gives the same sessions
with the gaps divided by the rate: a rate sweep changes the load and nothing else.

A real ShareGPT JSON file loads through :func:`load_sharegpt` into the same :class:`Trace`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

LENGTH_SIGMA = 1.0  # lognormal shape of token lengths; ShareGPT's lengths are heavy-tailed


@dataclass(frozen=True)
class ChatStats:
    turns: float  # mean turns per conversation
    input_tokens: float  # mean per turn
    output_tokens: float  # mean per turn
    think_s: float  # mean time between a reply and the next turn


@dataclass(frozen=True)
class DocStats:
    context_tokens: float  # mean document length
    input_tokens: float  # mean question length
    output_tokens: float  # mean answer length
    questions: float = 4.0  # mean questions per document: not published, our choice
    think_s: float = 30.0


# Published means (MISSION.md). ShareGPT4's turns per conversation are not published: Pensieve's ShareGPT figure.
CHAT = {
    "sharegpt": ChatStats(turns=5.56, input_tokens=37.77, output_tokens=204.58, think_s=60.0),
    "sharegpt4": ChatStats(turns=5.56, input_tokens=66.8, output_tokens=358.8, think_s=30.0),
    "ultrachat": ChatStats(turns=3.86, input_tokens=51.78, output_tokens=257.81, think_s=60.0),
}
LEVAL = {
    "leval-paper-assistant": DocStats(context_tokens=10603.5, input_tokens=142.7, output_tokens=404.8),
    "leval-gsm100": DocStats(context_tokens=5451.7, input_tokens=77.4, output_tokens=4.3),
    "leval-quality": DocStats(context_tokens=7053.9, input_tokens=92.4, output_tokens=19.2),
    "leval-mean": DocStats(context_tokens=16340.2, input_tokens=44.7, output_tokens=50.2),
}
PRESETS = (*CHAT, *LEVAL)


@dataclass(frozen=True)
class Turn:
    input_tokens: int  # the user's new tokens
    output_tokens: int  # the reply's tokens
    think_s: float  # wait after the previous reply before sending this turn (0 for the first turn)


@dataclass(frozen=True)
class Session:
    arrival_s: float
    turns: tuple[Turn, ...]
    document: int | None = None  # sessions with the same document share its tokens as their prefix
    context_tokens: int = 0  # the document's length

    @property
    def total_tokens(self) -> int:
        return self.context_tokens + sum(t.input_tokens + t.output_tokens for t in self.turns)


@dataclass(frozen=True)
class Trace:
    name: str
    sessions: tuple[Session, ...]

    def scaled(
        self,
        scale: float = 1.0,
        max_output: int | None = None,
        max_tokens: int | None = None,
        max_turns: int | None = None,
        think_scale: float = 1.0,
    ) -> "Trace":
        """A smaller copy for a slow machine: lengths times ``scale`` (at least 1 token), outputs capped at
        ``max_output``, think times times ``think_scale``, and each session cut to its first ``max_turns``
        turns and to the turns whose whole history fits in ``max_tokens`` (as HCache caps ShareGPT at 16K).
        A session whose first turn does not fit is dropped."""
        if not scale > 0 or not think_scale >= 0:
            raise ValueError(f"scale must be > 0 and think_scale ≥ 0, got {scale} and {think_scale}")
        caps = {"max_output": max_output, "max_tokens": max_tokens, "max_turns": max_turns}
        if any(v is not None and v < 1 for v in caps.values()):
            raise ValueError(f"caps must be at least 1 (or None), got {caps}")
        sessions = []
        for s in self.sessions:
            context = max(1, round(s.context_tokens * scale)) if s.context_tokens else 0
            total, turns = context, []
            for t in s.turns[:max_turns]:
                out = max(1, round(t.output_tokens * scale))
                turn = Turn(max(1, round(t.input_tokens * scale)), min(out, max_output or out), t.think_s * think_scale)
                total += turn.input_tokens + turn.output_tokens
                if max_tokens is not None and total > max_tokens:
                    break
                turns.append(turn)
            if turns:
                sessions.append(replace(s, turns=tuple(turns), context_tokens=context))
        return Trace(self.name, tuple(sessions))


def _lognormal(rng: np.random.Generator, mean: float, size: int) -> np.ndarray:
    """Positive integers with mean ``mean``: a lognormal with that mean, rounded, at least 1."""
    mu = math.log(mean) - LENGTH_SIGMA**2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, LENGTH_SIGMA, size))).astype(int)


def _check(sessions: int, rate: float) -> None:
    if sessions < 1:
        raise ValueError(f"sessions must be at least 1, not {sessions}")
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"the session arrival rate must be a positive number per second, not {rate}")


def _arrivals(seed: int, sessions: int, rate: float) -> np.ndarray:
    """Poisson arrivals: cumulative exponential gaps, from a stream of their own (see the module doc)."""
    return np.cumsum(np.random.default_rng([seed, 1]).exponential(1.0, sessions)) / rate


def _turns(rng: np.random.Generator, count: int, stats: ChatStats | DocStats) -> tuple[Turn, ...]:
    inputs = _lognormal(rng, stats.input_tokens, count)
    outputs = _lognormal(rng, stats.output_tokens, count)
    think = rng.exponential(stats.think_s, count)
    return tuple(
        Turn(int(i), int(o), 0.0 if k == 0 else float(w)) for k, (i, o, w) in enumerate(zip(inputs, outputs, think))
    )


def chat_trace(preset: str = "sharegpt", sessions: int = 100, rate: float = 1.0, seed: int = 0) -> Trace:
    """Multi-turn conversations with ``preset``'s statistics (a key of :data:`CHAT`)."""
    _check(sessions, rate)
    stats = _preset(CHAT, preset)
    rng = np.random.default_rng([seed, 0])
    counts = rng.geometric(1 / stats.turns, sessions)
    arrivals = _arrivals(seed, sessions, rate)
    return Trace(preset, tuple(Session(float(a), _turns(rng, int(n), stats)) for a, n in zip(arrivals, counts)))


def leval_trace(
    preset: str = "leval-quality",
    sessions: int = 100,
    rate: float = 1.0,
    seed: int = 0,
    documents: int | None = None,
    zipf: float | None = None,
) -> Trace:
    """Each session reads a document, then asks questions on it, with ``preset``'s statistics (a key of
    :data:`LEVAL`). With ``zipf`` (an exponent > 0), sessions draw their document from a pool of
    ``documents`` (default: ``sessions``) with Zipf popularity, so popular documents are reused; without
    it, every session has its own document."""
    _check(sessions, rate)
    stats = _preset(LEVAL, preset)
    rng = np.random.default_rng([seed, 0])
    pool = documents or sessions
    if zipf is not None:
        if not zipf > 0 or pool < 1:
            raise ValueError(f"zipf must be > 0 and documents ≥ 1, got {zipf} and {pool}")
        weights = 1.0 / np.arange(1, pool + 1) ** zipf
        docs = rng.choice(pool, sessions, p=weights / weights.sum())
    else:
        docs = np.arange(sessions)
    lengths = _lognormal(rng, stats.context_tokens, int(docs.max()) + 1)
    counts = rng.geometric(1 / stats.questions, sessions)
    arrivals = _arrivals(seed, sessions, rate)
    return Trace(
        preset,
        tuple(
            Session(float(a), _turns(rng, int(n), stats), int(d), int(lengths[d]))
            for a, n, d in zip(arrivals, counts, docs)
        ),
    )


def make_trace(preset: str, sessions: int, rate: float, seed: int = 0, zipf: float | None = None) -> Trace:
    if preset in CHAT:
        if zipf is not None:
            raise ValueError("zipf reuse applies to the L-Eval presets (documents), not to chat")
        return chat_trace(preset, sessions, rate, seed)
    return leval_trace(preset, sessions, rate, seed, zipf=zipf)


def load_sharegpt(
    path: str | Path,
    count_tokens: Callable[[str], int] | None = None,
    rate: float = 1.0,
    think_s: float = CHAT["sharegpt"].think_s,
    seed: int = 0,
    limit: int | None = None,
) -> Trace:
    """A ShareGPT JSON file (a list of ``{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}``)
    as a trace: each human message with the reply after it is a turn, counted with ``count_tokens`` (the
    model's tokenizer; default: about 4 characters a token). Arrivals and think times are drawn as in
    :func:`chat_trace`; conversations that do not start with a human turn start at their first one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no ShareGPT file at {path}")
    try:
        records = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a list of conversations, got {type(records).__name__}")
    count = count_tokens or (lambda text: max(1, round(len(text) / 4)))
    rng = np.random.default_rng([seed, 0])
    conversations = []
    for i, record in enumerate(records[:limit]):
        messages = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(messages, list):
            raise ValueError(f"{path}: conversation {i} has no 'conversations' list")
        turns, pending = [], None
        for m in messages:
            role, text = m.get("from"), m.get("value", "")
            if role == "human":
                pending = count(text)
            elif role == "gpt" and pending is not None:
                think = 0.0 if not turns else float(rng.exponential(think_s))
                turns.append(Turn(pending, count(text), think))
                pending = None
        if turns:
            conversations.append(tuple(turns))
    if not conversations:
        raise ValueError(f"{path}: no conversation has a human turn followed by a reply")
    _check(len(conversations), rate)
    arrivals = _arrivals(seed, len(conversations), rate)
    return Trace(path.stem, tuple(Session(float(a), t) for a, t in zip(arrivals, conversations)))


def _preset(table: dict, name: str):
    if name not in table:
        raise ValueError(f"unknown trace preset {name!r}; choose one of {', '.join(PRESETS)}")
    return table[name]
