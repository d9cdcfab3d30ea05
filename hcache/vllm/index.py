"""The scheduler's index of what hcache's worker can load, as vLLM's ``OffloadingManager`` keeps one: the
scheduler decides how much of a prompt to load before its worker, which owns the store, reads a byte.

The worker reports every chunk its tiers gain (saved, or loaded into its host pool), every chunk it
discards as bad (:meth:`~hcache.storage.host_tier.HostTier.watch`), and every chunk a load found gone,
through vLLM's worker-to-scheduler metadata, once a step. A look-up reads that index first, so what the
worker holds in memory is offered with no file-system or network call, even when its files are gone or
Redis is down. Past the indexed
prefix, the chunks this worker has not seen (those of a store another process wrote, or this one before a
restart) are asked of the stores (:class:`~hcache.storage.lookup.StoreLookup`), which stops at the first
chunk no tier holds. The index is where a request's lifecycle starts (its ``lookup``,
:mod:`hcache.vllm.scheduler`): what it finds, the workers then hold against eviction until it is loaded,
and the scheduler offers what they hold. It holds the latest ``HELD_KEPT`` chunks held, in bounded memory; one
it has forgotten is asked of the stores, as one it never saw.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..restore.records import MissReason
from ..storage.chunk_store import LossLog

if TYPE_CHECKING:  # built by the connector's settings (:meth:`~hcache.vllm.settings.VllmSetup.store_lookup`)
    from ..storage.lookup import StoreLookup


HELD_KEPT = 1 << 18  # chunks (16M tokens) the index remembers, about 40 MB of keys


class StoredIndex:
    """``lookup``: the stores' look-up for chunks the worker has not reported (None: there are none)."""

    def __init__(self, lookup: StoreLookup | None, kept: int = HELD_KEPT):
        self.lookup, self.kept = lookup, kept
        self._held: OrderedDict[str, None] = OrderedDict()  # least recently held or offered first
        self._gone: LossLog[MissReason] = LossLog(1 << 16)  # chunks reported gone: why a look-up ends at one

    def apply(self, changes: Sequence[tuple[str, MissReason | None]]) -> None:
        """The worker's changes, in the order they happened: (key, None) held, (key, reason) gone."""
        for key, reason in changes:
            if reason is None:
                self._hold(key)
                self._gone.pop(key)
            else:
                self._held.pop(key, None)
                self._gone.add(key, reason)

    def _hold(self, key: str) -> None:
        self._held[key] = None
        self._held.move_to_end(key)
        if len(self._held) > self.kept:
            self._held.popitem(last=False)

    def stored_prefix(self, keys: Sequence[str]) -> tuple[int, MissReason | None]:
        """How many of ``keys``, from the first, can be loaded, and why the prefix ends where it does (None
        when it covers them all). A chunk reported gone is not asked of the stores again until the worker
        holds it once more."""
        n = next((i for i, key in enumerate(keys) if key not in self._held), len(keys))
        for key in keys[:n]:  # offered: kept the longest
            self._held.move_to_end(key)
        if n < len(keys) and self.lookup is not None and keys[n] not in self._gone:
            n += self.lookup.stored_prefix(keys[n:])
        if n == len(keys):
            return n, None
        if keys[n] in self._gone:
            return n, self._gone.get(keys[n])
        if self.lookup is not None and not self.lookup.available:
            return n, MissReason.TIER_UNAVAILABLE
        return n, MissReason.NEVER_STORED

    def close(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
