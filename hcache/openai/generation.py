"""Generation through a deployment's gRPC load balancer: every request is one streamed call, so that a stop
string or a client that goes away ends it at once (the call is cancelled, and the model server drops the
request: :mod:`hcache.mii.failures`), and a non-streamed answer is the streamed one joined."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

import grpc
from mii.constants import GRPC_MAX_MSG_SIZE
from mii.grpc_related.proto.modelresponse_pb2 import MultiStringRequest
from mii.grpc_related.proto.modelresponse_pb2_grpc import ModelResponseStub
from mii.utils import kwarg_dict_to_proto

from ..mii.gateway import http_status
from ..mii.reply_record import record_of
from .api_error import APIError


@dataclass(frozen=True)
class Piece:
    """One message of a generation: new text, and on the last one why it ended ("stop" or "length");
    ``hcache``: the request's restore record (:meth:`~hcache.restore.records.SequenceRecord.reply`), on every
    piece once the first message brought it."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    hcache: dict | None = None


class DeploymentError(Exception):
    """The deployment refused or failed a generation; ``status`` is the HTTP status its client gets, and
    ``code`` the error's code in OpenAI's shape (``shutting_down`` for a generation the server's stop ends,
    as for a request it refuses then)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code

    def api_error(self) -> APIError:
        return APIError(self.status, str(self), code=self.code)


class Deployment:
    """A deployment's load balancer, reached over one channel for the life of the server."""

    def __init__(self, address: str):
        options = [
            ("grpc.max_send_message_length", GRPC_MAX_MSG_SIZE),
            ("grpc.max_receive_message_length", GRPC_MAX_MSG_SIZE),
        ]
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = ModelResponseStub(self._channel)
        self._calls: set = set()
        self._ended: tuple[str, str] | None = None  # why end_all ended every call, and its code

    async def generate(self, prompt: str, options: dict) -> AsyncIterator[Piece]:
        """The pieces of ``prompt``'s generation with MII's generation ``options``. Leaving the iteration
        early cancels the call."""
        request = MultiStringRequest(request=[prompt], query_kwargs=kwarg_dict_to_proto({**options, "stream": True}))
        call, first, record = self._stub.GeneratorReplyStream(request), True, None
        self._calls.add(call)
        try:
            async for reply in call:
                if first:
                    first, record = False, record_of(reply)
                r = reply.response[0]
                reason = None if r.finish_reason == "none" else r.finish_reason
                yield Piece(r.response, reason, r.prompt_tokens, r.generated_tokens, record)
        except grpc.aio.AioRpcError as exc:
            raise DeploymentError(
                http_status(exc.code()), exc.details() or f"the deployment answered {exc.code().name}"
            ) from None
        except (
            asyncio.CancelledError
        ):  # the call's reading, cancelled by end_all (or the task's, by its client leaving)
            if self._ended is None:
                raise
            raise DeploymentError(503, *self._ended) from None
        finally:
            self._calls.discard(call)
            call.cancel()  # a no-op once the call has ended

    def end_all(self, why: str, code: str) -> None:
        """End every generation in flight: each raises :class:`DeploymentError` (503, ``why``, ``code``) to its
        reader, and the model server drops its request."""
        self._ended = (why, code)
        for call in list(self._calls):
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()


async def until_stop(pieces: AsyncIterator[Piece], stops: list[str], include: bool = False) -> AsyncIterator[Piece]:
    """``pieces`` ended at the first of ``stops`` (included if ``include``, vLLM's
    ``include_stop_str_in_output``), with finish reason "stop". Text that may be the start of a stop string is
    held back until it cannot be (as vLLM does: the last characters, up to the longest stop string's length
    less one)."""
    async with aclosing(pieces):
        if not stops:
            async for piece in pieces:
                yield piece
            return
        hold, held = max(map(len, stops)) - 1, ""
        async for piece in pieces:
            held += piece.text
            found = [(i, i + len(s) if include else i) for i, s in ((held.find(s), s) for s in stops) if i >= 0]
            if found:
                yield replace(piece, text=held[: min(found)[1]], finish_reason="stop")
                return
            if piece.finish_reason is not None:
                yield replace(piece, text=held)
                return
            ready = len(held) - hold
            if ready > 0:
                yield replace(piece, text=held[:ready])
                held = held[ready:]
