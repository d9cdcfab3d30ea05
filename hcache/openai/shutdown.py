"""How the OpenAI server stops on SIGTERM without dropping a connection: new requests are answered 503 in
OpenAI's error shape with ``Connection: close`` at once (a kept-alive connection is closed after that
answer, not under a client's next request); requests in flight finish, for up to the grace; those still
running then end with an error, an error event and ``[DONE]`` when streamed or a 503 when not; and only
then does uvicorn stop listening. An idle server stops at once."""

from __future__ import annotations

import asyncio

from .api_error import APIError

SHUTTING_DOWN = "the server is shutting down; send the request again (to another node)"
SHUTTING_DOWN_CODE = "shutting_down"  # the code of a request refused or ended by the stop alike


class InFlight:
    """ASGI middleware: counts the HTTP requests being answered and, once :meth:`refuse` is called, answers
    every new one but ``/health`` with a 503 and closes its connection."""

    def __init__(self, app) -> None:
        self.app, self.count, self.refusing = app, 0, False
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.refusing and scope["path"] != "/health":
            refusal = APIError(503, SHUTTING_DOWN, code=SHUTTING_DOWN_CODE).response()
            refusal.headers["connection"] = "close"
            return await refusal(scope, receive, send)
        self.count += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    def refuse(self) -> None:
        self.refusing = True

    async def idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for no request in flight; whether there is none."""
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        return self.count == 0


async def shut_down(server, in_flight: InFlight, deployment, grace_s: float, finish_s: float) -> None:
    """Refuse new requests, give those in flight ``grace_s``, end the rest (their handlers answer the error
    and have ``finish_s`` to send it), then stop ``server`` (uvicorn's)."""
    in_flight.refuse()
    if not await in_flight.idle(grace_s):
        deployment.end_all(SHUTTING_DOWN, SHUTTING_DOWN_CODE)
        await in_flight.idle(finish_s)
    server.should_exit = True
