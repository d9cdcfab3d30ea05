"""How much of a prompt a restore may load: a rule of its own, free of torch, for vLLM's scheduler, which
decides what to offer without the data plane."""

from __future__ import annotations


def restorable(tokens: int) -> int:
    """How many of a prompt's ``tokens`` a restore may load: all but the last, whose logits give the first
    output token, so the engine computes it."""
    return max(0, tokens - 1)
