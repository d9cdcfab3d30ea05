"""The conversations the serving benchmarks send: each opens with a document and goes on with questions."""

from __future__ import annotations

import numpy as np


def conversations_of(tokenizer, conversations: int, turns: int, document_words: int, seed: int) -> list[list[str]]:
    """Each conversation's user messages: a document of ``document_words`` whole words of the tokenizer and a
    question, then ``turns - 1`` more questions."""
    words = sorted(w[1:] for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(conversations):
        document = " ".join(rng.choice(words, document_words)).capitalize() + "."
        questions = [f"What does the text say about {w}?" for w in rng.choice(words, turns)]
        out.append([f"{document}\n\n{questions[0]}", *questions[1:]])
    return out
