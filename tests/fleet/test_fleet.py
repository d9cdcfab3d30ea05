"""A fleet as users run it, on loopback: HAProxy (Debian's package) in front of two ``hcache serve`` nodes
(SmolLM2 on the reference engine, each with its own disk store and GPU prefix cache), one redis-server
below them. Conversations keep to a node, move when it is gone and are restored from Redis there, and
every reply equals the recompute of the same conversation (greedy). One fleet serves the tests in file
order; the last one kills a node."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from hcache.storage.redis_server import redis_missing
from hcache.fleet import Fleet, chat, haproxy_missing
from hcache.machine.ports import free_port
from hcache.model.loader import model_dir as resolve_model_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(haproxy_missing() or redis_missing()), reason=f"{haproxy_missing() or redis_missing()}"),
]

NEW_TOKENS = 12
CONVERSATIONS = [
    [
        "The Loire is the longest river of France. It rises in the Massif Central, flows north to Orléans, then west "
        "through Tours and Nantes, and reaches the Atlantic at Saint-Nazaire after about a thousand kilometres. "
        "Which is the longest river of France?",
        "Where does it reach the sea?",
        "Name a city on it.",
    ],
    [
        "Mount Everest, on the border of Nepal and China, is the highest mountain above sea level, at 8849 metres. "
        "It was first climbed in 1953 by Edmund Hillary and Tenzing Norgay, by the south-east ridge from Nepal. "
        "How high is Mount Everest?",
        "Who climbed it first?",
        "In which year?",
    ],
    [
        "Photosynthesis is how plants, algae and some bacteria turn light into chemical energy: in their "
        "chloroplasts, carbon dioxide and water become glucose, and oxygen is released into the air as a by-product. "
        "What does photosynthesis release?",
        "Where in the cell does it happen?",
        "What does it make?",
    ],
    [
        "The violin has four strings tuned in fifths, G, D, A and E, and is played with a bow of horsehair. It is the "
        "smallest and highest-pitched member of the string family, which also has the viola, the cello and the bass. "
        "How many strings does a violin have?",
        "What is the bow made of?",
        "Which instrument is bigger?",
    ],
]


@pytest.fixture(scope="module")
def model_path(smollm2) -> str:
    return str(resolve_model_dir("smollm2"))


@pytest.fixture(scope="module")
def fleet(model_path, tmp_path_factory):
    with Fleet(
        2,
        tmp_path_factory.mktemp("fleet"),
        port=free_port(),
        serve_args=["--model", model_path, "--engine", "reference"],
    ) as f:
        yield f


@pytest.fixture(scope="module")
def reference(fleet, model_path) -> list[list[str]]:
    """Each conversation's replies recomputed: every request in a namespace of its own (``cache_salt``), where
    nothing is stored, so a node prefills the whole history (tests/mii/test_mii.py holds such replies equal to
    MII's with hcache off)."""
    out = []
    for c, questions in enumerate(CONVERSATIONS):
        messages, replies = [], []
        for question in questions:
            messages.append({"role": "user", "content": question})
            replies.append(
                chat(fleet.url, model_path, messages, f"reference-{c}", NEW_TOKENS, cache_salt=uuid.uuid4().hex).text
            )
            messages.append({"role": "assistant", "content": replies[-1]})
        out.append(replies)
    return out


class Client:
    """A conversation through the balancer, checked turn by turn against the reference. ``salt``: its cache
    namespace (each test has its own, so no test finds another's state)."""

    def __init__(self, fleet: Fleet, model: str, conversation: int, reference: list[list[str]], salt: str):
        self.fleet, self.model, self.conversation, self.salt = fleet, model, conversation, salt
        self.expected = reference[conversation]
        self.messages: list[dict] = []

    def turn(self, session: str) -> str:
        """The next turn under ``session``; returns the node that answered, having checked the reply."""
        question = CONVERSATIONS[self.conversation][len(self.messages) // 2]
        self.messages.append({"role": "user", "content": question})
        reply = chat(self.fleet.url, self.model, self.messages, session, NEW_TOKENS, cache_salt=self.salt)
        assert reply.text == self.expected[len(self.messages) // 2], (
            self.conversation,
            len(self.messages) // 2,
            reply.node,
        )
        self.messages.append({"role": "assistant", "content": reply.text})
        return reply.node


def _node(fleet: Fleet, name: str):
    return next(n for n in fleet.nodes if n.name == name)


def _log(node) -> list[dict]:
    return [json.loads(line) for line in node.request_log.read_text().splitlines()] if node.request_log.exists() else []


def _logged(node) -> int:
    """How many sequences the node has logged, once the last reply's line is in (a sequence is logged when
    MII flushes it, just after its reply has gone)."""
    n = len(_log(node))
    while True:
        time.sleep(0.3)
        now = len(_log(node))
        if now == n:
            return n
        n = now


def _restored(node) -> dict[str, float]:
    """The node's ``hcache_restored_tokens_total`` by source, from its Prometheus endpoint."""
    text = urllib.request.urlopen(node.metrics_url, timeout=30).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "hcache_restored_tokens")
    return {s.labels["source"]: s.value for s in family.samples if s.name.endswith("_total")}


def _session_on(fleet: Fleet, name: str, prefix: str) -> str:
    """A session id the balancer sends to node ``name``."""
    return next(s for s in (f"{prefix}-{i}" for i in range(1000)) if fleet.node_for(s) == name)


def _new_turns(node, before: int, n: int) -> list[dict]:
    """The ``n`` lines the node's request log got after its first ``before`` (a sequence is logged when MII
    flushes it, just after the reply has gone)."""
    deadline = time.monotonic() + 30
    while len(lines := _log(node)) < before + n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(lines) == before + n, f"{n} request(s), as many finished sequences on {node.name}"
    return lines[before:]


def _last_turn(node, before: int) -> dict:
    return _new_turns(node, before, 1)[0]


def test_a_conversations_turns_stay_on_one_node_and_adopt_its_gpu_cache(fleet, model_path, reference):
    client = Client(fleet, model_path, 0, reference, "stay")
    owner = _node(fleet, fleet.node_for("stay"))
    before = _logged(owner)
    served = {client.turn("stay") for _ in CONVERSATIONS[0]}
    assert served == {owner.name}
    turns = _new_turns(owner, before, 3)
    assert turns[0]["restored_tokens"] == 0
    assert all(t["gpu_tokens"] >= 64 for t in turns[1:]), turns
    assert _restored(owner)["gpu_cache"] >= sum(t["gpu_tokens"] for t in turns)


def test_a_rolling_restart_under_a_stream_of_conversations_fails_no_request(fleet, model_path, reference):
    """Each node in turn drains (SIGTERM), exits 0 and starts again, and the next goes once the balancer
    routes to it again (``Fleet.restart``), while two clients run conversations: every request is answered,
    and every reply is the reference's. A request that reaches a node after its drain is answered 503 and
    sent to the other node by the balancer, never to the client."""
    restarting = threading.Event()
    restarting.set()
    served: list[str] = []

    def client(k: int) -> int:
        done = 0
        while (restarting.is_set() or done < 2) and done < 30:  # bounded: 30 conversations a client
            c = Client(fleet, model_path, (k + done) % len(CONVERSATIONS), reference, "roll")
            served.extend(c.turn(f"roll-{k}-{done}") for _ in CONVERSATIONS[c.conversation])
            done += 1
        return done

    with ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(client, k) for k in range(2)]
        try:
            for node in fleet.nodes:
                time.sleep(1)
                assert fleet.restart(node) == 0, node.tail()
        finally:
            restarting.clear()
        conversations = sum(c.result() for c in clients)  # raises the first failed request or differing reply
    assert conversations >= 4 and set(served) == {n.name for n in fleet.nodes}


def test_redis_killed_then_back_nodes_recompute_then_use_it_again(fleet, model_path, reference):
    """With Redis down, a conversation that moves to the other node is recomputed there, identically; once
    Redis is back (empty, as a restarted cache is), what nodes save goes there, and a moved conversation is
    restored from it."""
    first, second = fleet.nodes
    fleet.redis.stop()
    client = Client(fleet, model_path, 1, reference, "down")
    assert client.turn(_session_on(fleet, first.name, "down")) == first.name
    before = _logged(second)
    assert client.turn(_session_on(fleet, second.name, "down")) == second.name
    turn = _last_turn(second, before)
    assert turn["restored_tokens"] == 0 and turn["computed_tokens"] > 64

    fleet.redis.start()
    time.sleep(2.5)  # a tier that failed is skipped for 2 s (redis_store.DEFAULT_BACKOFF_S), then tried again
    client = Client(fleet, model_path, 2, reference, "back")
    assert client.turn(_session_on(fleet, first.name, "back")) == first.name
    assert redis.Redis(port=fleet.redis.port).dbsize() > 0  # saved to the new server
    before, restored = _logged(second), _restored(second)
    assert client.turn(_session_on(fleet, second.name, "back")) == second.name
    assert _last_turn(second, before)["tier_tokens"].get("redis", 0) >= 64
    assert _restored(second)["redis"] > restored["redis"]


def test_a_killed_nodes_conversation_moves_and_is_restored_from_redis(fleet, model_path, reference):
    """SIGKILL the node a conversation is on (every process of it, as a crash): the next turn is retried on
    the other node, which restores the history from Redis (its request log and counters say so), and the
    reply is the reference's."""
    client = Client(fleet, model_path, 3, reference, "moved")
    owner = _node(fleet, fleet.node_for("moved"))
    other = next(n for n in fleet.nodes if n is not owner)
    assert {client.turn("moved"), client.turn("moved")} == {owner.name}
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    first_prompt = len(
        tokenizer.encode(tokenizer.apply_chat_template(client.messages[:1], tokenize=False, add_generation_prompt=True))
    )
    time.sleep(0.5)  # the write-backs of the last turn's chunks to Redis (milliseconds)
    owner.kill()
    before, restored = _logged(other), _restored(other)
    try:
        assert client.turn("moved") == other.name
    except urllib.error.HTTPError as exc:  # the balancer's log says which node it tried, and what each did
        pytest.fail(f"{exc}; HAProxy's log ends:\n{(fleet.directory / 'haproxy.log').read_text()[-3000:]}")
    assert fleet.balancer_stats()[owner.name]["wredis"] == "1"  # tried on the dead node, then sent on
    turn = _last_turn(other, before)
    assert turn["tier_tokens"].get("redis", 0) >= first_prompt // 64 * 64 > 0, turn
    assert _restored(other)["redis"] - restored["redis"] == turn["tier_tokens"]["redis"]


def _fleet_command(*args: str, marker: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HCACHE_FLEET_TEST": marker}  # inherited by everything the command starts
    return subprocess.run(
        [sys.executable, "-m", "hcache", "fleet", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"HCACHE_FLEET_TEST={marker}".encode() in open(f"/proc/{pid}/environ", "rb").read():
                found.append(int(pid))
        except OSError:  # gone, or not ours
            pass
    return found


def test_bad_configuration_is_refused_clearly_and_leaves_nothing_running(tmp_path, model_path):
    marker = uuid.uuid4().hex
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        closed = free_port()
        bad_config = tmp_path / "settings.json"
        bad_config.write_text("{not json")
        cases = [
            (["--nodes", "0"], "at least one node, not 0"),
            (["--nodes", "2", "--port", str(busy)], f"the balancer: cannot listen on 127.0.0.1:{busy}"),
            (
                ["--nodes", "2", "--port", str(free_port()), "--redis", f"redis://127.0.0.1:{closed}/0"],
                "the Redis server cannot be reached",
            ),
            # the Redis server is started, then the nodes refuse their settings: all of it is stopped
            (
                ["--nodes", "2", "--port", str(free_port()), "--model", model_path, "--config", str(bad_config)],
                "not a readable JSON file",
            ),
        ]
        with ThreadPoolExecutor(len(cases)) as pool:
            runs = pool.map(
                lambda i: _fleet_command(*cases[i][0], "--dir", str(tmp_path / f"fleet{i}"), marker=marker),
                range(len(cases)),
            )
            for (args, message), done in zip(cases, runs):
                assert done.returncode == 2 and message in done.stderr, (args, done.stdout, done.stderr[-3000:])
    assert _processes_with(marker) == []
