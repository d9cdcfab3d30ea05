"""What a request may constrain of its next token, as vLLM's sampling parameters do: ``allowed_token_ids``,
``bad_words``, ``min_p``, and a structured output (a JSON schema, a regular expression or an EBNF grammar,
compiled by xgrammar, the library vLLM uses). Each is a mask on the logits in MII's batching loop,
before MII's own top-k, top-p, temperature and sampler (:func:`hcache.mii.stopping.as_asked`).

MII's gRPC requests carry scalars only, so these options travel as text: token ids comma-separated, the bad
words and the structured output as JSON (:func:`structured_option`). A grammar is checked where the request
is made (:func:`check_structured`, no tokenizer needed) and compiled for the model's vocabulary when MII makes
the request, off the batching loop; once it is complete only a stop token may follow, so generation ends. As in
vLLM, a grammar whose stop token was sampled (and ended nothing, under ``ignore_eos``) masks nothing more; a
token the grammar rejects fails its request (:meth:`Constraints.accept`)."""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidRequestError

ALLOWED_TOKEN_IDS, BAD_WORDS, MIN_P, STRUCTURED = "allowed_token_ids", "bad_words", "min_p", "structured_output"
FIELDS = frozenset((ALLOWED_TOKEN_IDS, BAD_WORDS, MIN_P, STRUCTURED))
KINDS = ("json", "regex", "grammar")  # a structured output's kinds: a JSON schema, a regex, an EBNF grammar


def parse_token_ids(name: str, value: object) -> tuple[int, ...]:
    """The token ids of option ``name``: ``"2,17"``, or a list of ids from Python."""
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and items and all(_token_id(i) for i in items):
        return tuple(int(i) for i in items)
    raise InvalidRequestError(f"{name} must be token ids (non-negative integers, comma-separated), not {value!r:.80}")


def _token_id(item: object) -> bool:
    return (type(item) is int and item >= 0) or (isinstance(item, str) and item.strip().isdigit())


def structured_option(kind: str, value: str) -> str:
    """The ``structured_output`` option for a grammar of ``kind`` (one of :data:`KINDS`)."""
    return json.dumps({"kind": kind, "value": value})


def check_structured(kind: str, value: str):
    """The xgrammar ``Grammar`` of a structured output, or :class:`InvalidRequestError` saying what is wrong
    with it (xgrammar's message, less its source location)."""
    import xgrammar

    build = {
        "json": xgrammar.Grammar.from_json_schema,
        "regex": xgrammar.Grammar.from_regex,
        "grammar": xgrammar.Grammar.from_ebnf,
    }
    if kind not in build or not isinstance(value, str) or not value:
        raise InvalidRequestError(f"a structured output is one of {', '.join(KINDS)} with its text, not {kind!r:.40}")
    try:
        return build[kind](value)
    except RuntimeError as exc:
        reason = re.sub(r"^\[[^]]*\] \S+:\d+: ", "", str(exc)).strip()
        raise InvalidRequestError(f"bad {kind}: {reason}") from None


@dataclass
class Constraints:
    """One request's constraints on its next token; ``bad_words``: as words until :meth:`for_model`
    tokenizes them (vLLM's rule: each word, and with a leading space where that is a word of its own)."""

    allowed: tuple[int, ...] = ()
    bad_words: tuple = ()
    min_p: float = 0.0
    structured: tuple[str, str] | None = None
    matcher: Any = field(default=None, repr=False)

    def __bool__(self) -> bool:
        return bool(self.allowed or self.bad_words or self.min_p or self.structured)

    @classmethod
    def take(cls, options: dict[str, Any]) -> Constraints:
        """The constraints in generation ``options``, taken out of them, checked."""
        c = cls()
        if ALLOWED_TOKEN_IDS in options:
            c.allowed = parse_token_ids(ALLOWED_TOKEN_IDS, options.pop(ALLOWED_TOKEN_IDS))
        if BAD_WORDS in options:
            c.bad_words = _words(options.pop(BAD_WORDS))
        if MIN_P in options:
            c.min_p = options.pop(MIN_P)
            if type(c.min_p) not in (int, float) or not 0 <= c.min_p <= 1:
                raise InvalidRequestError(f"min_p must be a number between 0 and 1, not {c.min_p!r:.40}")
        if STRUCTURED in options:
            try:
                spec = json.loads(options.pop(STRUCTURED))
                c.structured = (spec["kind"], spec["value"])
            except (TypeError, ValueError, KeyError):
                raise InvalidRequestError(f'{STRUCTURED} must be JSON: {{"kind": one of {KINDS}, "value": text}}')
            check_structured(*c.structured)
        return c

    def for_model(self, tokenizer, vocab_size: int) -> Constraints:
        """These constraints made for the model: token ids checked against its vocabulary, bad words as
        token ids, the grammar compiled into a matcher. ``tokenizer``: the HF tokenizer."""
        if any(t >= vocab_size for t in self.allowed):
            raise InvalidRequestError(f"{ALLOWED_TOKEN_IDS} must be below the vocabulary's size {vocab_size}")
        sequences: list[tuple[int, ...]] = []
        for word in self.bad_words:  # vLLM's rule: both forms of the word with its leading spaces stripped
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                raise InvalidRequestError(f"{BAD_WORDS}: {word!r:.40} is no token")
            sequences.append(plain)
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        made = Constraints(self.allowed, tuple(sequences), self.min_p, self.structured)
        if self.structured is not None:
            made.matcher = _matcher(tokenizer, vocab_size, *self.structured)
        return made

    @property
    def lookback(self) -> int:
        """How many of the last tokens generated :meth:`mask` reads: a multi-token bad word's all but last."""
        return max((len(words) - 1 for words in self.bad_words), default=0)

    def mask(self, logits: torch.Tensor, generated: list[int], temperature: float | None) -> None:
        """Mask, in place, the tokens one row of ``logits`` may not take after ``generated`` (at least its
        last :attr:`lookback` tokens); ``temperature``: None when the request is greedy, which ``min_p`` leaves
        alone (as in vLLM)."""
        if self.allowed:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[list(self.allowed)] = True
            logits.masked_fill_(~keep, -torch.inf)
        for words in self.bad_words:  # a word's last token, where the generation ends with the rest of it
            if len(words) == 1 or tuple(generated[-len(words) + 1 :]) == words[:-1]:
                logits[words[-1]] = -torch.inf
        if self.matcher is not None and not self.matcher.is_terminated():  # once terminated, vLLM masks nothing
            import xgrammar

            bitmask = xgrammar.allocate_token_bitmask(1, logits.shape[-1])
            self.matcher.fill_next_token_bitmask(bitmask)  # on the CPU: xgrammar applies it on the logits' device
            xgrammar.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask.to(logits.device, non_blocking=True))
        # below min_p times the likeliest token's probability, at the request's temperature
        if self.min_p and temperature:
            probs = torch.softmax(logits / temperature, dim=-1)
            logits.masked_fill_(probs < self.min_p * probs.max(), -torch.inf)

    def accept(self, token: int) -> None:
        """Advance the grammar past the token sampled; one it rejects fails the request (as in vLLM)."""
        if self.matcher is not None and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise InvalidRequestError(f"the structured output rejected the token sampled ({token})")


def _words(value: object) -> tuple[str, ...]:
    words = json.loads(value) if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise InvalidRequestError(f"{BAD_WORDS} must be a JSON list of non-empty strings, not {value!r:.80}")
    return tuple(dict.fromkeys(words))


# one compiler per tokenizer and vocabulary size, for the tokenizer's life: it caches the grammars compiled
_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _matcher(tokenizer, vocab_size: int, kind: str, value: str):
    import xgrammar

    compilers = _COMPILERS.setdefault(tokenizer, {})
    if vocab_size not in compilers:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        compilers[vocab_size] = xgrammar.GrammarCompiler(info)
    compiler = compilers[vocab_size]
    compile_ = {
        "json": compiler.compile_json_schema,
        "regex": compiler.compile_regex,
        "grammar": compiler.compile_grammar,
    }[kind]
    return xgrammar.GrammarMatcher(compile_(value))
