"""OpenAI's request and response schema, as far as hcache serves it, with vLLM's extensions. Every field OpenAI
or vLLM documents that would change a reply is honoured, or refused by :func:`unsupported` when set to
anything but its default, never silently ignored; those that change nothing here (``user``, vLLM's
``priority``, ``request_id``) are taken. A field neither documents is ignored (OpenAI's clients add new ones
faster than servers learn them)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # vLLM's extension; None, 0 or -1: off, whatever the temperature
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = None  # vLLM's name for a per-request namespace
    # vLLM's sampling extensions (its SamplingParams), which clients such as its benchmarks send
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    repetition_penalty: Optional[float] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    allowed_token_ids: Optional[list[int]] = Field(None, min_length=1)
    bad_words: Optional[list[str]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)  # the prompt's last tokens; -1: the context's
    # structured output (hcache.openai.structured): vLLM's, its older guided_* fields, and OpenAI's
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None

    @property
    def stops(self) -> list[str]:
        """The stop strings; an empty one would stop before any text, and stops nothing (as in vLLM)."""
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]

    @property
    def new_tokens(self) -> Optional[int]:
        return self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The message's text: a list of parts must be text parts only (this server runs text models)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported: only text")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name; it wins over max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None

    @property
    def new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = None


# OpenAI's and vLLM's fields this server cannot honour, with the values that ask for nothing: anything else is
# refused. The chat's apply to chats only (vLLM's completions have no such fields).
_REFUSED = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None,),
    "spaces_between_special_tokens": (True,),
    "truncation_side": (None, "left"),
    "watermarking": (None,),
    "repetition_detection": (None,),
    "prompt_embeds": (None,),
    "return_token_ids": (None, False),
    "return_token_offsets": (False,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "thinking_token_budget": (None,),
}
_REFUSED_IN_CHATS = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
}


def unsupported(request: _Request) -> Optional[tuple[str, str]]:
    """``(param, reason)`` for the first documented field set to something this server cannot do."""
    refused = {**_REFUSED, **(_REFUSED_IN_CHATS if isinstance(request, ChatCompletionRequest) else {})}
    extra = request.model_extra or {}
    for name, defaults in refused.items():
        if name in extra and not any(_same(extra[name], d) for d in defaults):
            return name, f"{name} is not supported (only {' or '.join(map(json.dumps, defaults))})"
    if request.n != 1:
        return "n", f"n must be 1 (one choice per request), not {request.n}"
    if request.stream_options is not None and not request.stream:
        return "stream_options", "stream_options is only allowed with stream=true"
    if request.seed is not None and request.temperature != 0:
        return "seed", "seed is only supported with temperature=0: the engine samples from one shared generator"
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            return name, f"{name} is not supported"
    if request.repetition_penalty not in (None, 1.0):
        return "repetition_penalty", "repetition_penalty is not supported (only 1.0, no penalty)"
    if request.stop_token_ids and min(request.stop_token_ids) < 0:
        return "stop_token_ids", "stop_token_ids must be non-negative token ids"
    if request.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    if isinstance(request, ChatCompletionRequest):
        if request.logprobs or request.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if request.tools:
            return "tools", "tools are not supported"
        if request.tool_choice not in (None, "none", "auto"):
            return (
                "tool_choice",
                f"tool_choice {json.dumps(request.tool_choice):.80} needs tools, which are not supported",
            )
    if isinstance(request, CompletionRequest):
        if request.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if request.suffix:
            return "suffix", "suffix is not supported"
        if request.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
    return None


def _same(value: Any, default: Any) -> bool:
    """JSON's equality: 1 is 1.0, but neither is true."""
    return value == default and isinstance(value, bool) == isinstance(default, bool)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class HCacheReport(BaseModel):
    """The ``hcache`` object beside ``usage`` (OpenAI clients ignore it): the prompt's tokens restored, by
    tier, and why stored tokens were computed instead (docs/misses.md)."""

    restored_tokens: int
    tier_tokens: dict[str, int]
    miss_tokens: dict[str, int]
    plan: str
    lossy: bool


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: Optional[str] = None
    usage: Optional[Usage] = None
    hcache: Optional[HCacheReport] = None  # on a whole response, and on a stream's chunk with the finish reason


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: Optional[str] = None


class _Choice(BaseModel):
    index: int = 0
    logprobs: None = None
    finish_reason: Optional[str] = None  # None until the last piece of a stream


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(_Choice):
    delta: Delta


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(_Choice):
    text: str


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hcache"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
