"""``hcache serve`` as a command: a model server that fails as it starts ends it with that server's one line;
its servers end with it, killed with its process group included (each leads a session of its own); and what
it saved is stored whole when it stops, though its processes skip the interpreter's teardown."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from support import FAULT_DIR, REPO

from hcache.cli import main
from hcache.machine import process_tree
from hcache.machine.ports import free_port

pytestmark = pytest.mark.slow


def _serve(tmp_path, env: dict, rest_port: int | None = None, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "hcache", "serve", "--engine", "reference", "--metrics-port", "0"]
    command += ["--store-dir", str(tmp_path / "store"), "--rest-port", str(rest_port or free_port())]
    for flag in ("--port", "--zmq-port", "--dist-port"):
        command += [flag, str(free_port())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAULT_DIR, str(REPO)]), **env)
    return subprocess.Popen(command, env=env, text=True, **popen)


def _servers_while_running(serve: subprocess.Popen, until) -> list:
    """The processes under ``serve``, gathered until ``until()`` or its exit."""
    seen = {}
    deadline = time.monotonic() + 400
    while serve.poll() is None and not until():
        seen.update({p.pid: p for p in process_tree.descendants(serve.pid)})
        assert time.monotonic() < deadline, "hcache serve neither served nor exited"
        time.sleep(0.5)
    return list(seen.values())


def test_a_model_server_failing_as_it_starts_ends_hcache_serve_with_its_one_line(tmp_path):
    """Once a RuntimeError's traceback naming no reason (the server's own traceback above it), exit status 1."""
    serve = _serve(tmp_path, {"HCACHE_TEST_FAULT_AT_START": "injected: the store cannot open"}, stderr=subprocess.PIPE)
    try:
        servers = _servers_while_running(serve, lambda: False)
        errors = serve.stderr.read()
        assert serve.wait() == 2, errors
        assert re.fullmatch(
            r"hcache: error: the model server exited with status \d+ while starting: injected: the store cannot open",
            errors.strip().splitlines()[-1],
        ), errors
        assert "Traceback" not in errors, errors
        assert servers and process_tree.wait(lambda: not process_tree.running(servers), 10)
    finally:
        serve.kill()


def test_killing_hcache_serves_process_group_ends_its_servers(tmp_path):
    """Once the load balancer, REST gateway and model server served on, each in a session of its own."""
    out = tmp_path / "serve.out"
    with open(out, "w") as output:
        serve = _serve(tmp_path, {}, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    servers = []
    try:
        servers = _servers_while_running(serve, lambda: "serving; Ctrl-C stops" in out.read_text())
        assert serve.poll() is None, out.read_text()[-3000:]
        servers = process_tree.running(servers + process_tree.descendants(serve.pid))
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait()
        assert servers and process_tree.wait(lambda: not process_tree.running(servers), 15), [
            p.cmdline()[:4] for p in process_tree.running(servers)
        ]
    finally:
        process_tree.kill(process_tree.running(servers))


def test_what_a_model_server_saved_is_stored_whole_once_hcache_serve_has_stopped(tmp_path, capsys):
    """A 300-token conversation answered, then SIGTERM at once: its chunks were being written back as the
    stop began. The server processes end at once once MII's server returns (no interpreter teardown), so
    this checks the model server has written them all by then, each verified, none torn."""
    out, rest = tmp_path / "serve.out", free_port()
    with open(out, "w") as output:
        serve = _serve(tmp_path, {}, rest_port=rest, stdout=output, stderr=subprocess.STDOUT)
    try:
        _servers_while_running(serve, lambda: "serving; Ctrl-C stops" in out.read_text())
        body = {"prompts": ["The history of the city, told at length. " * 30], "max_new_tokens": 4}
        request = urllib.request.Request(
            f"http://localhost:{rest}/mii/hcache", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            assert json.load(reply)[0]["generated_length"] == 4
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 0, out.read_text()[-3000:]
    finally:
        serve.kill()
    assert main(["store", "verify", str(tmp_path / "store")]) == 0
    verified = capsys.readouterr().out
    found = re.search(r"verified (\d+) chunks in .*: (\d+) good, 0 bad", verified)
    assert found and int(found[1]) == int(found[2]) >= 4, verified  # 300-odd tokens: four 64-token chunks at least
