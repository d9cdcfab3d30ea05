"""The OpenAI-compatible HTTP API of an hcache deployment (FastAPI), answering as ``vllm serve`` does.

A request is checked whole before anything is sent: the model, the fields this server cannot honour, the
chat template, the context length; then the first piece of its generation is awaited, so that a request
the deployment refuses is answered with its error and status, never with a stream that then breaks. A
failure during a stream is sent as an error event, then ``[DONE]``. Errors have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``): 400 for a bad request, 404 for an unknown model
or path, 503 while the deployment cannot be reached, 500 only for a fault of the server."""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import InvalidRequestError
from ..mii.constraints import ALLOWED_TOKEN_IDS, BAD_WORDS, MIN_P, STRUCTURED
from ..mii.detokenize import SKIP_SPECIAL_TOKENS
from ..mii.stopping import INCLUDE_STOP, STOP_TOKEN_IDS
from ..storage.chunk_key import check_namespace
from ..version import __version__
from .api_error import APIError
from .generation import Deployment, DeploymentError, Piece, until_stop
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    HCacheReport,
    Model,
    ModelList,
    Usage,
    response_id,
    unsupported,
)
from .structured import structured_output

log = logging.getLogger(__name__)


@dataclass
class Health:
    """``/health`` answers 503 while the deployment starts and once the node drains (set by signals, see
    :mod:`hcache.openai.__main__`)."""

    ready: threading.Event = field(default_factory=threading.Event)
    draining: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Served:
    """What the server serves: the model's names (the first is the one listed), its tokenizer (the chat
    template; prompts counted as the model server counts them) and the longest sequence it takes."""

    names: list[str]
    tokenizer: object
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(served: Served, load_balancer: str, health: Health) -> FastAPI:
    """The app, reaching the deployment at ``load_balancer`` (host:port) over a channel it opens in its own
    event loop."""
    deployment: Deployment

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal deployment
        deployment = app.state.deployment = Deployment(load_balancer)
        yield
        await deployment.close()

    app = FastAPI(title="hcache", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return APIError(
                400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
            ).response()
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return APIError(400, message, param=where or None).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def fault(_: Request, exc: Exception) -> JSONResponse:
        log.exception("a request failed inside the OpenAI server")
        return APIError(500, f"internal server error: {type(exc).__name__}").response()

    @app.get("/health")
    async def get_health() -> JSONResponse:
        if health.draining.is_set() or not health.ready.is_set():
            return JSONResponse({"status": "draining" if health.draining.is_set() else "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:  # vLLM's server answers it, and its benchmarks ask
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[Model(id=served.names[0], created=served.created, max_model_len=served.max_model_len)])

    def check_model(name: str) -> None:
        if name not in served.names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, http: Request):
        check_model(request.model)  # first: an unknown model is a 404 whatever else is wrong
        try:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            prompt = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a part that is not text, or a template that refuses the conversation
            raise APIError(400, f"messages: {exc}", param="messages") from None
        return await _answer(request, prompt, "messages", _ChatFormat(request.model), http)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        check_model(request.model)
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise APIError(
                400, "prompt must be one string: token ids and lists of prompts are not supported", param="prompt"
            )
        return await _answer(
            request, prompt, "prompt", _CompletionFormat(request.model, prompt if request.echo else ""), http
        )

    async def _answer(
        request: ChatCompletionRequest | CompletionRequest, prompt: str, prompt_param: str, form: _Format, http: Request
    ):
        problem = unsupported(request)
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])
        prompt = _truncated(prompt, request.truncate_prompt_tokens, served)
        options = _options(request, len(served.tokenizer.encode(prompt)), served.max_model_len, prompt_param)
        generated = deployment.generate(prompt, options)
        pieces = until_stop(generated, request.stops, request.include_stop_str_in_output)
        first = await _first(pieces)
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return StreamingResponse(_events(first, pieces, form, include_usage), media_type="text/event-stream")
        try:
            return form.whole(*await _joined(first, pieces, http))
        except DeploymentError as exc:
            raise exc.api_error() from None
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    return app


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def _joined(first: Piece, pieces: AsyncIterator[Piece], http: Request) -> tuple[str, Piece]:
    """The generation's text and last piece; if the client goes away first, the generation is cancelled (a
    streamed response notices by itself; a whole one only by listening, as vLLM's does)."""

    async def join() -> tuple[str, Piece]:
        text, last = first.text, first
        async for piece in pieces:
            text, last = text + piece.text, piece
        return text, last

    async def disconnect() -> None:  # the body is read: the next message is the client going away
        while (await http.receive())["type"] != "http.disconnect":
            pass

    async with aclosing(pieces):
        joining, leaving = asyncio.ensure_future(join()), asyncio.ensure_future(disconnect())
        try:
            await asyncio.wait({joining, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (leaving, joining):
                task.cancel()
            await asyncio.gather(leaving, joining, return_exceptions=True)
        if joining.cancelled():
            raise ClientGone()
        return joining.result()


async def _first(pieces: AsyncIterator[Piece]) -> Piece:
    try:
        return await anext(pieces)
    except DeploymentError as exc:
        await pieces.aclose()
        raise exc.api_error() from None


def _truncated(prompt: str, keep: int | None, served: Served) -> str:
    """``prompt`` cut to its last ``keep`` tokens (-1: the context's length), as vLLM's
    ``truncate_prompt_tokens`` cuts it; the model server takes text, so the tokens kept are decoded."""
    if keep is None:
        return prompt
    tokens = served.tokenizer.encode(prompt)
    keep = served.max_model_len if keep == -1 else keep
    return served.tokenizer.decode(tokens[-keep:]) if 0 < keep < len(tokens) else prompt


def _options(request, prompt_tokens: int, max_model_len: int, prompt_param: str) -> dict:
    """MII's generation options for ``request``, whose prompt has ``prompt_tokens`` tokens. Without
    ``max_tokens`` a chat generates to the end of the context, as vLLM's does."""
    if prompt_tokens < 1:
        raise APIError(400, "the prompt is empty", param=prompt_param)
    room = max_model_len - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_tokens} tokens, which leaves none to generate.",
            param=prompt_param,
        )
    new_tokens = request.new_tokens if request.new_tokens is not None else room
    param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None else "max_tokens"
    if new_tokens < 1:
        raise APIError(400, f"{param} must be at least 1, not {new_tokens}", param=param)
    if new_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + new_tokens} tokens ({prompt_tokens} in the prompt, {new_tokens} for the "
            f"completion). Please reduce the prompt or {param}.",
            param=param,
        )
    if request.min_tokens > new_tokens:
        raise APIError(
            400, f"min_tokens ({request.min_tokens}) must be at most {param} ({new_tokens})", param="min_tokens"
        )
    options: dict = {"max_new_tokens": new_tokens}
    if request.min_tokens:
        options["min_new_tokens"] = request.min_tokens
    if request.ignore_eos:
        options["ignore_eos"] = True
    if request.stop_token_ids:
        options[STOP_TOKEN_IDS] = ",".join(map(str, request.stop_token_ids))
    temperature = 1.0 if request.temperature is None else request.temperature
    if temperature == 0 or request.top_k == 1:  # top_k=1 samples the likeliest token: greedy, without sampling's cost
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=temperature, top_p=1.0 if request.top_p is None else request.top_p)
        if request.top_k not in (None, 0, -1):  # below -1: refused by the protocol, whatever the temperature
            options["top_k"] = request.top_k
    options.update(_constraints(request))
    if request.cache_salt is not None:
        try:
            options["cache_salt"] = check_namespace(request.cache_salt, "cache_salt")
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="cache_salt") from None
    return options


def _constraints(request) -> dict:
    """The model server's options for vLLM's constraints on each token and on the text (hcache.mii)."""
    options: dict = {}
    if request.min_p:
        options[MIN_P] = request.min_p
    if request.allowed_token_ids:
        options[ALLOWED_TOKEN_IDS] = ",".join(map(str, request.allowed_token_ids))
    if request.bad_words:
        options[BAD_WORDS] = json.dumps(request.bad_words)
    if (structured := structured_output(request)) is not None:
        options[STRUCTURED] = structured
    if not request.skip_special_tokens:
        options[SKIP_SPECIAL_TOKENS] = False
    if request.include_stop_str_in_output:
        options[INCLUDE_STOP] = True
    return options


class _Format(abc.ABC):
    """How one endpoint writes a generation: as one object, or as stream chunks."""

    id_prefix: str

    def __init__(self, model: str, prefix: str = ""):
        self.model, self.prefix, self.id = model, prefix, response_id(self.id_prefix)

    def usage(self, last: Piece) -> Usage:
        return Usage(
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            total_tokens=last.prompt_tokens + last.completion_tokens,
        )

    @staticmethod
    def report(last: Piece) -> HCacheReport | None:
        return HCacheReport(**last.hcache) if last.hcache is not None else None

    @abc.abstractmethod
    def whole(self, text: str, last: Piece) -> ChatCompletion | Completion: ...

    @abc.abstractmethod
    def opening(self) -> ChatCompletionChunk | Completion | None:
        """The stream's first chunk, before any text: a chat's role, a completion's echoed prompt."""

    @abc.abstractmethod
    def chunk(
        self, text: str, last: Piece | None = None, usage: Usage | None = None
    ) -> ChatCompletionChunk | Completion:
        """A chunk of ``text`` (the last, with ``last``'s finish reason and restore report), or with
        ``usage``, the chunk of usage alone."""


class _ChatFormat(_Format):
    id_prefix = "chatcmpl"

    def whole(self, text: str, last: Piece) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=last.finish_reason)
        return ChatCompletion(
            id=self.id, model=self.model, choices=[choice], usage=self.usage(last), hcache=self.report(last)
        )

    def opening(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, model=self.model, choices=[ChatChunkChoice(delta=Delta(role="assistant", content=""))]
        )

    def chunk(self, text: str, last: Piece | None = None, usage: Usage | None = None) -> ChatCompletionChunk:
        reason, report = (last.finish_reason, self.report(last)) if last is not None else (None, None)
        choices = [] if usage is not None else [ChatChunkChoice(delta=Delta(content=text), finish_reason=reason)]
        return ChatCompletionChunk(id=self.id, model=self.model, choices=choices, usage=usage, hcache=report)


class _CompletionFormat(_Format):
    id_prefix = "cmpl"

    def whole(self, text: str, last: Piece) -> Completion:
        choice = CompletionChoice(text=self.prefix + text, finish_reason=last.finish_reason)
        return Completion(
            id=self.id, model=self.model, choices=[choice], usage=self.usage(last), hcache=self.report(last)
        )

    def opening(self) -> Completion | None:
        return self.chunk(self.prefix) if self.prefix else None

    def chunk(self, text: str, last: Piece | None = None, usage: Usage | None = None) -> Completion:
        reason, report = (last.finish_reason, self.report(last)) if last is not None else (None, None)
        choices = [] if usage is not None else [CompletionChoice(text=text, finish_reason=reason)]
        return Completion(id=self.id, model=self.model, choices=choices, usage=usage, hcache=report)


async def _events(first: Piece, pieces: AsyncIterator[Piece], form: _Format, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a first chunk (a chat's role), a chunk per piece with text, the finish reason,
    usage if asked for, then ``[DONE]``; a failure midway is sent as an error event before ``[DONE]``."""

    def event(obj) -> str:
        return f"data: {obj.model_dump_json()}\n\n"

    async with aclosing(pieces):
        opening = form.opening()
        if opening is not None:
            yield event(opening)
        piece = first
        try:
            while True:
                if piece.text or piece.finish_reason is not None:
                    yield event(form.chunk(piece.text, piece if piece.finish_reason is not None else None))
                if piece.finish_reason is not None:
                    break
                piece = await anext(pieces)
            if include_usage:
                yield event(form.chunk("", usage=form.usage(piece)))
        except DeploymentError as exc:
            error = exc.api_error()
            yield f"data: {error.response().body.decode()}\n\n"
        except StopAsyncIteration:  # the deployment ended the stream without a finish reason
            yield f"data: {APIError(500, 'the deployment ended the generation without finishing it').response().body.decode()}\n\n"
        yield "data: [DONE]\n\n"
