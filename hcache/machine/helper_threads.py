"""Where hcache's helper threads run: the store's readers and writers, the saver's packer and the paged
loader (and the loader's process, :func:`bind_process`). By default they run wherever the thread that
starts them may, at its priority. An engine that binds its compute threads to cores (vLLM's CPU worker binds OpenMP's, one per
core, and leaves the rest to its other processes) names the cores left over (:func:`run_on`), so that
hcache's copies, checksums and disk writes do not preempt the forward's threads: an OpenMP forward stalls
at its barriers on any core that is taken. The cores left over are where the engine's own other processes
run (vLLM's scheduler and its API process), and each step waits on them too: so the helpers there run at
the lowest priority (``nice`` 19), taking what those leave, as a background load should.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

LOWEST = 19  # the lowest ``nice``: the thread runs when no thread of a higher priority wants its core

_cpus: frozenset[int] = frozenset()
_nice = 0


def run_on(cpus: Iterable[int], nice: int = LOWEST) -> None:
    """Helper threads started from now on run on ``cpus`` (none: wherever they may, at their starter's
    priority) at ``nice`` (where ``cpus`` are named)."""
    global _cpus, _nice
    _cpus = frozenset(cpus)
    _nice = nice if _cpus else 0


def executor(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` helper threads named ``name``-N, on the cores :func:`run_on` named."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_bind)


def _bind() -> None:
    bind_process(threading.get_native_id())


def bind_process(tid: int) -> None:
    """Put thread or process ``tid`` (a helper hcache started; a process before it starts threads of its
    own, which take its CPUs) where the helper threads run, at their priority: Linux keeps both per
    thread."""
    if _cpus:
        os.sched_setaffinity(tid, _cpus)
    if _nice:
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), _nice))
