"""Processes that end with the one that started them, though each leads a session of its own.

``hcache serve``'s servers lead sessions of their own (so that Ctrl-C reaches only ``hcache serve``, which
stops them in order): killing its process group, or SIGKILL, reached none of them, and they served on.
``prctl(PR_SET_PDEATHSIG)`` would reach only the process started (DeepSpeed's launcher), not the model server
two launchers below it, so each server process watches its owner (the process of that pid and start time: a
pid may be reused) and, once it is gone, ends its process group: SIGTERM, then SIGKILL ``KILL_AFTER_S`` later.
The stores' chunk files are published whole (written, synced, renamed), so such a stop tears none; what a model
server had not written yet is not stored."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

OWNER_ENV = "HCACHE_OWNER"  # "<pid>:<start time>" of the process whose servers end with it
POLL_S = 0.5
KILL_AFTER_S = 5.0
# psutil derives a start time from boot time and the clock, so an NTP step moves it: compared once, loosely
START_TOLERANCE_S = 2.0


def owned_by_this_process() -> dict[str, str]:
    """The environment entry that makes a server started with it end with this process."""
    return {OWNER_ENV: f"{os.getpid()}:{psutil.Process().create_time()!r}"}


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
        threading.Thread(target=_watch, args=(int(pid), float(started)), daemon=True, name="hcache-owner").start()


def _watch(pid: int, started: float) -> None:
    owner = _owner(pid, started)
    while owner is not None and _alive(owner):
        time.sleep(POLL_S)
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    time.sleep(KILL_AFTER_S)
    os.killpg(group, signal.SIGKILL)


def _owner(pid: int, started: float) -> psutil.Process | None:
    """The owner's process, if ``pid`` is still the one that started at ``started`` (a pid may be reused)."""
    try:
        owner = psutil.Process(pid)
        return owner if abs(owner.create_time() - started) <= START_TOLERANCE_S else None
    except psutil.NoSuchProcess:
        return None


def _alive(owner: psutil.Process) -> bool:
    # is_running compares the start time psutil read when it made ``owner`` (pid reuse), not a fresh one
    try:
        return owner.is_running() and owner.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
