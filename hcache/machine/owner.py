"""Processes that end with the one that started them, though each leads a session of its own.

``hcache serve``'s servers lead sessions of their own (so that Ctrl-C reaches only ``hcache serve``, which
stops them in order): killing its process group, or SIGKILL, reached none of them, and they served on.
``prctl(PR_SET_PDEATHSIG)`` would reach only the process started (DeepSpeed's launcher), not the model server
two launchers below it, so each server process watches its owner (the process of that pid and start: a pid may
be reused) and, once it is gone, ends its process group: SIGTERM, then SIGKILL ``KILL_AFTER_S`` later, and says
so on its stderr. The start is the kernel's, in clock ticks since boot, which no clock step moves: psutil's
start time adds the boot time, which moves with the wall clock (NTP), and a step once made a running owner look
gone. The stores' chunk files are published whole (written, synced, renamed), so such a stop tears none; what a
model server had not written yet is not stored."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

OWNER_ENV = "HCACHE_OWNER"  # "<pid>:<start in clock ticks>" of the process whose servers end with it
POLL_S = 0.5
KILL_AFTER_S = 5.0


def owned_by_this_process() -> dict[str, str]:
    """The environment entry that makes a server started with it end with this process."""
    pid = os.getpid()
    return {OWNER_ENV: f"{pid}:{_started(pid)}"}


@contextmanager
def owning() -> Iterator[None]:
    """:func:`owned_by_this_process` in the environment inside, as it was after: a caller in this process (a
    test calling ``hcache serve``'s ``run``) does not stay the owner of every process it starts later."""
    before = os.environ.get(OWNER_ENV)
    os.environ.update(owned_by_this_process())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OWNER_ENV, None)
        else:
            os.environ[OWNER_ENV] = before


def end_with_owner() -> None:
    """If the environment names an owner, end this process's group once the owner is gone (a daemon thread)."""
    given = os.environ.get(OWNER_ENV)
    if given:
        pid, started = given.split(":", 1)
        threading.Thread(target=_watch, args=(int(pid), int(started)), daemon=True, name="hcache-owner").start()


def _watch(pid: int, started: int) -> None:
    while _running(pid, started):
        time.sleep(POLL_S)
    print(f"hcache: the process that started this server (pid {pid}) has ended; so does this server", file=sys.stderr)
    sys.stderr.flush()
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    time.sleep(KILL_AFTER_S)
    os.killpg(group, signal.SIGKILL)


def _stat(pid: int) -> list[bytes]:
    """``/proc/<pid>/stat``'s fields from the third (the state) on: the second, the name, may hold spaces."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()


def _started(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (the stat file's 22nd field)."""
    return int(_stat(pid)[19])


def _running(pid: int, started: int) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` and has not ended (a zombie has)."""
    try:
        fields = _stat(pid)
    except OSError:  # gone
        return False
    return fields[0] != b"Z" and int(fields[19]) == started
