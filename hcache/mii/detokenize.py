"""The text of generated tokens, as clients expect it: special tokens (the end-of-turn token that ends a
chat reply) never appear, and a streamed reply joined equals the reply decoded whole.

MII 0.3 decodes with special tokens, and streams by decoding a window of recent tokens and removing the
decoded previous window from it, which a tokenizer's clean-up of spaces can break. With
:mod:`hcache.mii.patches` installed, its tokenizer decodes without special tokens, and a stream is decoded by
the tokenizers library's own incremental decoder (``DecodeStream``), which holds back bytes until they form
whole characters."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

SKIP_SPECIAL_TOKENS = "skip_special_tokens"  # vLLM's option: false keeps special tokens in a stream's text
STOPPED = -1  # a stream's last token, in place of the stop token that ended it: no text (:mod:`.stopping`)


class StreamDecoders:
    """In place of MII's ``ReadableStream``: one incremental decoder per thread (MII's server serves one
    streamed call per thread at a time, and its results come in order)."""

    def __init__(self, tokenizer) -> None:  # MII's tokenizer wrapper
        self.tokenizer = tokenizer.tokenizer
        self.stream_state: dict[int, object] = {}
        self.skip_special_tokens: dict[int, bool] = {}  # each thread's request's option, set as it is made

    def decode(self, thread_id: int, token_ids: list[int]) -> str:
        skip = self.skip_special_tokens.get(thread_id, True)
        stream = self.stream_state.setdefault(thread_id, DecodeStream(skip_special_tokens=skip))
        steps = (stream.step(self.tokenizer._tokenizer, int(t)) for t in token_ids if int(t) != STOPPED)
        return "".join(filter(None, steps))

    def flush_state(self, thread_id: int) -> None:
        self.stream_state.pop(thread_id, None)


def without_special_tokens(_decode):
    """``HFTokenizer.decode``, as MII's tokenizer decodes a whole reply."""
    return lambda self, tokens: self.tokenizer.decode(tokens, skip_special_tokens=True)


def incremental(_readable_stream):
    """``ragged_batching.ReadableStream``, which MII makes one of per server pipeline."""
    return StreamDecoders
