"""Fault injection in every process started with this directory on PYTHONPATH (Python imports
``sitecustomize`` at start-up), MII's server processes included: with ``HCACHE_TEST_FAULT_TOKEN`` set, the
reference engine's forward raises for any batch holding that token id (tests/mii/test_mii.py); with
``HCACHE_TEST_FAULT_AT_START`` set, the model server's engine fails to build with that message
(tests/mii/test_serve_command.py)."""

import os

from hcache.engine.reference import ReferenceEngine


def faulty(step, token: int):
    """``ReferenceEngine.step`` that raises for a batch holding ``token``."""

    def faulty_step(self, requests, capture=None):
        if any(token in tokens for _, tokens in requests):
            raise RuntimeError(f"injected fault: token {token} in the batch")
        return step(self, requests, capture)

    return faulty_step


if os.environ.get("HCACHE_TEST_FAULT_TOKEN"):
    ReferenceEngine.step = faulty(ReferenceEngine.step, int(os.environ["HCACHE_TEST_FAULT_TOKEN"]))


def failing_start(message: str):
    """``build_engine`` that raises as a store that cannot open does, in the model server as it starts."""

    def build_engine(model_config, hcache):
        from hcache.errors import StorageError

        raise StorageError(message)

    return build_engine


if os.environ.get("HCACHE_TEST_FAULT_AT_START"):
    import hcache.mii.engine_factory

    hcache.mii.engine_factory.build_engine = failing_start(os.environ["HCACHE_TEST_FAULT_AT_START"])
