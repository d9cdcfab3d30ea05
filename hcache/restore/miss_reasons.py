"""Why stored tokens were computed instead of restored: the one set of rules every engine's restore asks
(the DeepSpeed path's, vLLM's scheduler and loads), so a miss reads the same in every request log
(:class:`~hcache.restore.records.MissReason`)."""

from __future__ import annotations

import hashlib

from ..model.tensor_parallel import model_fingerprint
from ..storage.anchor_log import AnchorLog
from ..storage.chunk_key import KeyChain, content_key
from ..storage.host_tier import HostTier
from .records import MissReason


def lookup_miss(tier: HostTier, key: str, *, seen: bool = False) -> MissReason:
    """Why no tier served the chunk ``key``, the one rule every engine's restore asks: a store that could
    hold it is failing; a store lost it, and knows why (evicted it, or found it bad: at start-up, on a read,
    or its file's length changed); a look-up had ``seen`` it, so it went since (another process deleted
    it); or no one stored it."""
    if not all(store.available for store in tier.stores):
        return MissReason.TIER_UNAVAILABLE
    return _lost(tier, key) or (MissReason.EVICTED if seen else MissReason.NEVER_STORED)


def _lost(tier: HostTier, key: str) -> MissReason | None:
    """Why a store lost the chunk ``key``, if one knows."""
    for store in tier.stores:
        why = store.gone(key)
        if why is not None:
            return MissReason.of(why)
    return None


def anchor_label(fingerprint: str, namespace: str | None) -> str:
    """A chain's root as the anchor log files it: the fingerprint, then the namespace hashed (a tenant's
    ``cache_salt`` may be a secret)."""
    return f"{fingerprint}/{hashlib.blake2b((namespace or '').encode(), digest_size=8).hexdigest()}"


def first_chunk_miss(
    anchors: AnchorLog | None, label: str, chain: KeyChain, tokens: list[int], misses: dict[MissReason, int]
) -> dict[MissReason, int]:
    """``misses``, where a conversation's first chunk (``tokens`` from the first, ``chain`` holding no full
    chunk yet) was never stored under the root ``label`` names: told apart if the anchor log says it was
    stored in this namespace at another tensor-parallel layout, or under another namespace or model."""
    never = misses.get(MissReason.NEVER_STORED)
    if never is None or chain.chunks or anchors is None:
        return misses
    labels = anchors.labels(content_key(tokens))
    if not labels or label in labels:  # stored under its own root once: gone, as far as it can tell
        return misses
    fingerprint, _, namespace = label.rpartition("/")
    model = model_fingerprint(fingerprint)
    stored = [(model_fingerprint(f), n) for f, _, n in (other.rpartition("/") for other in labels)]
    if (model, namespace) in stored:  # its own root is not among them: another layout's
        return _relabel(misses, MissReason.OTHER_LAYOUT)
    same_model = any(m == model for m, _ in stored)
    return _relabel(misses, MissReason.OTHER_CACHE_SALT if same_model else MissReason.OTHER_MODEL)


def store_miss(tier: HostTier | None, key: str, misses: dict[MissReason, int]) -> dict[MissReason, int]:
    """``misses``, where a look-up made away from the stores (vLLM's scheduler reads the files, not the
    store's memory) said ``never_stored`` of the chunk ``key`` and the store knows it lost it (evicted it,
    or found it bad: at start-up, say)."""
    lost = _lost(tier, key) if tier is not None and MissReason.NEVER_STORED in misses else None
    return misses if lost is None else _relabel(misses, lost)


def _relabel(misses: dict[MissReason, int], reason: MissReason) -> dict[MissReason, int]:
    """``misses`` with its ``never_stored`` tokens counted under ``reason`` instead."""
    never = misses[MissReason.NEVER_STORED]
    return {**{r: n for r, n in misses.items() if r != MissReason.NEVER_STORED}, reason: never}
