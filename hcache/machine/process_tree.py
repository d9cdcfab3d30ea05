"""The processes a process started, found and ended together.

MII's server processes each lead a session of their own (so that Ctrl-C reaches only the serving process),
and DeepSpeed's launcher starts the model server under itself: ending the process hcache started ends
neither. Zombies never count as running: a container's init may reap them late.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every process under it; nothing once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def descendants(pid: int) -> list[psutil.Process]:
    """Every process under ``pid``, found now: taken before ``pid`` ends, they can be ended after it."""
    return tree(pid)[1:]


Leader = int | subprocess.Popen  # a session, by its leader: a pid, or a process this one started


def _sid(leader: Leader) -> int:
    """The session's id, its leader's pid. A leader this process started is reaped once it has exited, not
    left a zombie."""
    if isinstance(leader, subprocess.Popen):
        leader.poll()
        return leader.pid
    return leader


def session(leader: Leader) -> list[psutil.Process]:
    """The running processes of ``leader``'s session, wherever in the tree they are."""
    sid, found = _sid(leader), []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == sid:
                found.append(p)
        except OSError:
            pass
    return found


def running(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running."""
    found = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def kill(processes: Iterable[psutil.Process]) -> None:
    """SIGKILL each of ``processes`` still there."""
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def signal_session(leader: Leader, sig: int) -> None:
    """Send ``sig`` to every process of ``leader``'s session (its process group), if any is left."""
    try:
        os.killpg(_sid(leader), sig)
    except ProcessLookupError:
        pass


def end_sessions(leaders: list[Leader], grace_s: float = 5.0) -> None:
    """SIGTERM every process of these sessions, and SIGKILL what is left ``grace_s`` later; returns once
    none runs, or ``grace_s`` after the SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for leader in leaders:
            signal_session(leader, sig)
        wait(lambda: not any(session(leader) for leader in leaders), grace_s)


def wait(done, seconds: float, poll_s: float = 0.1) -> bool:
    """Poll ``done()`` until it is true or ``seconds`` have passed; whether it was."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def exit_now() -> None:
    """End this process at once, its output flushed, skipping the interpreter's teardown: for a server
    process whose state is stored and closed by the time its server returns. The teardown (joining gRPC's
    handler threads, which MII's server gives 10 s; torch's) took 3 s of a model server's stop under load."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
