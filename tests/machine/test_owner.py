"""A server process ends with its owner, whichever way the owner ends, SIGKILL to its process group included."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from hcache import cli
from hcache.errors import InvalidRequestError
from hcache.machine import owner
from hcache.machine.ports import free_port
from hcache.machine.process_tree import wait

# The owner starts a server in a session of its own (as hcache serve starts MII's), prints its pid and waits.
OWNER = """
import subprocess, sys, time
from hcache.machine.owner import owned_by_this_process
import os
server = "from hcache.machine.owner import end_with_owner; end_with_owner(); import time; time.sleep(120)"
env = {**os.environ, **(owned_by_this_process() if sys.argv[1] == "owned" else {})}
child = subprocess.Popen([sys.executable, "-c", server], env=env, start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _server_after_killing_its_owners_group(owned: str) -> psutil.Process:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, owned], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    server = psutil.Process(int(owner.stdout.readline()))
    time.sleep(1)  # the server's watch has started
    os.killpg(owner.pid, signal.SIGKILL)
    owner.wait()
    return server


def test_a_server_ends_once_its_owners_process_group_is_killed():
    server = _server_after_killing_its_owners_group("owned")
    assert wait(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, 10)


def test_a_server_named_no_owner_runs_on_as_before():
    server = _server_after_killing_its_owners_group("not owned")
    try:
        time.sleep(2)
        assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    finally:
        server.kill()


def test_the_watch_outlasts_a_clock_step_and_ends_once_its_owner_exits(monkeypatch, capfd):
    """A start time taken from the wall clock moves with it (NTP): once, a step made a running owner look gone.
    Here every start time psutil gives is a minute late, as after a step between the owner's start and its
    server's: the watch, which reads the kernel's start in ticks, waits on; then says why it ends the group."""
    started_owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    started = owner._started(started_owner.pid)
    create_time = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: create_time(self) + 60.0)
    monkeypatch.setattr(owner, "POLL_S", 0.05)
    monkeypatch.setattr(owner, "KILL_AFTER_S", 0.0)
    signals = []
    monkeypatch.setattr(os, "killpg", lambda group, sig: signals.append(sig))  # not this test's process group
    watch = threading.Thread(target=owner._watch, args=(started_owner.pid, started), daemon=True)
    watch.start()
    try:
        time.sleep(0.5)
        assert signals == [] and watch.is_alive()
        started_owner.stdin.close()
        started_owner.wait()
        watch.join(10)
        assert signals == [signal.SIGTERM, signal.SIGKILL]
        said = f"hcache: the process that started this server (pid {started_owner.pid}) has ended; so does this server"
        assert said in capfd.readouterr().err
    finally:  # the watch ends while os.killpg is still the stand-in
        started_owner.kill()
        started_owner.wait()
        watch.join(10)


def test_a_reused_pid_is_not_the_owner():
    """The pid of this process, named with another start, is an owner gone: its server does not serve on."""
    assert owner._running(os.getpid(), owner._started(os.getpid()))
    assert not owner._running(os.getpid(), owner._started(os.getpid()) - 1)


def test_hcache_serve_called_in_this_process_leaves_it_owning_nothing_after(tmp_path, monkeypatch):
    """Once ``run`` left its owner in this process's environment: a test calling it made pytest the owner
    of every server started later."""
    from hcache.mii import deployment

    monkeypatch.delenv(owner.OWNER_ENV, raising=False)
    (tmp_path / "config.json").write_text("{}")
    owners = []

    def serve(*args, **kwargs):
        owners.append(os.environ[owner.OWNER_ENV])
        raise InvalidRequestError("stopped before starting anything")

    monkeypatch.setattr(deployment, "serve", serve)
    ports = [arg for flag in ("--port", "--zmq-port", "--rest-port") for arg in (flag, str(free_port()))]
    assert cli.main(["serve", "--model", str(tmp_path), "--engine", "reference", "--metrics-port", "0", *ports]) == 2
    assert owners == [owner.owned_by_this_process()[owner.OWNER_ENV]]
    assert owner.OWNER_ENV not in os.environ
