"""``hcache serve``'s KV cache events: what its tiers hold, published over ZMQ by vLLM's own publisher in the
format vLLM's engines publish (``KVEventBatch``, msgpack), so that a router built for vLLM (Dynamo's KV
router, llm-d's prefix scorer) scores an ``hcache serve`` node as it scores a vLLM engine (the
``kv_events`` setting, :class:`~hcache.config.KvEvents`).

The events are those of vLLM's connector (:mod:`hcache.vllm.events`, :mod:`hcache.vllm.vllm_events`): vLLM's
blocks of ``block_size`` tokens, hashed with vLLM's function and seed, ``CPU`` for the host pool and
``STORAGE`` for the stores below it. No vLLM engine runs in this process, so the seed is set here
(``init_none_hash``): with sha256 and no ``PYTHONHASHSEED``, vLLM's fixed one, so a block's hash is the one
a vLLM engine (or a router hashing a prompt as vLLM does) computes. A chain is placed from where the serving
engine keys it (:class:`~hcache.vllm.events.Roots`): the model's fingerprint under the deployment's namespace
(announced with no ``cache_salt``), or under a request's own ``cache_salt`` once a request has used it.
"""

from __future__ import annotations

import logging
import threading
import time

from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash

from ..config import KvEvents
from ..storage.host_tier import HostTier
from ..storage.residency import Residency
from .events import BlockEvents, Roots
from .vllm_events import block_hasher, vllm_event

log = logging.getLogger(__name__)


class TierEvents:
    """Publishes the changes of where ``store``'s chunks are held (None: no store; only the start's
    ``AllBlocksCleared``), keyed from ``fingerprint`` under ``namespace`` (the deployment's), by
    ``settings``. :meth:`salted` notes a request's own namespace (its ``cache_salt``); :meth:`close` publishes
    what is left and stops the publisher.

    The events are drained and published by a thread of their own, not on the engine's steps: a chunk
    reaches the disk by a write-back that ends after the request that saved it, often when the node is idle
    and no step follows, and a router should learn of it then; the block hashing stays off the serving
    loop's thread too. The host tier tells each change with its lock held (:meth:`HostTier.follow`), so
    the change is only noted there and the thread woken."""

    def __init__(self, settings: KvEvents, fingerprint: str, namespace: str | None, store: HostTier | None):
        self.block_size = settings.block_size
        init_none_hash(get_hash_fn_by_name(settings.prefix_caching_hash_algo))
        self.roots = Roots([fingerprint], namespace)
        self.events = BlockEvents(block_hasher(settings.prefix_caching_hash_algo), self.block_size, 1, self.roots)
        publishing = settings.model_dump(exclude={"block_size", "prefix_caching_hash_algo"})
        self._publisher = EventPublisherFactory.create(KVEventsConfig(**publishing))  # as vLLM's engine makes it
        self._changes: list[Residency] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        if store is not None:
            store.follow(self._note)  # what the disk and the pool hold now, then each change
        self._thread = threading.Thread(target=self._run, name="hcache-kv-events", daemon=True)
        self._thread.start()

    def salted(self, salt: str) -> None:
        """A request keyed under its own namespace: its chains are announced under that ``cache_salt``."""
        self.roots.salted(salt)

    def close(self) -> None:
        """Publish what the tiers told until now and stop the publisher (call after the store has closed, so
        that its last write-backs are told)."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._thread.join()
        self._publisher.shutdown()

    def _note(self, change: Residency) -> None:
        with self._lock:
            self._changes.append(change)
        self._wake.set()

    def _run(self) -> None:
        while True:  # the first pass publishes at once: AllBlocksCleared, and what the disk holds
            self._publish()
            if self._closing:
                self._publish()  # what was told while the last pass ran
                return
            self._wake.wait()

    def _publish(self) -> None:
        with self._lock:
            self._wake.clear()
            changes, self._changes = self._changes, []
        try:
            self.events.apply(changes)
            events = [vllm_event(event, self.block_size) for event in self.events.take()]
            if events:
                self._publisher.publish(KVEventBatch(ts=time.time(), events=events))
        except Exception:  # the node serves on; a router then scores it by what it was told before
            log.exception("hcache's KV cache events: a batch could not be published")
