"""``hcache serve --openai-port`` driven by the official ``openai`` client, as users drive it: one real
deployment (SmolLM2 on the reference engine) for the module, every behaviour streamed and not.

The deployment runs with a fault planted in its engine (``tests/support/fault_injection``): a batch holding the
token " candidate" raises. Greedy, the model continues ``FAULT_PROMPT`` with " most likely candidate", so
that request fails midway through its stream (when " candidate" is fed back), and no other request here
meets the token."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from transformers import AutoTokenizer

import hcache
from hcache.machine import process_tree
from hcache.machine.ports import free_port as _free_port
from hcache.model.loader import model_dir as resolve_model_dir
from hcache.restore.records import SequenceRecord
from support import FAULT_DIR, REPO

pytestmark = pytest.mark.slow

MODEL = "smollm2"
FAULT_PROMPT = "The animal with black and white stripes is the"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TURNS = [
    "Paris is the capital of France, on the Seine. Berlin is the capital of Germany, on the Spree. "
    "Paris has about two million inhabitants; Berlin has about three and a half million. What is the capital of France?",
    "And of Germany?",
    "Which of the two cities is bigger?",
    "Which river runs through Berlin?",
]


DRAIN_S, GRACE_S = 3.0, 6.0  # hcache serve's default drain; a grace shorter than the long replies below


class Server:
    """``events``: the deployment's KV cache events (the ``kv_events`` setting), subscribed to before it starts
    (None where vLLM, whose publisher sends them, is not installed)."""

    def __init__(self, tmp: Path):
        self.path = str(resolve_model_dir(MODEL))
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.port, self.log, self.output = _free_port(), tmp / "requests.jsonl", tmp / "serve.out"
        self.url = f"http://localhost:{self.port}"
        self.events, settings = None, {}
        if importlib.util.find_spec("vllm") is not None:
            from support.kv_events import Stream

            events, replay = _free_port(), _free_port()
            settings["kv_events"] = {"endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
            self.events = Stream(events, replay)
        (tmp / "settings.json").write_text(json.dumps(settings))
        repo = str(REPO)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([FAULT_DIR, repo]),
            HCACHE_TEST_FAULT_TOKEN=str(self.tokenizer.encode(" candidate")[0]),
        )
        command = [
            sys.executable,
            "-m",
            "hcache",
            "serve",
            "--model",
            MODEL,
            "--engine",
            "reference",
            "--store-dir",
            str(tmp / "store"),
            "--request-log",
            str(self.log),
            "--openai-port",
            str(self.port),
            "--no-rest",
            "--port",
            str(_free_port()),
            "--zmq-port",
            str(_free_port()),
            "--metrics-port",
            "0",
            "--shutdown-grace",
            str(GRACE_S),
            "--config",
            str(tmp / "settings.json"),
        ]
        with open(self.output, "w") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"hcache serve exited:\n{self.output.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"hcache serve not healthy in {timeout_s} s:\n{self.output.read_text()[-3000:]}")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120, **kwargs)

    def prompt_tokens(self, messages: list[dict]) -> int:
        """The templated prompt's tokens, counted as the model server counts them."""
        return len(
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
        )

    def logged(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def settled(self) -> None:
        """Wait until earlier tests' requests are logged: a stream a client left is flushed a little later."""
        lines = -1
        while lines != (lines := len(self.logged())):
            time.sleep(1)

    def next_logged(self, before: int, timeout_s: float = 30) -> dict:
        """The request log's line for the request made after it held ``before`` lines (a sequence is
        logged as it is flushed, just after its reply)."""
        deadline = time.monotonic() + timeout_s
        while len(lines := self.logged()) <= before:
            assert time.monotonic() < deadline, "the request was not logged"
            time.sleep(0.1)
        return lines[before]

    def left_running(self) -> list[psutil.Process]:
        return process_tree.running(getattr(self, "tree", []))


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("openai"))
    try:
        s.wait_healthy()
        yield s
    finally:
        if s.process.poll() is None:
            s.tree = process_tree.descendants(s.process.pid)
            s.process.kill()
        process_tree.kill(s.left_running())  # the deployment's processes lead sessions of their own
        if s.events is not None:
            s.events.close()


def _greedy(client: openai.OpenAI, messages: list[dict], **kwargs) -> str:
    return (
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32, **kwargs)
        .choices[0]
        .message.content
    )


def _streamed(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(
        c.choices[0].delta.content or "" if c.object == "chat.completion.chunk" else c.choices[0].text
        for c in chunks
        if c.choices
    )
    return text, chunks


def test_models_lists_the_served_model(server):
    [model] = server.client().models.list().data
    assert (model.id, model.object, model.owned_by, model.model_extra["max_model_len"]) == (
        MODEL,
        "model",
        "hcache",
        8192,
    )


def test_chat_greedy_streamed_equals_whole_with_usage_of_the_templated_prompt(server):
    client = server.client()
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    text, chunks = _streamed(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.created > 0
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "stop" and choice.index == 0
    assert "Paris" in choice.message.content and "<|im_end|>" not in choice.message.content
    assert text == choice.message.content  # the stream joined, special tokens left out of both
    generated = len(server.tokenizer.encode(text)) + 1  # the reply, and the end-of-turn token that ended it
    assert whole.usage.prompt_tokens == server.prompt_tokens(QUESTION) > 30  # the template's system turn counts
    assert (
        whole.usage.completion_tokens == generated and whole.usage.total_tokens == whole.usage.prompt_tokens + generated
    )
    assert all(c.object == "chat.completion.chunk" and c.created > 0 and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: a last chunk of usage alone


def test_chat_without_max_tokens_ends_with_the_turn_and_max_tokens_ends_with_length(server):
    reply = server.client().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)  # no max_tokens
    assert reply.choices[0].finish_reason == "stop" and "Paris" in reply.choices[0].message.content
    short = server.client().chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0
    )
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("length", 3)


def test_completions_with_the_clients_defaults_streamed_and_not(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == (
        "length",
        16,
    )  # OpenAI's default max_tokens
    assert whole.usage.prompt_tokens == len(server.tokenizer.encode("The capital of France is"))
    text, chunks = _streamed(
        client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, stream=True)
    )
    assert text == whole.choices[0].text and all(c.object == "text_completion" for c in chunks)
    echoed = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + whole.choices[0].text
    text, _ = _streamed(
        client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, echo=True, stream=True)
    )
    assert text == echoed.choices[0].text


def test_stop_strings_streamed_and_not(server):
    client = server.client()
    reply = _greedy(client, QUESTION)
    stop = reply.split()[2]  # a word inside the reply: the text ends before it
    for stops in (
        stop,
        ["no such words", stop],
        ["", stop],
    ):  # every entry of a list counts; an empty one stops nothing
        whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stop=stops)
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (
            reply[: reply.index(stop)],
            "stop",
        )
        text, chunks = _streamed(
            client.chat.completions.create(
                model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stop=stops, stream=True
            )
        )
        assert text == whole.choices[0].message.content and chunks[-1].choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < len(server.tokenizer.encode(reply))  # generation ended at the stop


def test_sampling_options_and_seed_with_greedy(server):
    client = server.client()
    sampled = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0.7, top_p=0.9, max_tokens=8, extra_body={"top_k": 40}
    )
    assert sampled.usage.completion_tokens <= 8 and sampled.choices[0].message.content
    assert _greedy(client, QUESTION, seed=1) == _greedy(client, QUESTION)
    top_1 = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0.7, max_tokens=32, extra_body={"top_k": 1}
    )
    assert top_1.choices[0].message.content == _greedy(client, QUESTION)  # served greedily: the same token


def _ask(client: openai.OpenAI, stream: bool, **request) -> tuple[str, str, int]:
    """A chat's text, finish reason and completion tokens, streamed or not."""
    if not stream:
        reply = client.chat.completions.create(**request)
        return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens
    text, chunks = _streamed(
        client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_vllms_sampling_extensions_are_honoured(server, stream):
    """``min_tokens``, ``ignore_eos`` and ``stop_token_ids``, as vLLM's clients send them (``extra_body``)."""
    client, request = server.client(), {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 30}
    reply, reason, tokens = _ask(client, stream, **request)
    assert reason == "stop" and tokens < 20  # the reply and its end-of-turn token
    text, reason, tokens = _ask(client, stream, **request, extra_body={"min_tokens": 20})
    assert text.startswith(reply) and len(text) > len(reply) and tokens >= 20  # the end of turn held back until then
    text, reason, tokens = _ask(client, stream, **request, extra_body={"ignore_eos": True})
    assert text.startswith(reply) and (reason, tokens) == ("length", 30)
    ids = server.tokenizer.encode(reply)
    at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # the first time this token is generated
    text, reason, tokens = _ask(client, stream, **request, extra_body={"stop_token_ids": [ids[at]]})
    assert (text, reason, tokens) == (server.tokenizer.decode(ids[:at]), "stop", at + 1)  # counted, its text not sent


def test_version_answers_as_vllms_does(server):
    answer = httpx.get(f"{server.url}/version")
    assert answer.status_code == 200 and answer.json() == {"version": hcache.__version__}


BAD = [  # (request fields over a valid chat, status, param, words of the message)
    ({"max_tokens": -1}, 400, "max_tokens", "at least 1"),
    ({"max_tokens": 10**9}, 400, "max_tokens", "maximum context length is 8192"),
    ({"messages": [{"role": "user", "content": "word " * 40_000}]}, 400, "messages", "maximum context length"),
    ({"temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ({"n": 0}, 400, "n", "n must be 1"),
    ({"n": 2}, 400, "n", "n must be 1"),
    ({"messages": []}, 400, "messages", "at least 1 item"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "Input should be"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
        "only text",
    ),
    ({"model": "no-such-model"}, 404, "model", "does not exist"),
    ({"seed": 3, "temperature": 0.5}, 400, "seed", "temperature=0"),
    ({"logprobs": True}, 400, "logprobs", "not supported"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({"extra_body": {"cache_salt": ""}}, 400, "cache_salt", "cache_salt"),
    ({"extra_body": {"top_k": -3}, "temperature": 0.5}, 400, "top_k", "top_k"),
    ({"extra_body": {"repetition_penalty": 1.2}}, 400, "repetition_penalty", "not supported"),
    ({"extra_body": {"min_tokens": 9}}, 400, "min_tokens", "at most max_tokens (8)"),
    ({"extra_body": {"min_tokens": -1}}, 400, "min_tokens", "greater than or equal to 0"),
    ({"extra_body": {"stop_token_ids": [-2]}}, 400, "stop_token_ids", "non-negative"),
    ({"extra_body": {"top_k": -5}, "temperature": 0}, 400, "top_k", "greater than or equal to -1"),
    ({"extra_body": {"use_beam_search": True}}, 400, "use_beam_search", "not supported"),
    ({"extra_body": {"length_penalty": 0.5}}, 400, "length_penalty", "not supported"),
    ({"extra_body": {"prompt_logprobs": 1}}, 400, "prompt_logprobs", "not supported"),
    ({"extra_body": {"functions": [{"name": "f", "parameters": {}}]}}, 400, "functions", "not supported"),
    ({"tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"extra_body": {"guided_json": "{bad"}}, 400, "guided_json", "JSON"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("fields", "status", "param", "words"), BAD, ids=[next(iter(b[0])) + str(i) for i, b in enumerate(BAD)]
)
def test_refused_before_anything_is_sent_in_openais_error_shape(server, stream, fields, status, param, words):
    """A refusal is an HTTP error (the client raises at once: nothing hangs, nothing is retried), never a
    stream that starts and breaks."""
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": stream, **fields}
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        server.client().chat.completions.create(**request)
    assert time.monotonic() - start < 30
    error = refused.value
    assert error.status_code == status and error.response.headers["content-type"] == "application/json"
    assert error.body["param"] == param and words in error.body["message"], error.body
    assert error.body["type"] == "invalid_request_error" and "/" not in error.body["message"].replace("/v1", "")


def test_malformed_requests_answer_400_naming_no_server_paths(server):
    bad_json = httpx.post(
        f"{server.url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and set(bad_json.json()["error"]) == {"message", "type", "param", "code"}
    assert "JSON" in bad_json.json()["error"]["message"] and "site-packages" not in bad_json.text
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    tokens = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
    assert tokens.status_code == 400 and "one string" in tokens.json()["error"]["message"]


def test_a_failure_midway_through_a_stream_is_an_error_event_then_done(server):
    """The deployment fails the request after it has streamed text: the stream sends an error event and
    ``[DONE]`` and closes; the official client raises; the server serves on."""
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=120,
        json={"model": MODEL, "prompt": FAULT_PROMPT, "max_tokens": 8, "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    error = json.loads(events[-2])["error"]
    assert "".join(texts) == " most likely candidate" and events[-1] == "[DONE]"
    assert "injected fault" in error["message"] and error["type"] == "server_error"
    with pytest.raises(openai.APIError, match="injected fault"):
        list(
            server.client(max_retries=0).completions.create(
                model=MODEL, prompt=FAULT_PROMPT, max_tokens=8, temperature=0, stream=True
            )
        )
    with pytest.raises(openai.InternalServerError, match="injected fault"):  # a fault before any text: HTTP 500
        server.client(max_retries=0).completions.create(model=MODEL, prompt=FAULT_PROMPT + " candidate", max_tokens=8)
    assert "Paris" in _greedy(server.client(), QUESTION)


def test_a_client_gone_midway_frees_the_deployment(server):
    """Streams closed after a few chunks, each asking for thousands of tokens: each leaves the batch at
    once, so the next request is answered as soon as it would be alone."""
    client = server.client()
    reply = _greedy(client, QUESTION)
    before = len(server.logged())
    for _ in range(3):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=4000,
            temperature=0.8,
            stream=True,
        )
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        stream.close()
    assert _greedy(client, QUESTION) == reply  # nothing of the abandoned streams in it
    server.next_logged(
        before + 3
    )  # all four finished: the three left generating thousands of tokens would take minutes
    assert all(line["computed_tokens"] < 200 for line in server.logged()[before:]), server.logged()[before:]


def test_eight_concurrent_clients_each_get_their_own_reply(server):
    questions = [[{"role": "user", "content": f"What is {a} plus {a}?"}] for a in range(2, 10)]
    alone = [_greedy(server.client(), q) for q in questions]

    def ask(i: int) -> str:
        client = server.client()
        if i % 2:
            return _streamed(
                client.chat.completions.create(
                    model=MODEL, messages=questions[i], temperature=0, max_tokens=32, stream=True
                )
            )[0]
        return _greedy(client, questions[i])

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == alone


def _told(logged: dict) -> dict:
    """What a response's ``hcache`` object says of the request the log line ``logged`` records."""
    fields = ("restored_tokens", "gpu_tokens", "tier_tokens", "miss_tokens", "plan", "lossy")
    return SequenceRecord(**{name: logged[name] for name in fields}).reply()


def test_a_returning_conversation_restores_and_replies_as_recomputed(server):
    """Four turns, each resending the history: every reply equals the same turn sent under a fresh
    ``cache_salt`` (a namespace with nothing stored: recomputed), and turns 2-4 restore the history. Each
    response's ``hcache`` object (issue 34) says what the request log says, except that a history stored
    under another ``cache_salt`` reads never stored to the client; the stream's last chunk carries it too."""
    client, messages = server.client(), []
    server.settled()
    for turn, question in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        before = len(server.logged())
        fresh = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=32,
            extra_body={"cache_salt": f"fresh-{uuid.uuid4().hex}"},
        )
        logged = server.next_logged(before)
        assert logged["restored_tokens"] == 0
        assert set(logged["miss_tokens"]) <= {"never_stored", "other_cache_salt"}  # the latter: earlier turns stored it
        assert turn == 0 or "other_cache_salt" in logged["miss_tokens"]
        assert fresh.model_extra["hcache"] == _told(logged)
        assert fresh.model_extra["hcache"]["miss_tokens"] == {"never_stored": sum(logged["miss_tokens"].values())}
        whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
        logged = server.next_logged(before + 1)
        told = whole.model_extra["hcache"]
        reply = whole.choices[0].message.content
        assert reply == fresh.choices[0].message.content, turn
        assert (logged["restored_tokens"] > 0) == (turn > 0), (turn, logged)
        assert told == _told(logged) and told["restored_tokens"] == sum(told["tier_tokens"].values())
        _, chunks = _streamed(
            client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32, stream=True)
        )
        [last] = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
        assert last.model_extra["hcache"]["restored_tokens"] > 0 and all(
            c.model_extra["hcache"] is None for c in chunks if c is not last
        )
        server.next_logged(before + 2)  # the stream's line is written before the next turn counts lines
        messages.append({"role": "assistant", "content": reply})


def test_hcache_store_verifies_and_evicts_beside_this_live_server(server, capsys):
    """Issue 34: ``hcache store`` on the store a running ``hcache serve`` holds: it reads every chunk good,
    evicts them all, and the server goes on serving, replying as recompute does."""
    from hcache.cli import main

    store = str(server.log.parent / "store")
    client, messages = server.client(), [{"role": "user", "content": TURNS[0]}]
    _greedy(client, messages)  # a history stored, if no test before stored one
    assert main(["store", "inspect", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] > 0
    assert main(["store", "verify", store]) == 0  # the server's write-backs may add chunks meanwhile
    assert re.search(r"verified [1-9][0-9]* chunks in .*: [1-9][0-9]* good, 0 bad", capsys.readouterr().out)
    assert main(["store", "evict", store, "--older-than", "0"]) == 0
    assert re.search(r"evicted [1-9][0-9]* chunks", capsys.readouterr().out)
    reference = _greedy(client, messages, extra_body={"cache_salt": f"fresh-{uuid.uuid4().hex}"})
    assert _greedy(client, messages) == reference
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


STRUCTURED = [  # (request fields, check of the reply's text); asked for JSON, SmolLM2's JSON ends
    ({"extra_body": {"guided_choice": ["Berlin", "Madrid"]}}, lambda t: t in ("Berlin", "Madrid")),
    (
        {"extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]{1,8} [0-9]{4}"}}},
        lambda t: re.fullmatch(r"[A-Z][a-z]{1,8} [0-9]{4}", t),
    ),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "city",
                    "schema": {
                        "type": "object",
                        "properties": {"capital": {"type": "string", "maxLength": 20}},
                        "required": ["capital"],
                        "additionalProperties": False,
                    },
                },
            }
        },
        lambda t: set(json.loads(t)) == {"capital"},
    ),
]


@pytest.mark.parametrize(("fields", "conforms"), STRUCTURED, ids=["choice", "regex", "json_object", "json_schema"])
def test_a_structured_reply_conforms_and_ends(server, fields, conforms):
    question = [{"role": "user", "content": 'What is the capital of France? Answer in JSON, like {"capital": "..."}'}]
    text, reason, _ = _ask(
        server.client(), True, model=MODEL, messages=question, temperature=0, max_tokens=200, **fields
    )
    assert reason == "stop" and conforms(text), text


def test_vllms_token_and_text_fields_are_honoured(server):
    client, request = server.client(), {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 30}
    reply, _, _ = _ask(client, False, **request)
    assert "Paris" in reply
    assert "Paris" not in _ask(client, False, **request, extra_body={"bad_words": ["Paris"]})[0]
    allowed = [server.tokenizer.eos_token_id, *server.tokenizer.encode(" Berlin Madrid")]
    held, _, _ = _ask(client, False, **request, extra_body={"allowed_token_ids": allowed})
    assert set(server.tokenizer.encode(held)) <= set(allowed), held
    for stream in (False, True):
        kept, reason, _ = _ask(client, stream, **request, extra_body={"skip_special_tokens": False})
        assert (kept, reason) == (reply, "stop")  # the end of turn ended it: its text is not sent ...
        kept, _, _ = _ask(
            client, stream, **request, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}
        )
        assert kept == reply + "<|im_end|>"  # ... unless asked for
        stop = reply.split()[1]
        cut, reason, _ = _ask(client, stream, **request, stop=[stop], extra_body={"include_stop_str_in_output": True})
        assert (cut, reason) == (reply[: reply.index(stop) + len(stop)], "stop")
    whole = client.completions.create(model=MODEL, prompt="one two three four five six", max_tokens=2, temperature=0)
    cut = client.completions.create(
        model=MODEL,
        prompt="one two three four five six",
        max_tokens=2,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert cut.usage.prompt_tokens == 3 < whole.usage.prompt_tokens


def test_kv_events_tell_a_router_what_this_node_stores_as_vllm_names_its_blocks(server):
    """The ``kv_events`` setting: vLLM's event stream, read as a router reads it (tests/support/kv_events.py):
    ``AllBlocksCleared`` first, then a chat's prompt stored, chunk by chunk, on ``CPU`` (the host pool)
    and then on ``STORAGE`` (the disk), as vLLM's 16-token blocks with the hashes vLLM gives them and the
    tokens the server tokenised."""
    if server.events is None:
        pytest.skip("vLLM is not installed: no kv_events publisher")
    from support.kv_events import vllm_hashes
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)  # vLLM's fixed seed for sha256, as the server's
    story = "The lighthouse keeper counted the ships that passed the northern cape each night. "
    messages = [{"role": "user", "content": f"KV events {uuid.uuid4().hex}. " + story * 14 + "How many?"}]
    tokens = server.tokenizer.encode(
        server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert 256 < len(tokens) < 316, len(tokens)  # four whole chunks; the four tokens of the reply end no fifth
    reply = server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    assert reply.usage.prompt_tokens == len(tokens)
    want = vllm_hashes(tokens[:256], 16)

    def stored(events, medium: str) -> list:  # this prompt's: every block in its chain
        return [
            e for e in events if isinstance(e, BlockStored) and e.medium == medium and set(e.block_hashes) <= set(want)
        ]

    events = server.events.wait(lambda found: sum(len(e.block_hashes) for e in stored(found, "STORAGE")) >= 16)
    assert events[0] == AllBlocksCleared() and AllBlocksCleared() not in events[1:]
    at = {medium: [events.index(e) for e in stored(events, medium)] for medium in ("CPU", "STORAGE")}
    for medium in ("CPU", "STORAGE"):
        chunks = stored(events, medium)
        assert [h for e in chunks for h in e.block_hashes] == want
        assert [t for e in chunks for t in e.token_ids] == tokens[:256]  # as the server tokenised the prompt
        assert [e.parent_block_hash for e in chunks] == [None] + [e.block_hashes[-1] for e in chunks[:-1]]
        assert all(e.block_size == 16 and e.extra_keys is None and e.lora_name is None for e in chunks)
    assert all(pool < disk for pool, disk in zip(at["CPU"], at["STORAGE"]))  # each chunk: the pool, then the disk


def test_sigterm_drains_then_refuses_new_requests_and_ends_those_in_flight_with_an_error(server):
    """SIGTERM with two long replies in flight (streamed and not) and a kept-alive connection: during the
    drain ``/health`` answers 503 and requests are still served; then a new request gets a 503 in OpenAI's
    shape and its connection is closed; at the end of the grace the stream ends with an error event then
    ``[DONE]`` and the whole reply is a 503 (never a dropped connection); the server exits 0, leaving no
    process."""
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    kept = httpx.Client(base_url=server.url, timeout=60)
    short = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 2}
    assert kept.post("/v1/chat/completions", json=short).status_code == 200  # the connection is kept alive
    long = {
        "model": MODEL,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 4000,
        "extra_body": {"ignore_eos": True},
    }
    stream = iter(server.client(max_retries=0).chat.completions.create(**long, stream=True))
    assert next(stream).choices[0].delta.role == "assistant"  # in flight
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(lambda: server.client(max_retries=0).chat.completions.create(**long))
        time.sleep(1)  # sent
        start, server.tree = time.monotonic(), process_tree.descendants(server.process.pid)
        server.process.terminate()
        time.sleep(0.5)
        assert httpx.get(f"{server.url}/health").json() == {"status": "draining"}
        assert kept.post("/v1/chat/completions", json=short).status_code == 200  # served during the drain
        while (refused := kept.post("/v1/chat/completions", json=short)).status_code == 200:
            assert time.monotonic() - start < DRAIN_S + 5, "new requests still served after the drain"
            time.sleep(0.2)
        assert refused.status_code == 503 and refused.headers["connection"] == "close"
        assert refused.json()["error"]["code"] == "shutting_down" and refused.json()["error"]["type"] == "server_error"
        with pytest.raises(openai.APIError, match="shutting down") as cut_stream:  # an error event, not a drop
            for _ in stream:
                pass
        with pytest.raises(openai.InternalServerError, match="shutting down") as cut:
            whole.result()
        assert cut.value.status_code == 503 and cut.value.code == cut_stream.value.code == "shutting_down"
    assert time.monotonic() - start >= DRAIN_S + GRACE_S - 1  # the replies had the grace to finish
    server.process.wait(60)
    seconds = time.monotonic() - start
    assert server.process.returncode == 0
    # Drain, grace, then the deployment's stop: about 5 s more on a 2-core VM.
    assert seconds < DRAIN_S + GRACE_S + 12, f"hcache serve took {seconds:.1f} s to stop"
    output = server.output.read_text()
    noise = ("Setting accelerator to CPU", "[runner.py", "[launch.py", "About to start server", "Loading weights")
    assert not any(line in output for line in noise), output  # third parties' logs stay below -v
    assert f"/v1/chat/completions  (model: {MODEL})" in output  # the id /v1/models lists, not a directory
    assert server.tree and not server.left_running(), server.left_running()
