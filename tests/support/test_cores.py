"""The suite's lock on the cores (:mod:`support.cores`): timed work waits for the tests running in other
workers, and no test starts while it runs. Each holder here is a process of its own, as a worker is."""

import select
import subprocess
import sys
import time
from pathlib import Path

from support import cores

# Takes the lock ("shared" or "alone"), says so, and holds it until its stdin closes.
HOLDER = """
import sys
from support import cores
with getattr(cores, sys.argv[1])():
    print("holding", flush=True)
    sys.stdin.read()
"""


def _holder(kind: str, locks: Path) -> subprocess.Popen:
    env = {cores.LOCKS_ENV: str(locks), "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, kind], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _holds_within(holder: subprocess.Popen, seconds: float) -> bool:
    """Whether ``holder`` said it holds the lock within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _said(holder):
            return True
        time.sleep(0.05)
    return False


def _said(holder: subprocess.Popen) -> bool:
    return bool(select.select([holder.stdout], [], [], 0)[0]) and holder.stdout.readline() == "holding\n"


def _release(holder: subprocess.Popen) -> None:
    holder.stdin.close()
    assert holder.wait(10) == 0


def test_timed_work_waits_for_the_tests_running_and_none_starts_while_it_runs(tmp_path):
    first, second = _holder("shared", tmp_path), _holder("shared", tmp_path)
    assert _holds_within(first, 30) and _holds_within(second, 30)  # tests share the cores
    timed = _holder("alone", tmp_path)
    assert not _holds_within(timed, 1.0)
    _release(first)
    assert not _holds_within(timed, 0.5)  # one test still runs
    _release(second)
    assert _holds_within(timed, 30)
    later = _holder("shared", tmp_path)
    assert not _holds_within(later, 1.0)
    _release(timed)
    assert _holds_within(later, 30)
    _release(later)
