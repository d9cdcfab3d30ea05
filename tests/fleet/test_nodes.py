"""The fleet's client, ``chat``, against canned answers (no server): the session header only when there is a
session, and the tokens restored by source from the answer's ``hcache`` object, whole or streamed."""

import json
from email.message import Message

import pytest

from hcache.fleet import nodes

REPORT = {"restored_tokens": 192, "tier_tokens": {"gpu_cache": 128, "redis": 64}, "miss_tokens": {}}


class _Answer:
    def __init__(self, body: bytes, node: str | None):
        self.body, self.headers = body, Message()  # as an HTTP answer's: None for a header it lacks
        if node is not None:
            self.headers[nodes.NODE_HEADER] = node

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self) -> bytes:
        return self.body

    def __iter__(self):
        return iter(self.body.splitlines(keepends=True))


def _events(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _delta(content: str, report: dict | None = None, finish: str | None = None) -> dict:
    return {"choices": [{"delta": {"content": content}, "finish_reason": finish}], "hcache": report}


@pytest.fixture
def sent(monkeypatch):
    """The requests ``chat`` makes; each is answered by the next of ``sent.answers``."""
    requests, answers = [], []

    def urlopen(request, timeout):
        requests.append(request)
        return answers.pop(0)

    monkeypatch.setattr(nodes.urllib.request, "urlopen", urlopen)
    return type("Sent", (), {"requests": requests, "answers": answers})


@pytest.mark.parametrize("session", ["conversation-1", None])
def test_a_streamed_chat_reads_the_text_the_node_and_the_restore_report(sent, session):
    stream = _events(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, _delta("Par"), _delta("is", REPORT, "stop")
    )
    sent.answers.append(_Answer(stream, "node1"))
    reply = nodes.chat("http://b/v1", "m", [{"role": "user", "content": "Capital?"}], session, 4, stream=True)
    assert (reply.text, reply.node, reply.restored) == ("Paris", "node1", {"gpu_cache": 128, "redis": 64})
    assert len(reply.token_s) == 2 and reply.ttft_s == reply.token_s[0]
    [request] = sent.requests
    assert request.full_url == "http://b/v1/chat/completions"
    assert request.get_header(nodes.SESSION_HEADER.capitalize()) == session  # urllib capitalizes header names
    assert "cache_salt" not in json.loads(request.data)


def test_a_whole_chat_with_a_cache_salt_and_no_report_straight_from_a_node(sent):
    body = {"choices": [{"message": {"content": "Paris"}}]}
    sent.answers.append(_Answer(json.dumps(body).encode(), None))
    reply = nodes.chat("http://n/v1", "m", [], None, 4, cache_salt="fresh")
    assert (reply.text, reply.node, reply.restored) == ("Paris", None, None)
    assert json.loads(sent.requests[0].data)["cache_salt"] == "fresh"
