"""Stop strings in a generation's pieces (hcache/openai/generation.py), without a deployment."""

from __future__ import annotations

import asyncio

import pytest

from hcache.openai.generation import Piece, until_stop


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
