"""The machine's cores to one piece of timed work at a time, under pytest-xdist's workers.

A bound on step times holds only with the cores to itself: beside another worker's engines on two cores, the
connector's loading steps took twice its other steps. So each test holds a shared lock while it runs (setup,
call and teardown: a module's engines start in its first test's setup; ``tests/conftest.py``), and timed work
takes it exclusive (:func:`alone`), waiting for the other workers' tests to end while they wait for it. A
turnstile keeps the shared holders from starving it. A test module whose timed work runs in a process it
starts (a vLLM session) is marked ``alone`` and holds no share itself, or its own process would wait on it.
Only stdlib here: ``vllm_session.py`` runs as a script. Without workers nothing is locked."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

LOCKS_ENV = "HCACHE_TEST_LOCKS"  # the directory of the locks, set by the workers' controller


@contextmanager
def _holding(exclusive: bool) -> Iterator[None]:
    directory = os.environ.get(LOCKS_ENV)
    if not directory:
        yield
        return
    with open(Path(directory, "turnstile"), "a") as turnstile, open(Path(directory, "cores"), "a") as cores:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(cores, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


def shared() -> AbstractContextManager[None]:
    """Held by every test but those marked ``alone``: timed work waits for it to end."""
    return _holding(exclusive=False)


def alone() -> AbstractContextManager[None]:
    """The cores to this work alone: once every other worker's test has ended, and none starts meanwhile."""
    return _holding(exclusive=True)
