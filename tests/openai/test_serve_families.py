"""``hcache serve --model`` on checkpoints of today's families, as a user serves them: a random-weight Qwen3,
Gemma 3 and Qwen3-Next saved with transformers' own classes (and SmolLM2's tokenizer and chat template), served by
``--engine auto``, which on a CPU, and for families DeepSpeed's FastGen lacks, is the reference engine.

A returning conversation through the ``openai`` client: each turn's reply equals the same turn sent under a
fresh ``cache_salt`` (nothing stored there: recomputed), and the later turns restore the history."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from hcache.machine import process_tree
from hcache.machine.ports import free_port
from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import random_model

pytestmark = pytest.mark.slow

FAMILIES = {  # config fields, and the layer types a restore reads
    "qwen3": ({"head_dim": 64}, {"full_attention"}),  # heads wider than hidden_size / num_attention_heads
    "gemma3_text": (  # Gemma 3's own pattern: five sliding layers to one full
        {"head_dim": 64, "sliding_window": 64, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
        {"full_attention", "sliding_attention"},
    ),
    "qwen3_next": (  # two gated delta nets to one gated attention layer; each restore reads the nets' last state
        {"head_dim": 64, "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2},
        {"full_attention", "gated_delta_net"},
    ),
}
TURNS = [
    "Tell me about the river that runs through the old town, and the bridges over it. " * 6,
    "And the oldest bridge?",
    "Which one would you cross first?",
]


def _start(family: str, vocab_size: int, tmp) -> tuple:
    """``hcache serve`` on a random checkpoint of ``family``: its process, OpenAI port, checkpoint, request
    log and output."""
    model = random_model(
        family,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=6,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **FAMILIES[family][0],
    )
    path = save_checkpoint(model, tmp / "model")
    port, log, output = free_port(), tmp / "requests.jsonl", tmp / "serve.out"
    command = [sys.executable, "-m", "hcache", "serve", "--model", str(path), "--engine", "auto"]
    command += ["--store-dir", str(tmp / "store"), "--request-log", str(log), "--openai-port", str(port)]
    command += ["--no-rest", "--port", str(free_port()), "--zmq-port", str(free_port()), "--metrics-port", "0"]
    with open(output, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    return process, port, path, log, output


@pytest.fixture(scope="module")
def servers(smollm2, tmp_path_factory) -> dict[str, tuple]:
    """Every family's server (:func:`_start`), started at once: a start is mostly imports, a core each."""
    started = {}
    try:
        for family in FAMILIES:
            started[family] = _start(family, smollm2.spec.vocab_size, tmp_path_factory.mktemp(f"serve-{family}"))
        yield started
    finally:
        for process, *_ in started.values():
            tree = process_tree.descendants(process.pid)
            process.kill()
            process_tree.kill(process_tree.running(tree))


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, servers):
    process, port, path, log, output = servers[request.param]
    _wait_healthy(f"http://localhost:{port}/health", process, output)
    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="unused", timeout=120)
    return client, str(path), log, FAMILIES[request.param][1]


def _wait_healthy(url: str, process: subprocess.Popen, output, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"hcache serve exited:\n{output.read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"hcache serve not healthy in {timeout_s} s:\n{output.read_text()[-3000:]}")


def _logged(log, count: int, timeout_s: float = 30) -> list[dict]:
    """The request log's lines, once it holds ``count`` (a sequence is logged just after its reply)."""
    deadline = time.monotonic() + timeout_s
    while len(lines := log.read_text().splitlines() if log.exists() else []) < count:
        assert time.monotonic() < deadline, f"{len(lines)} of {count} requests logged"
        time.sleep(0.1)
    return [json.loads(line) for line in lines]


def test_a_returning_conversation_is_served_and_restored_as_recomputed(served):
    client, model, log, layer_types = served
    messages = []
    for turn, question in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        ask = lambda **extra: client.chat.completions.create(  # noqa: E731
            model=model, messages=messages, temperature=0, max_tokens=16, **extra
        )
        fresh = ask(extra_body={"cache_salt": f"fresh-{uuid.uuid4().hex}"})
        whole = ask()
        *_, recomputed, restored = _logged(log, 2 * (turn + 1))
        assert whole.choices[0].message.content == fresh.choices[0].message.content, turn
        assert recomputed["restored_tokens"] == 0
        assert (restored["restored_tokens"] > 0) == (turn > 0), (turn, restored)
        assert restored["fallback"] is None and (turn == 0 or set(restored["type_bytes"]) == layer_types)
        messages.append({"role": "assistant", "content": whole.choices[0].message.content})
