"""``python -m hcache.mii.openai_server <MII's OpenAI server arguments>``: MII's OpenAI-compatible server, whose
completion and chat requests also take ``cache_salt`` (vLLM's name for a per-request namespace). It is
checked with the request (HTTP 400 if bad) and passed on to the deployment with the generation options.
A request the deployment fails is answered with an OpenAI error object, the deployment's message and
:func:`~hcache.mii.failures.http_status` (MII's answers a bare HTTP 500). After SIGUSR1 (a drain, sent by
``hcache serve`` when it is told to stop) ``GET /health`` answers 503, so that a load balancer's health check
takes the node out of rotation while it still serves what it was sent. Started with ``HCACHE_OPENAI_STARTING``
set (by ``hcache serve``, while its deployment starts), it answers 503 until SIGUSR2: then its deployment is up."""
from __future__ import annotations

import os
import runpy
import signal
import threading
from contextvars import ContextVar
from typing import Optional

import grpc
import uvicorn
from pydantic import Field, field_validator

from ..storage.chunk_key import check_namespace
from .backend import STARTING_ENV
from .failures import http_status
from .requests import CACHE_SALT

DRAIN_SIGNAL, READY_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
_draining, _ready = threading.Event(), threading.Event()
_salt: ContextVar[Optional[str]] = ContextVar(CACHE_SALT, default=None)  # the salt of the request being served


def _with_cache_salt(request_model: type) -> type:
    """``request_model`` with an optional ``cache_salt``; validating a request records its salt for the
    handler that runs next in the same task."""

    class WithCacheSalt(request_model):
        cache_salt: Optional[str] = Field(None, validate_default=True)  # so a request without one clears it

        @field_validator(CACHE_SALT)
        @classmethod
        def _record(cls, salt: Optional[str]) -> Optional[str]:
            _salt.set(check_namespace(salt, CACHE_SALT))
            return salt

    WithCacheSalt.__name__ = request_model.__name__
    return WithCacheSalt


def main() -> None:
    import mii.utils
    from mii.entrypoints import data_models

    data_models.ChatCompletionRequest = _with_cache_salt(data_models.ChatCompletionRequest)
    data_models.CompletionRequest = _with_cache_salt(data_models.CompletionRequest)
    to_proto = mii.utils.kwarg_dict_to_proto

    def kwarg_dict_to_proto(options: dict):
        salt = _salt.get()
        return to_proto(options if salt is None else {**options, CACHE_SALT: salt})

    mii.utils.kwarg_dict_to_proto = kwarg_dict_to_proto
    run = uvicorn.run

    def run_answering_errors(app, **kwargs):
        app.add_exception_handler(grpc.RpcError, _answer_error)
        app.middleware("http")(_health_by_state)
        run(app, **kwargs)

    signal.signal(DRAIN_SIGNAL, lambda *_: _draining.set())
    signal.signal(READY_SIGNAL, lambda *_: _ready.set())
    if not os.environ.pop(STARTING_ENV, None):
        _ready.set()

    uvicorn.run = run_answering_errors
    # MII's server reads these names when its module runs, so it gets the versions above.
    runpy.run_module("mii.entrypoints.openai_api_server", run_name="__main__", alter_sys=True)


async def _health_by_state(request, call_next):
    if request.url.path == "/health" and (_draining.is_set() or not _ready.is_set()):
        from fastapi.responses import JSONResponse

        return JSONResponse({"status": "draining" if _draining.is_set() else "starting"}, status_code=503)
    return await call_next(request)


async def _answer_error(request, exc):
    from fastapi.responses import JSONResponse

    status = http_status(exc.code())
    return JSONResponse({"object": "error", "message": exc.details(), "code": status}, status_code=status)


if __name__ == "__main__":
    main()
