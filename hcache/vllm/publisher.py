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

No vLLM engine means no vLLM KV cache groups either: the blocks are told in groups of hcache's own, one for
each kind of layer the model has (:func:`model_groups`), each named by vLLM's kind and window.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import KVCacheSpecKind

from ..config import KvEvents, ResolvedConfig
from ..model.spec import ModelSpec
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.host_tier import HostTier
from ..storage.residency import Kept, Residency
from .events import BlockEvents, Group, Roots
from .vllm_events import block_hasher, vllm_event

log = logging.getLogger(__name__)


def model_groups(config: ResolvedConfig, spec: ModelSpec, block_size: int, window_block: int) -> tuple[Group, ...]:
    """The KV cache groups an engine of ``spec`` under ``config`` names its blocks in, one for each kind of
    layer, in the order of its first layer: full attention (MLA's latent rows), each sliding window, the
    recurrent layers' state, whose block is a state checkpoint's (a multiple of ``block_size``, the hash
    block and every other group's block). ``window_block``: the engine's block, from whose boundary the
    window rule reads a window (:meth:`~hcache.config.ResolvedConfig.window_rule`)."""
    kinds: dict[tuple[KVCacheSpecKind, int | None], dict[int, Kept]] = {}
    for layer in range(spec.num_layers):
        window = spec.window(layer)
        if spec.is_recurrent(layer):
            kind = KVCacheSpecKind.MAMBA
        elif window is not None:
            kind = KVCacheSpecKind.SLIDING_WINDOW
        else:
            kind = KVCacheSpecKind.MLA_ATTENTION if spec.kv_lora_rank else KVCacheSpecKind.FULL_ATTENTION
        kinds.setdefault((kind, window), {})[layer] = config.kept(spec, layer)
    checkpoint = math.lcm(CHUNK_TOKENS * config.settings.state_every, block_size)
    return tuple(
        Group.of(g, checkpoint if kind is KVCacheSpecKind.MAMBA else block_size, kind.value, window, kept, window_block)
        for g, ((kind, window), kept) in enumerate(kinds.items())
    )


class TierEvents:
    """Publishes the changes of where ``store``'s chunks are held (None: no store; only the start's
    ``AllBlocksCleared``), keyed from ``fingerprint`` under ``namespace`` (the deployment's), in ``groups``
    (:func:`model_groups`), by ``settings``. :meth:`salted` notes a request's own namespace (its
    ``cache_salt``); :meth:`close` publishes what is left and stops the publisher.

    The events are drained and published by a thread of their own, not on the engine's steps: a chunk
    reaches the disk by a write-back that ends after the request that saved it, often when the node is idle
    and no step follows, and a router should learn of it then; the block hashing stays off the serving
    loop's thread too. The host tier tells each change with its lock held (:meth:`HostTier.follow`), so
    the change is only noted there and the thread woken."""

    def __init__(
        self,
        settings: KvEvents,
        fingerprint: str,
        namespace: str | None,
        store: HostTier | None,
        groups: Sequence[Group],
    ):
        init_none_hash(get_hash_fn_by_name(settings.prefix_caching_hash_algo))
        self.roots = Roots([fingerprint], namespace)
        hashing = block_hasher(settings.prefix_caching_hash_algo)
        self.events = BlockEvents(hashing, settings.block_size, 1, self.roots, groups)
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
            events = [vllm_event(event) for event in self.events.take()]
            if events:
                self._publisher.publish(KVEventBatch(ts=time.time(), events=events))
        except Exception:  # the node serves on; a router then scores it by what it was told before
            log.exception("hcache's KV cache events: a batch could not be published")
