"""A server process ends with its owner, whichever way the owner ends, SIGKILL to its process group included."""

import os
import signal
import subprocess
import sys
import time

import psutil

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
