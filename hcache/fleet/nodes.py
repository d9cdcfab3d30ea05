"""A fleet on one machine: N ``hcache serve`` nodes behind HAProxy, one Redis server below them all.

Each node is an ``hcache serve`` process with MII's OpenAI-compatible server, its own disk store and GPU
prefix cache (``--gpu-cache``) and the shared Redis store below (``--shared``). HAProxy, from the operating
system's packages, routes each request by consistent hashing of its ``X-Session-Id`` header
(``haproxy.cfg`` here, rendered for the nodes), so a conversation's turns find their history in one node's
GPU cache; when that node is gone, the next node on the hash ring restores the history from Redis. A
request without the header goes round robin (another backend of the same nodes). Used
by ``hcache fleet``, ``hcache bench fleet`` and the tests; on several machines, the same pieces by hand
(docs/fleet.md).
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from ..defaults import DEFAULT_MODEL
from ..errors import InvalidRequestError, StorageError
from ..machine import process_tree
from ..machine.ports import check_free, free_port

SESSION_HEADER = "X-Session-Id"
NODE_HEADER = "X-Hcache-Node"  # set by the balancer on each answer: the node that gave it
START_S = 300.0  # a node's start-up: MII's processes, the model, the OpenAI server
STOP_S = 120.0  # a node's drain and stop (SIGTERM), then what is left is killed
TIMEOUT_S = 600  # HAProxy's client and server timeouts: the longest generation


def haproxy_missing() -> str | None:
    """Why the balancer cannot be started here, or None."""
    if shutil.which("haproxy") is None:
        return "haproxy not installed (Debian package haproxy; scripts/install.sh installs it as root)"
    return None


def _node_ports() -> dict[str, int]:
    """A node's free ports; MII's model server listens on the one after its load balancer's."""
    return {"balancer": free_port(also=[1]), **{k: free_port() for k in ("openai", "zmq", "dist", "metrics")}}


@dataclass
class Node:
    """One ``hcache serve`` of a fleet; ``directory`` holds its store, request log and output."""

    index: int
    directory: Path
    serve_args: list[str]
    host: str = "127.0.0.1"
    ports: dict[str, int] = field(default_factory=_node_ports)
    process: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.ports['openai']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metrics']}/metrics"

    @property
    def request_log(self) -> Path:
        return self.directory / "requests.jsonl"

    @property
    def output(self) -> Path:
        return self.directory / "serve.log"

    def command(self) -> list[str]:
        p = self.ports
        return [
            sys.executable,
            "-m",
            "hcache",
            "serve",
            *self.serve_args,
            "--host",
            self.host,
            "--openai-port",
            str(p["openai"]),
            "--no-rest",
            "--port",
            str(p["balancer"]),
            "--zmq-port",
            str(p["zmq"]),
            "--dist-port",
            str(p["dist"]),
            "--metrics-port",
            str(p["metrics"]),
            "--store-dir",
            str(self.directory / "store"),
            "--request-log",
            str(self.request_log),
        ]

    def start(self) -> None:
        """Start the node (its own session: a Ctrl-C meant for the fleet reaches the fleet, which drains it)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.output, "ab") as out:
            self.process = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, seconds: float = START_S) -> None:
        """Wait until the node's ``/health`` answers 200; raise with the end of its output if it exits or
        takes longer."""
        deadline = time.monotonic() + seconds
        while not self.healthy():
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                why = f"exited with status {code}" if code is not None else f"not ready after {seconds:g} s"
                raise InvalidRequestError(f"{self.name} {why}; the end of {self.output}:\n{self.tail()}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def tail(self, chars: int = 3000) -> str:
        return self.output.read_text(errors="replace")[-chars:] if self.output.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, seconds: float = STOP_S) -> int | None:
        """SIGTERM: the node drains (fails its health check, finishes its requests, stores what it saved)
        and exits; whatever is left after ``seconds`` is killed. Returns its exit status."""
        if not self.alive():
            return None if self.process is None else self.process.returncode
        tree = process_tree.tree(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.returncode
        finally:
            process_tree.kill(process_tree.running(tree))  # MII's processes run in sessions of their own

    def kill(self) -> None:
        """SIGKILL the node and every process it started, as a crash of its machine would."""
        if self.process is not None:
            process_tree.kill(process_tree.tree(self.process.pid))
            self.process.wait()


@dataclass
class Reply:
    text: str
    node: str | None  # the node that gave it (the balancer's header; None straight from a node)
    ttft_s: float | None = None  # streamed: the time to the first token
    token_s: list[float] = field(default_factory=list)  # streamed: when each piece of text came, from the request
    restored: dict[str, int] | None = None  # the prompt's tokens restored, by source (the answer's ``hcache`` object)


def chat(
    base_url: str,
    model: str,
    messages: list[dict],
    session: str | None,
    max_tokens: int,
    *,
    cache_salt: str | None = None,
    stream: bool = False,
) -> Reply:
    """One greedy chat completion through an OpenAI API at ``base_url`` with the conversation's
    ``session`` header (none if None: the balancer sends it round robin) and cache namespace, if given;
    ``stream``: streamed, to time its first token. The reply's ``node`` is the balancer's header (None
    straight from a node)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "top_k": 1, "stream": stream}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    headers = {"Content-Type": "application/json", **({SESSION_HEADER: session} if session is not None else {})}
    request = urllib.request.Request(f"{base_url}/chat/completions", json.dumps(body).encode(), headers)
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
        node = answer.headers[NODE_HEADER]
        if not stream:
            whole = json.loads(answer.read())
            return Reply(whole["choices"][0]["message"]["content"], node, restored=_restored(whole))
        text, times, restored = "", [], None
        for line in answer:  # server-sent events: a role first, then one chunk of content a token
            data = line.removeprefix(b"data: ").strip()
            if not data or data == b"[DONE]":
                continue
            chunk = json.loads(data)
            restored = _restored(chunk) or restored  # on the chunk with the finish reason
            for choice in chunk["choices"]:
                if choice.get("delta", {}).get("content"):
                    times.append(time.perf_counter() - start)
                    text += choice["delta"]["content"]
        return Reply(text, node, times[0] if times else None, times, restored)


def _restored(answer: dict) -> dict[str, int] | None:
    """An answer's (or stream chunk's) tokens restored by source, from its ``hcache`` object; None without one."""
    report = answer.get("hcache")
    return dict(report["tier_tokens"]) if report else None


class Fleet:
    """``nodes`` ``hcache serve`` nodes (``serve_args``: their model and settings), HAProxy on
    ``host:port`` and, unless ``redis_url`` is given, a throwaway redis-server, all under ``directory``.
    :meth:`start` checks the configuration before starting anything and, if anything fails to start,
    stops what it started before it raises; :meth:`stop` drains the nodes, then stops the balancer and Redis."""

    def __init__(
        self,
        nodes: int,
        directory: str | Path,
        *,
        redis_url: str | None = None,
        host: str = "127.0.0.1",
        port: int = 8080,
        serve_args: list[str] | None = None,
    ):
        if nodes < 1:
            raise InvalidRequestError(f"a fleet needs at least one node, not {nodes}")
        self.directory, self.host, self.port = Path(directory), host, port
        self.redis_url, self.redis = redis_url, None
        args = list(serve_args) if serve_args is not None else ["--model", DEFAULT_MODEL]
        self.nodes = [Node(i, self.directory / f"node{i}", args) for i in range(nodes)]
        self.haproxy: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The balancer's OpenAI API base URL."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def config_path(self) -> Path:
        return self.directory / "haproxy.cfg"

    @property
    def stats_socket(self) -> Path:
        return self.directory / "haproxy.sock"

    def balancer_stats(self) -> dict[str, dict[str, str]]:
        """HAProxy's counters for each node, by name (``show stat``): ``status``, ``stot`` (requests),
        ``wretr`` (retries on it), ``wredis`` (requests sent elsewhere after failing on it), ..."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.stats_socket))
            s.sendall(b"show stat\n")
            data = b"".join(iter(lambda: s.recv(65536), b""))
        rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "nodes" and r["svname"] not in ("FRONTEND", "BACKEND")}

    def start(self) -> Fleet:
        why = haproxy_missing()
        if why:
            raise InvalidRequestError(why)
        check_free(self.host, self.port, "the balancer")
        if self.redis_url is not None:
            from ..storage.redis_store import RedisChunkStore  # imports torch: not at the top (hcache fleet --help)

            RedisChunkStore.from_url(self.redis_url).ping()
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            if self.redis_url is None:
                self.redis = _start_redis()
                self.redis_url = self.redis.url
            for node in self.nodes:
                node.serve_args = [*node.serve_args, "--gpu-cache", "--shared", self.redis_url]
                node.start()
            pool = ThreadPoolExecutor(len(self.nodes))
            try:  # the first node that fails stops the start (stop() then ends the others' waits too)
                for ready in as_completed([pool.submit(n.wait_ready) for n in self.nodes]):
                    ready.result()
            finally:
                pool.shutdown(wait=False)
            self._start_haproxy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_haproxy(self) -> None:
        servers = [f"    server {n.name} {n.host}:{n.ports['openai']}" for n in self.nodes]
        template = Template((Path(__file__).parent / "haproxy.cfg").read_text())
        self.config_path.write_text(
            template.substitute(
                bind=f"{self.host}:{self.port}",
                servers="\n".join(servers),
                tracking_servers="\n".join(f"{s} track nodes/{n.name}" for s, n in zip(servers, self.nodes)),
                timeout_s=TIMEOUT_S,
                stats_socket=self.stats_socket.resolve(),
            )
        )
        check = subprocess.run(
            ["haproxy", "-c", "-q", "-f", str(self.config_path)], check=False, capture_output=True, text=True
        )
        if check.returncode:
            raise InvalidRequestError(f"HAProxy refused {self.config_path}: {check.stdout}{check.stderr}")
        with open(self.directory / "haproxy.log", "ab") as log:
            self.haproxy = subprocess.Popen(  # its own session, as the nodes': the fleet stops it after they drain
                ["haproxy", "-db", "-f", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while not self._routes():
            if self.haproxy.poll() is not None or time.monotonic() > deadline:
                tail = (self.directory / "haproxy.log").read_text(errors="replace")[-2000:]
                raise InvalidRequestError(f"HAProxy did not start on {self.host}:{self.port}: {tail}")
            time.sleep(0.2)

    def restart(self, node: Node, seconds: float = START_S) -> int | None:
        """One step of a rolling restart: drain and stop ``node``, start it again, and wait until the balancer
        routes to it again, so that the next node may go (two out at once could leave a conversation's turn
        no node). Returns its exit status."""
        status = node.stop()
        node.start()
        node.wait_ready(seconds)
        deadline = time.monotonic() + seconds
        while self.balancer_stats()[node.name]["status"] != "UP":
            if time.monotonic() > deadline:
                raise InvalidRequestError(f"the balancer did not take {node.name} back within {seconds:g} s")
            time.sleep(0.2)
        return status

    def node(self, name: str) -> Node:
        """The node called ``name`` (as the balancer's ``X-Hcache-Node`` header names it)."""
        return next(n for n in self.nodes if n.name == name)

    def node_for(self, session: str) -> str:
        """The node the balancer sends ``session``'s requests to now (asked with a ``GET /health``)."""
        request = urllib.request.Request(f"http://{self.host}:{self.port}/health", headers={SESSION_HEADER: session})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.headers[NODE_HEADER]

    def _routes(self) -> bool:
        """Whether the balancer passes a request to a node (its first health checks have run)."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def describe(self) -> str:
        """Where everything is, for the operator."""
        lines = [f"redis: {self.redis_url}" + (" (started by the fleet, kept in memory only)" if self.redis else "")]
        for n in self.nodes:
            lines.append(
                f"{n.name}: OpenAI API {n.url}/v1  metrics {n.metrics_url}  log {n.output}  requests {n.request_log}"
            )
        lines.append(
            f"balancer: {self.url}/chat/completions  (HAProxy, {self.config_path}); "
            f"send the header {SESSION_HEADER}: <conversation id> to keep a conversation on one node"
        )
        return "\n".join(lines)

    def stop(self) -> None:
        """Drain every node at once (each finishes its requests and stores what it saved), then stop the
        balancer and the Redis server the fleet started."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(Node.stop, self.nodes))
        if self.haproxy is not None:
            self.haproxy.terminate()
            self.haproxy.wait(30)
            self.haproxy = None
        if self.redis is not None:
            self.redis.close()
            self.redis = None

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _start_redis():
    from ..storage.redis_server import RedisServer

    try:
        return RedisServer().start()
    except StorageError as exc:
        raise StorageError(f"{exc}; or give the URL of a running server with --redis") from None
