"""What a generation request to an hcache deployment may hold. The REST gateway refuses a bad request at the
door (HTTP 400 with the reason); the model server checks every request again before it enters MII's batching
loop, so a client that reaches it some other way (MII's gRPC client, the OpenAI-compatible server) gets an
error for its own request and the loop goes on serving the others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..errors import InvalidRequestError
from ..storage.chunk_key import check_namespace
from . import constraints
from .detokenize import SKIP_SPECIAL_TOKENS, StreamDecoders
from .stopping import INCLUDE_STOP, STOP_TOKEN_IDS, parse_stop_token_ids

CACHE_SALT = "cache_salt"  # the per-request namespace, under vLLM's name
# taken off before MII sees the options
_HCACHE_FIELDS = frozenset((CACHE_SALT, STOP_TOKEN_IDS, SKIP_SPECIAL_TOKENS, INCLUDE_STOP, *constraints.FIELDS))
_STREAM_ONLY = {SKIP_SPECIAL_TOKENS: True, INCLUDE_STOP: False}  # hcache's text options of streams, and defaults
# Generation options a request may set: MII's, less the one MII fills in itself.
_MII_FIELDS = frozenset(
    (
        "max_length",
        "max_new_tokens",
        "min_new_tokens",
        "stream",
        "ignore_eos",
        "return_full_text",
        "do_sample",
        "top_p",
        "top_k",
        "temperature",
        "stop",
    )
)
_INTEGER_FIELDS = ("max_length", "max_new_tokens", "min_new_tokens", "top_k")
_BOOL_FIELDS = ("stream", "ignore_eos", "return_full_text", "do_sample")


def check_generate_options(
    options: dict[str, Any], prompt_tokens: int, max_length: int
) -> tuple[dict[str, Any], Hcache]:
    """MII's generation options for one prompt of ``prompt_tokens`` tokens on a deployment whose context holds
    ``max_length``, and hcache's options of the request; or an :class:`InvalidRequestError` saying what is
    wrong.

    ``max_new_tokens`` (an integer of at least 1) is optional: without it MII generates up to the context's
    end. The prompt plus ``max_new_tokens`` must fit in the context (or in ``max_length``, if the request
    sets a smaller one)."""
    from mii.config import GenerateParamsConfig

    unknown = sorted(set(options) - _MII_FIELDS - _HCACHE_FIELDS)
    if unknown:
        raise InvalidRequestError(
            f"unknown field(s) {', '.join(unknown)}; a request may set {', '.join(sorted(_MII_FIELDS | _HCACHE_FIELDS))}"
        )
    options = dict(options)
    text = {name: options.pop(name, default) for name, default in _STREAM_ONLY.items()}
    for name, value in text.items():
        if type(value) is not bool:
            raise InvalidRequestError(f"{name} must be true or false, not {value!r:.40}")
        if value != _STREAM_ONLY[name] and not options.get("stream"):
            raise InvalidRequestError(f"{name}={str(value).lower()} is only supported with stream=true")
    hcache = Hcache(
        namespace=check_namespace(options.pop(CACHE_SALT, None), CACHE_SALT),
        stop_ids=parse_stop_token_ids(options.pop(STOP_TOKEN_IDS)) if STOP_TOKEN_IDS in options else (),
        skip_special_tokens=text[SKIP_SPECIAL_TOKENS],
        include_stop=text[INCLUDE_STOP],
        constraints=constraints.Constraints.take(options),
    )
    for name in _INTEGER_FIELDS:
        if name in options and (type(options[name]) is not int):
            raise InvalidRequestError(f"{name} must be an integer, not {options[name]!r}")
    for name in _BOOL_FIELDS:
        if name in options and type(options[name]) is not bool:
            raise InvalidRequestError(f"{name} must be true or false, not {options[name]!r}")
    if prompt_tokens < 1:
        raise InvalidRequestError("empty prompt: it has no tokens to process")
    limit = options.get("max_length", max_length)
    if not 1 <= limit <= max_length:
        raise InvalidRequestError(f"max_length must be between 1 and the context length {max_length}, not {limit}")
    new_tokens = options.get("max_new_tokens", 1)
    if new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be at least 1, not {new_tokens}")
    least = options.get("min_new_tokens", 0)
    if not 0 <= least <= options.get("max_new_tokens", limit - prompt_tokens):
        raise InvalidRequestError(f"min_new_tokens must be between 0 and max_new_tokens, not {least}")
    if prompt_tokens + new_tokens > limit:
        raise InvalidRequestError(
            f"a prompt of {prompt_tokens} tokens plus max_new_tokens={new_tokens} exceeds the context length {limit}"
        )
    try:
        GenerateParamsConfig(prompt_length=prompt_tokens, **{"max_length": max_length, **options})
    except ValidationError as exc:
        raise InvalidRequestError(f"bad generation options: {exc}") from exc
    return options, hcache


@dataclass(frozen=True)
class Hcache:
    """hcache's options of a request, beside MII's: its namespace, its stop token ids and whether the text of
    the one that ends it is sent (:mod:`.stopping`), whether its text leaves out special tokens
    (:mod:`.detokenize`), its constraints on each next token (:mod:`.constraints`)."""

    namespace: str | None
    stop_ids: tuple[int, ...]
    skip_special_tokens: bool
    include_stop: bool
    constraints: constraints.Constraints


def check_rest_body(body: object, tokenize, max_length: int) -> None:
    """A body for MII's REST gateway: ``{"prompts": [str, ...], <generation options>}``. ``tokenize`` counts
    a prompt's tokens as the model server will."""
    if not isinstance(body, dict):
        raise InvalidRequestError('the body must be a JSON object such as {"prompts": ["..."], "max_new_tokens": 32}')
    if "prompts" not in body:
        raise InvalidRequestError('missing field "prompts": a list of strings')
    prompts, options = body["prompts"], {k: v for k, v in body.items() if k != "prompts"}
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise InvalidRequestError(f'"prompts" must be a non-empty list of strings, not {prompts!r:.80}')
    for name, value in options.items():
        if type(value) not in (str, int, float, bool):  # what MII's gRPC request can carry
            raise InvalidRequestError(f"{name} must be a string, number or boolean, not {value!r:.80}")
    for prompt in prompts:
        check_generate_options(options, len(tokenize(prompt)), max_length)


# ---- in MII's batching loop (installed by hcache.mii.patches) ---------------------------------------------
# A request's namespace (``cache_salt``) rides on MII's request object and, to the other tensor-parallel
# ranks, on MII's broadcast of the batch (MII ignores the extra key).
def checking_requests(make):
    """``RaggedBatchBase.make_request``: each request checked as MII makes it, before it enters the batching
    loop (a bad one raises in its caller, and the loop never sees it)."""

    def make_request(self, tid, uid, input_tokens, kwargs):
        options, hcache = check_generate_options(kwargs, len(input_tokens), self.max_length)
        made = hcache.constraints.for_model(self.tokenizer.tokenizer, self.vocab_size) if hcache.constraints else None
        if isinstance(getattr(self, "readable_stream", None), StreamDecoders):  # made in the thread that reads
            self.readable_stream.skip_special_tokens[tid] = hcache.skip_special_tokens
        request = make(self, tid, uid, input_tokens, options)
        request.hcache_namespace, request.hcache_stop_ids = hcache.namespace, hcache.stop_ids
        request.hcache_constraints, request.hcache_include_stop = made, hcache.include_stop
        return request

    return make_request


def opening_in_namespaces(put):
    """``RaggedBatchBase.put``: each new sequence opened in its request's namespace; first, requests still
    waiting in MII's buffer start reading their stored chunks into the host pool (look-ahead prefetch),
    once each."""

    def put_in_namespaces(self, uids, tokenized_input):
        engine = self.inference_engine
        for r in self.buffer:
            if not r.is_flush_request and r.seq_length == 0 and not getattr(r, "hcache_prefetched", False):
                engine.prefetch(r.prompt_tokens.tolist(), getattr(r, "hcache_namespace", None))
                r.hcache_prefetched = True
        for r in self.scheduled_requests.requests_to_run:
            # not open: its first put, or its first again after MII preempted or hcache retried it
            if getattr(r, "hcache_namespace", None) is not None and r.uid in uids and not engine.is_open(r.uid):
                engine.open(r.uid, namespace=r.hcache_namespace)
        return put(self, uids, tokenized_input)

    return put_in_namespaces


def sending_namespace(to_msg):
    """``Request.to_msg_dict``, what rank 0 broadcasts of a request."""
    return lambda self: {**to_msg(self), CACHE_SALT: getattr(self, "hcache_namespace", None)}


def receiving_namespace(from_msg):
    """``RequestMsg.from_msg_dict``, what the other ranks make of it."""

    def msg_from_dict(msg):
        request = from_msg(msg)
        request.hcache_namespace = msg.get(CACHE_SALT)
        return request

    return staticmethod(msg_from_dict)
