"""``python -m hcache.mii.openai_server <MII's OpenAI server arguments>``: MII's OpenAI-compatible server, whose
completion and chat requests also take ``cache_salt`` (vLLM's name for a per-request namespace). It is
checked with the request (HTTP 400 if bad) and passed on to the deployment with the generation options."""
from __future__ import annotations

import runpy
from contextvars import ContextVar
from typing import Optional

from pydantic import Field, field_validator

from .requests import CACHE_SALT, check_namespace

_salt: ContextVar[Optional[str]] = ContextVar(CACHE_SALT, default=None)  # the salt of the request being served


def _with_cache_salt(request_model: type) -> type:
    """``request_model`` with an optional ``cache_salt``; validating a request records its salt for the
    handler that runs next in the same task."""

    class WithCacheSalt(request_model):
        cache_salt: Optional[str] = Field(None, validate_default=True)  # so a request without one clears it

        @field_validator(CACHE_SALT)
        @classmethod
        def _record(cls, salt: Optional[str]) -> Optional[str]:
            _salt.set(check_namespace(salt))
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
    # MII's server reads these names when its module runs, so it gets the versions above.
    runpy.run_module("mii.entrypoints.openai_api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
