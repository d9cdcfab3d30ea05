"""Where hcache's helper threads run: the store's readers and writers, the saver's packer and the paged
loader. By default they run wherever the thread that starts them may. An engine that binds its compute
threads to cores (vLLM's CPU worker binds OpenMP's, one per core, and leaves the rest to its other
processes) names the cores left over (:func:`run_on`), so that hcache's copies, checksums and disk writes
do not preempt the forward's threads: an OpenMP forward stalls at its barriers on any core that is taken.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

_cpus: frozenset[int] = frozenset()


def run_on(cpus: Iterable[int]) -> None:
    """Helper threads started from now on run on ``cpus`` (none: wherever they may)."""
    global _cpus
    _cpus = frozenset(cpus)


def executor(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` helper threads named ``name``-N, on the cores :func:`run_on` named."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_bind)


def _bind() -> None:
    if _cpus:
        os.sched_setaffinity(0, _cpus)
