"""The balancer's routing, as ``Fleet`` renders ``haproxy.cfg``, in front of two stub nodes (HTTP servers in
this process that answer anything 200, or 503 once told to drain): a session's requests keep to one node,
requests without the header (or with it empty) alternate strictly between the nodes, and a node failing its
health check leaves both. Seconds, but it starts HAProxy: slow."""

import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise

import pytest

from hcache.fleet.nodes import NODE_HEADER, SESSION_HEADER, Fleet, haproxy_missing
from hcache.machine.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(haproxy_missing()), reason=f"{haproxy_missing()}")]


class _Stub(BaseHTTPRequestHandler):
    def do_GET(self):
        status = 503 if self.server.draining else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def balancer(tmp_path):
    fleet = Fleet(2, tmp_path, port=free_port())
    stubs = []
    for node in fleet.nodes:
        stub = ThreadingHTTPServer((node.host, node.ports["openai"]), _Stub)
        stub.draining = False
        threading.Thread(target=stub.serve_forever, daemon=True).start()
        stubs.append(stub)
    try:
        fleet._start_haproxy()  # the nodes are the stubs: no hcache serve, no Redis
        yield fleet, stubs
    finally:
        if fleet.haproxy is not None:
            fleet.haproxy.terminate()
            fleet.haproxy.wait(30)
        for stub in stubs:
            stub.shutdown()
            stub.server_close()


def _node(fleet: Fleet, session: str | None) -> str:
    headers = {SESSION_HEADER: session} if session is not None else {}
    request = urllib.request.Request(f"{fleet.url}/chat/completions", b"{}", headers)
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.headers[NODE_HEADER]


def test_sessions_keep_to_a_node_and_requests_without_one_alternate(balancer):
    fleet, _ = balancer
    sessions = [f"conversation-{i}" for i in range(20)]
    owners = [_node(fleet, s) for s in sessions]
    assert [_node(fleet, s) for s in sessions] == owners and set(owners) == {"node0", "node1"}
    for session in (None, ""):
        nodes = [_node(fleet, session) for _ in range(12)]
        assert all(a != b for a, b in pairwise(nodes)), nodes
        mixed = [_node(fleet, s) for pair in zip(sessions[:6], [session] * 6) for s in pair]
        assert mixed[::2] == owners[:6]  # the hashed requests leave the round robin's turn alone
        assert all(a != b for a, b in zip(mixed[1::2], mixed[3::2])), mixed


def test_a_draining_node_leaves_both_the_hash_and_the_round_robin(balancer):
    fleet, stubs = balancer
    stubs[1].draining = True  # its /health answers 503, as a draining node's does
    deadline = time.monotonic() + 15
    while fleet.balancer_stats()["node1"]["status"] != "DOWN":
        assert time.monotonic() < deadline, fleet.balancer_stats()["node1"]
        time.sleep(0.2)
    assert {_node(fleet, f"conversation-{i}") for i in range(20)} == {"node0"}
    assert {_node(fleet, None) for _ in range(6)} == {"node0"}
