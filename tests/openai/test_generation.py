"""A generation without a deployment (hcache/openai/generation.py): stop strings in its pieces, and a
generation the server's stop ends, whose client is told why with the code of a request refused then."""

import asyncio
import json

import pytest

from hcache.openai.generation import Deployment, DeploymentError, Piece, until_stop
from hcache.openai.shutdown import SHUTTING_DOWN, SHUTTING_DOWN_CODE


async def _pieces(texts: list[str]):
    for i, text in enumerate(texts):
        yield Piece(text, "length" if i == len(texts) - 1 else None, 3, i + 1)


def _joined(texts: list[str], stops: list[str], include: bool = False) -> tuple[str, str]:
    async def run():
        pieces = [p async for p in until_stop(_pieces(texts), stops, include)]
        return "".join(p.text for p in pieces), pieces[-1].finish_reason

    return asyncio.run(run())


@pytest.mark.parametrize(("include", "text"), [(False, "Paris is "), (True, "Paris is the")])
def test_a_stop_string_ends_the_text_and_is_included_only_when_asked(include, text):
    assert _joined(["Paris ", "is t", "he capital", " of France"], ["the", "capital"], include) == (text, "stop")


def test_without_a_stop_string_met_the_text_is_whole():
    assert _joined(["Paris ", "is"], ["Berlin"], include=True) == ("Paris is", "length")


class _HungCall:
    """A streamed call that never replies until it is cancelled, as a long generation in flight."""

    def __init__(self):
        self.cancelled = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.cancelled.wait()
        raise asyncio.CancelledError

    def cancel(self) -> None:
        self.cancelled.set()


def test_a_generation_cut_at_the_end_of_the_grace_gets_the_shutting_down_code():
    """Once those ended by the stop got code ``null``, while those refused during it got ``shutting_down``."""

    async def cut() -> DeploymentError:
        deployment = Deployment("localhost:1")
        deployment._stub.GeneratorReplyStream = lambda request: _HungCall()
        reading = asyncio.ensure_future(anext(deployment.generate("hi", {})))
        await asyncio.sleep(0.05)
        deployment.end_all(SHUTTING_DOWN, SHUTTING_DOWN_CODE)
        with pytest.raises(DeploymentError) as ended:
            await reading
        await deployment.close()
        return ended.value

    error = asyncio.run(cut())
    assert (error.status, str(error), error.code) == (503, SHUTTING_DOWN, "shutting_down")
    body = json.loads(error.api_error().response().body)
    assert body["error"] == {"message": SHUTTING_DOWN, "type": "server_error", "param": None, "code": "shutting_down"}
