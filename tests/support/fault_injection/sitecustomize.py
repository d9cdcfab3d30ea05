"""Fault injection for tests/mii/test_mii.py: with ``HCACHE_TEST_FAULT_TOKEN`` set, the reference engine's forward
raises for any batch holding that token id, in every process started with this directory on PYTHONPATH
(Python imports ``sitecustomize`` at start-up), MII's server processes included."""

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
