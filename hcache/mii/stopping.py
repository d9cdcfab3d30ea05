"""Which tokens end a request, and not before it has its ``min_new_tokens``: the rule vLLM's sampling
extensions follow (``min_tokens``, ``stop_token_ids``, ``ignore_eos``), in MII's batching loop.

MII 0.3 gets two of them wrong and lacks the third: it compares ``min_new_tokens`` with the sequence's
length, prompt included, so a prompt longer than it is never held; a request held back by it, or by
``ignore_eos``, still samples its end-of-sequence token, whose text the client never sees; and a request
can name no stop token beside the tokenizer's. Here, as in vLLM, a request's stop tokens (the end of
sequence, unless ``ignore_eos``, or the tokens of MII's ``stop``; and its ``stop_token_ids``) cannot be
sampled among its first ``min_new_tokens`` tokens, and sampling any of them ends it ("stop"); the token
that ended it is counted but its text is not sent (as vLLM's, and as the end of sequence's never is).
Replacements for MII's attributes, installed by :mod:`hcache.mii.patches`; sampling runs on rank 0 alone.
"""

from __future__ import annotations

import torch

from ..errors import InvalidRequestError
from .constraints import parse_token_ids
from .detokenize import STOPPED
from .failures import failing_alone

STOP_TOKEN_IDS = "stop_token_ids"  # hcache's option: comma-separated token ids (MII's requests carry scalars only)
INCLUDE_STOP = "include_stop_str_in_output"  # vLLM's option: a stream's stop token's text is sent


def parse_stop_token_ids(value: object) -> tuple[int, ...]:
    """The token ids of ``stop_token_ids``: ``"2,17"``, or a list of ids from Python."""
    return parse_token_ids(STOP_TOKEN_IDS, value)


def counting_new_tokens(is_done: property) -> property:
    """``Request.is_done``: what the sampled token says, the rules above having been applied when it was
    sampled (MII's getter would hold back by the sequence's length and by ``ignore_eos``)."""
    return property(lambda self: self._is_done, is_done.fset)


def as_asked(process_logits):
    """``RaggedBatchBase._process_logits``: each request's constraints (:mod:`.constraints`) and, while it is
    short of its ``min_new_tokens``, its stop tokens masked out before sampling, and a sampled stop token
    ending its request. A grammar that allows nothing but its end gets its end back, ``min_new_tokens`` or
    not (its completion comes first); a request whose masks leave it no token fails alone, as does one whose
    grammar rejects the token sampled (:func:`~.failures.failing_alone`)."""

    def process(self, logits: torch.Tensor, running) -> tuple[torch.Tensor, torch.Tensor]:
        requests = list(running)
        stops = [_stop_ids(self, r) for r in requests]
        # MII's num_generated_tokens counts the token about to be sampled (0 while a prompt is split).
        sampled = [i for i, r in enumerate(requests) if r.num_generated_tokens > 0]
        held = [i for i in sampled if requests[i].num_generated_tokens <= requests[i].min_new_tokens and stops[i]]
        constrained = [i for i in sampled if getattr(requests[i], "hcache_constraints", None)]
        failed: dict[int, Exception] = {}
        if held or constrained:
            logits = logits[:, : self.vocab_size].clone()
            for i in constrained:
                r, c = requests[i], requests[i].hcache_constraints
                recent = [int(t) for t in r.generated_tokens[max(len(r.generated_tokens) - c.lookback, 0) :]]
                c.mask(logits[i], recent, r.generate_params.temperature if r.generate_params.do_sample else None)
            ends = {}  # a held grammar's stop tokens and their logits, for when it allows nothing else
            for i in held:
                ids = [t for t in stops[i] if t < logits.shape[1]]
                if getattr(getattr(requests[i], "hcache_constraints", None), "matcher", None) is not None:
                    ends[i] = (ids, logits[i, ids])
                logits[i, ids] = -torch.inf
            failed = _left_no_token(logits, constrained, ends)  # a row held, unconstrained, has tokens left
            logits[list(failed)] = 0  # sampled for nobody: a row of -inf fails MII's sampler
        next_tokens, done = process_logits(self, logits, running)
        for i in constrained:
            if i not in failed:
                try:
                    requests[i].hcache_constraints.accept(int(next_tokens[i]))
                except InvalidRequestError as exc:
                    failed[i] = exc
        kept = failing_alone(self, running, failed)
        if failed:
            requests, stops, next_tokens = [requests[i] for i in kept], [stops[i] for i in kept], next_tokens[kept]
        done = [t in s for t, s in zip(next_tokens.tolist(), stops)]
        for r, stopped in zip(requests, done):
            r.hcache_stopped = stopped
        return next_tokens, torch.tensor(done, dtype=torch.bool)

    return process


def _left_no_token(logits: torch.Tensor, rows: list[int], ends: dict) -> dict[int, Exception]:
    """The rows of ``rows`` whose masks left no token, each with its error; a held grammar's row that only
    its stop tokens were left (``ends``) first gets them back."""
    if not rows:
        return {}
    dead = [i for i, live in zip(rows, torch.isfinite(logits[rows]).any(-1).tolist()) if not live]
    for i in dead:
        if i in ends:
            ids, kept = ends[i]
            logits[i, ids] = kept
    return {
        i: InvalidRequestError(
            "no token is left to sample: the request's allowed_token_ids, bad_words, structured output and"
            " min_tokens exclude every one"
        )
        for i in dead
        if i not in ends or not torch.isfinite(logits[i]).any()
    }


def leaving_out_stop_tokens(generate_output):
    """``RaggedBatchBase._generate_output``: a stream's last token, when it is the stop token that ended it,
    sent as :data:`~.detokenize.STOPPED`, which decodes to no text, special tokens kept or not, unless the
    request asks for it (:data:`INCLUDE_STOP`). A whole reply leaves it out (MII keeps no token that ended a
    request)."""

    def output(self, r) -> None:
        # it ends here: the token is not read again
        if r.stream and getattr(r, "hcache_stopped", False) and not getattr(r, "hcache_include_stop", False):
            r.next_token = torch.full_like(r.next_token, STOPPED)
        return generate_output(self, r)

    return output


def _stop_ids(loop, request) -> frozenset[int]:
    """The tokens that end ``request``: MII's stop criteria named in its post-processing (the end of
    sequence unless ``ignore_eos``, or the tokens of ``stop``) and its ``stop_token_ids``."""
    mii_stops = set()
    for name in request.post_processing:
        criterion = loop._post_processors.get(name)
        if hasattr(criterion, "eos_id") and not request.ignore_eos:
            mii_stops.add(int(criterion.eos_id))
        elif hasattr(criterion, "stop_token_id"):
            mii_stops.add(int(criterion.stop_token_id))
    return frozenset(mii_stops).union(getattr(request, "hcache_stop_ids", ()))
