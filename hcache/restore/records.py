"""What restores cost, per put and per sequence. A put's :class:`PutRestore` is filled once, then added to
its sequence's :class:`SequenceRecord` and to the counters (:meth:`~hcache.serving.metrics.ServingMetrics.add`),
so the two can never disagree."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from ..storage.chunk_store import Loss

GPU_CACHE = "gpu_cache"  # restored from the GPU prefix cache: the source above the host pool's (storage's ``Source``)


class MissReason(str, Enum):
    """Why stored tokens a put could have restored were computed instead, one reason per put: where its
    stored prefix ended. ``other_rank``: with tensor parallelism, another rank's prefix ended first (its
    own log says why). ``other_model``, ``other_cache_salt`` and ``other_layout``: the prefix's first chunk
    was saved under another fingerprint (another model, or weights, dtype or engine that round
    differently), under this model in another namespace, or in this namespace by this model at another
    tensor-parallel size (whose ranks hold other heads); the response's ``hcache`` object reports all
    three as ``never_stored`` (:meth:`SequenceRecord.reply`)."""

    NEVER_STORED = "never_stored"  # no tier holds it, and none of this process's evicted it: a first turn, or a prefix no one saved
    EVICTED = "evicted"  # a store of this process evicted it (quota, TTL or LRU), or it went between look-up and read
    FAILED_VERIFICATION = "failed_verification"  # checksum, length, key, tokens or fingerprint: discarded
    OTHER_VERSION = "other_version"  # another layout version's chunk (another hcache's): left alone
    OTHER_SETTINGS = "other_settings"  # saved without a format the plan restores from
    OUTSIDE_WINDOW = (
        "outside_window"  # a sliding-window layer's rows of the prefix's last window were not kept (planning/window.py)
    )
    NO_STATE = "no_state"  # no recurrent layer's state stored where the prefix would end (planning/checkpoints.py)
    OTHER_MODEL = "other_model"
    OTHER_CACHE_SALT = "other_cache_salt"
    OTHER_LAYOUT = "other_layout"
    TIER_UNAVAILABLE = "tier_unavailable"  # a tier could not be read (an I/O error, Redis down)
    OTHER_RANK = "other_rank"
    PLAN_RECOMPUTE = "plan_recompute"  # the plan recomputes every layer: stored state was not used

    # a reason reads as its value wherever it is printed, logged or a label, as it hashes and compares
    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def of(cls, loss: Loss) -> MissReason:
        """The miss a store's loss of a chunk makes (the store knows why it let a chunk go; a restore names
        the miss)."""
        return _MISS_OF_LOSS[loss]


_MISS_OF_LOSS = {Loss.EVICTED: MissReason.EVICTED, Loss.FAILED_VERIFICATION: MissReason.FAILED_VERIFICATION}


@dataclass
class RestoreStep:
    """One put's restore as a sequence's record lists it: the plan it followed, how many tokens it restored
    from the store, how many it adopted from the GPU prefix cache before, and the seconds of its disk reads
    that prefetch ran ahead."""

    plan: str
    tokens: int
    gpu_tokens: int = 0
    hidden_s: float = 0.0


@dataclass
class PutRestore:
    """Everything one put's restore did: tokens adopted from the GPU prefix cache, then tokens restored from
    the store by ``plan`` ("" if the store was not tried), and what that read and cost."""

    plan: str = ""
    tokens: int = 0  # restored from the store
    gpu_tokens: int = 0  # adopted from the GPU prefix cache, before
    hidden_s: float = 0.0  # seconds of its disk reads that prefetch ran ahead of it
    sources: dict[str, int] = field(default_factory=dict)  # of ``tokens``, by the tier their chunk was read from
    bytes_read: int = 0  # stored bytes copied from the host pool
    type_bytes: dict[str, int] = field(
        default_factory=dict
    )  # of ``bytes_read``, by layer type (full_attention, sliding_attention)
    gpu_bytes: int = 0  # KV bytes copied from the GPU prefix cache
    layer_tokens: dict[str, int] = field(default_factory=dict)  # tokens x layers, by method
    restore_s: float = 0.0
    fallback: str | None = None  # why stored state was used only in part, if it was
    lossy: bool = False  # some of it was stored in 8 bits, or adopted from a sequence that restored such
    misses: dict[MissReason, int] = field(default_factory=dict)  # stored-prefix tokens computed instead


@dataclass
class SequenceRecord:
    """What one sequence cost, summed over its puts: tokens restored (from the GPU prefix cache or the store)
    and run through the forward."""

    restored_tokens: int = 0
    gpu_tokens: int = 0  # of restored_tokens, adopted from the GPU prefix cache
    tier_tokens: dict[str, int] = field(
        default_factory=dict
    )  # of restored_tokens, read from the host pool and stores, by tier
    computed_tokens: int = 0
    bytes_read: int = 0
    type_bytes: dict[str, int] = field(default_factory=dict)  # of bytes_read, by layer type
    restore_s: float = 0.0
    prefetch_hidden_s: float = 0.0  # seconds of its restores' disk reads that prefetch ran ahead of them
    plan: str = ""  # the plan its restores follow; "" until one is tried
    fallback: str | None = None  # why stored state was used only in part, if it was
    lossy: bool = False  # restored state stored in 8 bits, or adopted from a sequence that restored such: not bit-identical to recompute
    restores: list[RestoreStep] = field(default_factory=list)  # one per put that restored tokens
    miss_tokens: dict[MissReason, int] = field(default_factory=dict)  # full-chunk tokens computed instead of restored

    def add(self, step: PutRestore) -> None:
        self.restored_tokens += step.gpu_tokens + step.tokens
        self.gpu_tokens += step.gpu_tokens
        self.tier_tokens = dict(Counter(self.tier_tokens) + Counter(step.sources))
        self.bytes_read += step.bytes_read
        self.type_bytes = dict(Counter(self.type_bytes) + Counter(step.type_bytes))
        self.restore_s += step.restore_s
        self.prefetch_hidden_s += step.hidden_s
        self.plan = step.plan or self.plan
        self.fallback = step.fallback or self.fallback
        self.lossy = self.lossy or step.lossy
        self.miss_tokens = dict(Counter(self.miss_tokens) + Counter(step.misses))
        if step.gpu_tokens or step.tokens:
            self.restores.append(RestoreStep(step.plan, step.tokens, step.gpu_tokens, step.hidden_s))

    def reply(self) -> dict:
        """What a response tells its client of its restore (the ``hcache`` object beside ``usage``): the
        request log's counts of the prompt's restore, with tokens by tier including the GPU prefix cache's
        (not the tokens computed: a streamed reply sends this while decoding goes on). Whether another model,
        tenant or layout stored the prompt is the operator's to know, not the client's (it would let a client
        probe what others sent): each reads ``never_stored`` here."""
        misses: Counter[MissReason] = Counter()
        for reason, tokens in self.miss_tokens.items():
            misses[_REPLIED.get(reason, reason)] += tokens
        tiers = {GPU_CACHE: self.gpu_tokens, **self.tier_tokens} if self.gpu_tokens else dict(self.tier_tokens)
        return {
            "restored_tokens": self.restored_tokens,
            "tier_tokens": tiers,
            "miss_tokens": dict(misses),
            "plan": self.plan,
            "lossy": self.lossy,
        }


_REPLIED = {
    reason: MissReason.NEVER_STORED
    for reason in (MissReason.OTHER_MODEL, MissReason.OTHER_CACHE_SALT, MissReason.OTHER_LAYOUT)
}


def log_requests(path: Path, records: Iterable[tuple[dict, SequenceRecord]]) -> None:
    """Append one JSON line per finished request to the request log at ``path``: its identity (``{"uid":
    ...}`` or ``{"request_id": ...}``), the time, and its record. The file is made 0600 whatever the umask,
    as the store's files: it holds token counts per conversation."""
    lines = [json.dumps({**who, "time": time.time(), **asdict(record)}) + "\n" for who, record in records]
    if lines:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
            f.write("".join(lines))
