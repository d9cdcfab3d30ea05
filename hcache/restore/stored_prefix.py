"""A restore's stored prefix: the chunks it reads, fetched, verified and accounted for by the same rules in
every engine: the DeepSpeed path's layer-by-layer restore (:func:`~hcache.serving.restore.restore_prefix`)
and vLLM's loads into its paged cache (:mod:`hcache.paged.loader`) each hold a :class:`StoredPrefix`.

Stored state is never trusted: a chunk that is missing, unreadable, saved by another model, for other
tokens, or that fails its checksum ends the usable prefix there, and the engine computes the rest.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..model.spec import ModelSpec
from ..model.tensor_parallel import SINGLE, TPGroup
from ..ops.quant import SCALE_DTYPE
from ..planning.checkpoints import StateRule
from ..planning.plan import Method, RestorePlan, row_shapes
from ..planning.window import WindowRule
from ..storage.chunk import ChunkImage, ChunkInvalid, ChunkLayout
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.host_tier import HostTier
from ..storage.stored_state import STATE, STATE_DTYPE, is_encoded, scale_format, scale_shape, stores
from .miss_reasons import lookup_miss
from .records import MissReason, PutRestore

log = logging.getLogger(__name__)


@dataclass
class RestoreOutcome:
    tokens: int  # tokens whose KV is now in the cache, after those the sequence held
    bytes_read: int  # bytes of the stored tensors the restore copied from (whole 64-row tensors)
    fallback: str | None  # why stored state stopped short of what the lookup found, if it did
    sources: dict[str, int] = field(
        default_factory=dict
    )  # tokens by where their chunk was read from (HostTier.take_source)
    lossy: bool = False  # some of it was stored in an 8-bit encoding
    misses: dict[MissReason, int] = field(default_factory=dict)  # full-chunk tokens wanted but not restored
    type_bytes: dict[str, int] = field(default_factory=dict)  # ``bytes_read`` by layer type (restore_accounting)
    windowed: bool = (
        False  # sliding-window layers were written from their window on only: the cache before it is not theirs
    )

    def record(self, step: PutRestore, plan: RestorePlan) -> None:
        """Fill ``step``, a put's record, with this restore from the store by ``plan``: the one accounting
        of every engine's restore (the DeepSpeed path's and vLLM's loader)."""
        step.plan, step.tokens, step.sources, step.bytes_read = (
            str(plan),
            self.tokens,
            dict(self.sources),
            self.bytes_read,
        )
        step.fallback, step.lossy, step.misses = self.fallback, step.lossy or self.lossy, dict(self.misses)
        step.type_bytes = dict(self.type_bytes)
        if plan.count(Method.RE) == len(plan.layers) and self.tokens:  # recomputed, not restored
            step.misses[MissReason.PLAN_RECOMPUTE] = self.tokens
        step.layer_tokens = {m.value: plan.count(m) * self.tokens for m in Method if plan.count(m)}


class StoredPrefix:
    """The chunks of ``keys`` one restore reads (``keys[0]`` is chunk ``first`` of its sequence): fetched
    into ``tier``'s host pool on its reader threads (:meth:`fetch`), verified in order into ``images``
    (:meth:`verify`), accounted for (:meth:`outcome`), and given back to the pool when the ``with`` block
    that holds it ends, by which time nothing may read them. ``fallback`` and ``miss`` say why the prefix
    ends where it does, once a reason is known."""

    def __init__(self, tier: HostTier, keys: list[str], first: int):
        self.tier, self.keys, self.first = tier, keys, first
        self.images: list[ChunkImage] = []
        self.fallback: str | None = None  # a message, where the prefix ends early for a reason worth one
        self.miss: MissReason | None = None
        self._fetches: list[Future] = []

    def __enter__(self) -> StoredPrefix:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._fetches:
            try:
                image = f.result()
            except BaseException:  # reported by verify, or the restore is failing anyway: release the rest
                continue
            if image is not None:
                self.tier.release(image)
        self._fetches = []

    def fetch(self, count: int) -> None:
        """Start reading the first ``count`` chunks into the host pool (a fetch that raises leaves those
        started before it to be released)."""
        self._fetches += (self.tier.fetch(key) for key in self.keys[len(self._fetches) : count])

    def short(self, fallback: str | None, miss: MissReason | None) -> None:
        """A reason the prefix ends early, unless one was found first."""
        self.fallback, self.miss = self.fallback or fallback, self.miss or miss

    def why_short(self) -> MissReason:
        """Why the prefix ends after ``images``: the reason found, else the tier's for the chunk past them
        (:func:`~hcache.restore.miss_reasons.lookup_miss`), kept: a reason noted after this one is not taken."""
        if self.miss is None:
            self.miss = lookup_miss(self.tier, self.keys[len(self.images)])
        return self.miss

    def outcome(
        self,
        spec: ModelSpec,
        reads: dict[tuple[int, str], range],
        restored: int,
        start: int,
        stop: int,
        missed: int,
        windowed: bool = False,
    ) -> RestoreOutcome:
        """The restore's outcome: the first ``restored`` of ``images`` gave positions ``[start, stop)`` of the
        sequence, by the chunks each ``(layer, format)`` ``reads``; ``missed``: the full-chunk tokens wanted
        past ``stop``."""
        read, lossy = restore_accounting(spec, self.images, reads, restored)
        sources = tokens_by_source(self.tier, self.images[:restored], self.first, start, stop)
        misses = {self.why_short(): missed} if missed else {}
        return RestoreOutcome(stop - start, sum(read.values()), self.fallback, sources, lossy, misses, read, windowed)

    def verify(
        self,
        tokens: list[int],
        fingerprint: str,
        plan: RestorePlan,
        spec: ModelSpec,
        rule: WindowRule,
        end: Callable[[int], int],
        tp: TPGroup = SINGLE,
        count: int | None = None,
        states: StateRule | None = None,
    ) -> None:
        """Take into ``images`` the fetched chunks (the first ``count``, by default all), in order, up to the
        first that is missing, bad, or short of a format ``plan`` restores from, and then no further than the
        last whose sliding-window layers find their window stored by ``rule``
        (:meth:`~hcache.planning.window.WindowRule.usable`; ``end(m)``: the sequence's length once ``m``
        chunks are restored), nor past the last that holds the recurrent layers' state at the prefix's end
        (``states``, by default a state every chunk: :meth:`~hcache.planning.checkpoints.StateRule.usable`);
        and note why the prefix ends there. ``tokens``: the sequence's, from the first chunk's first on;
        ``tp``: the rank whose share of each chunk is checked."""
        self.short(*self._verified(tokens, fingerprint, plan, spec, rule, end, tp, count))
        states = states or StateRule(spec)
        layers = [layer for layer, m in enumerate(plan.layers) if m is not Method.RE]
        verified = len(self.images)
        usable = states.usable(layers, self.first, verified, end, lambda j, layer: self.images[j].has(layer, STATE))
        if usable < verified:
            del self.images[usable:]  # still fetched: released with the rest
            reason = (
                f"the recurrent layers' state is kept at chunk ends only (every {states.every}), and none is stored "
                f"at token {end(verified)}; restoring {end(usable)} tokens"
            )
            log.info("%s", reason)
            self.short(reason, MissReason.NO_STATE)

    def _verified(
        self,
        tokens: list[int],
        fingerprint: str,
        plan: RestorePlan,
        spec: ModelSpec,
        rule: WindowRule,
        end: Callable[[int], int],
        tp: TPGroup,
        count: int | None,
    ) -> tuple[str | None, MissReason | None]:
        stored = {
            (layer, STATE if spec.is_recurrent(layer) else m.stored_format)
            for layer, m in enumerate(plan.layers)
            if m is not Method.RE
        }
        shapes, dtype = row_shapes(spec), spec.torch_dtype
        # The tensors a chunk must hold, by which TP rank owns its H; chunks share a few layouts, each checked once.
        # A sliding-window layer's are checked if present, and wanted only in the window (below); a recurrent
        # layer's state only in the prefix's last chunk (:meth:`verify`).
        needs = [
            {(layer, fmt) for layer, fmt in stored if stores(tp.rank, tp.world_size, r, fmt)}
            for r in range(tp.world_size)
        ]
        optional = {(layer, fmt) for layer, fmt in stored if rule.window(layer) is not None or fmt == STATE}
        checked: dict[tuple, tuple[str | None, list[str]]] = {}
        for j, (key, f) in enumerate(zip(self.keys, self._fetches[:count])):
            try:
                image = f.result()
                if image is None:  # gone since the lookup, or its tier failed: the prefix ends here
                    log.info("chunk %s is gone since the lookup; recomputing from token %d", key, j * CHUNK_TOKENS)
                    return None, lookup_miss(self.tier, key, seen=True)
                image.check(tokens[j * CHUNK_TOKENS : (j + 1) * CHUNK_TOKENS], fingerprint)
                r = (self.first + j) % tp.world_size
                if (image.layout.signature, r) not in checked:
                    checked[(image.layout.signature, r)] = _layout_problems(
                        image.layout, needs[r], optional, shapes, dtype
                    )
                wrong, missing = checked[(image.layout.signature, r)]
                if wrong is not None:
                    raise ChunkInvalid(f"chunk {key}: {wrong}")
            except (ChunkInvalid, OSError) as exc:
                return _reject(self.tier, key, j, exc)
            if missing:
                reason = f"chunk {key} was saved without {missing} state that plan {plan} needs"
                log.info("%s; recomputing from token %d", reason, j * CHUNK_TOKENS)
                return reason, MissReason.OTHER_SETTINGS
            self.images.append(image)
        verified = len(self.images)
        layer_format = dict(stored)
        usable = rule.usable(
            sorted(layer_format),
            self.first,
            verified,
            end,
            lambda j, layer: self.images[j].has(layer, layer_format[layer]),
        )
        if usable == verified:
            return None, None
        del self.images[usable:]  # still fetched: released with the rest
        reason = (
            f"the sliding-window layers' rows before token {end(verified)} were not kept (saved more than a window before "
            f"where their conversation was saved); restoring {end(usable)} tokens"
        )
        log.info("%s", reason)
        return reason, MissReason.OUTSIDE_WINDOW


def restore_accounting(
    spec: ModelSpec, images: list[ChunkImage], reads: dict[tuple[int, str], range], restored: int
) -> tuple[dict[str, int], bool]:
    """The bytes a restore read (whole 64-row tensors, scales included), by layer type
    (:meth:`ModelSpec.layer_type`), and whether the first ``restored`` chunks gave it any 8-bit state;
    ``reads``: the chunks each ``(layer, format)`` read (those past ``images``, another TP rank's, were not).
    Counted per distinct layout and range of chunks, not per chunk and layer: chunks laid out alike share
    their layout, and layers of a type read alike."""
    used: Counter[str] = Counter()
    lossy = False
    groups: dict[tuple, list[int]] = {}
    for (layer, fmt), chunks in reads.items():
        chunks = range(chunks.start, min(chunks.stop, len(images)), chunks.step)
        groups.setdefault((fmt, spec.layer_type(layer), chunks), []).append(layer)
    for (fmt, kind, chunks), layers in groups.items():
        for layout, count in Counter(images[j].layout for j in chunks).items():
            used[kind] += count * sum(_nbytes(layout, layer, fmt) for layer in layers)
        for layout in {images[j].layout for j in chunks if j < restored}:
            lossy = lossy or any(is_encoded(layout.entries[(layer, fmt)].dtype) for layer in layers)
    return dict(used), lossy


def tokens_by_source(tier: HostTier, images: list[ChunkImage], first: int, start: int, end: int) -> dict[str, int]:
    """Tokens ``start``..``end`` of a sequence restored from ``images`` (chunk ``first + j`` of it each), by
    where each chunk was read from (:meth:`~hcache.storage.host_tier.HostTier.take_source`, once a chunk)."""
    sources: Counter[str] = Counter()
    for j, image in enumerate(images):
        lo, hi = max(start, (first + j) * CHUNK_TOKENS), min(end, (first + j + 1) * CHUNK_TOKENS)
        sources[tier.take_source(image)] += max(0, hi - lo)
    return dict(sources)


def _nbytes(layout: ChunkLayout, layer: int, fmt: str) -> int:
    """Bytes a restore reads of one layer and format of a chunk, scales included."""
    entries = layout.entries
    return sum(entries[k].nbytes for k in ((layer, fmt), (layer, scale_format(fmt))) if k in entries)


def _layout_problems(
    layout: ChunkLayout, need: set[tuple[int, str]], optional: set[tuple[int, str]], shapes: dict, dtype: torch.dtype
) -> tuple[str | None, list[str]]:
    """Why a chunk of ``layout`` cannot serve ``need``: a tensor of another shape or dtype than the model's,
    or 8-bit codes without their scales (a copy would broadcast or convert it: the chunk is bad), and the
    formats it lacks, but for the ``optional`` tensors (it is merely short)."""
    for layer, fmt in sorted(need & set(layout.entries)):
        entry = layout.entries[(layer, fmt)]
        exact = STATE_DTYPE if fmt == STATE else dtype  # a state is kept in float32, never encoded
        if entry.shape != (CHUNK_TOKENS, *shapes[fmt]) or not (
            entry.dtype == exact or (fmt != STATE and is_encoded(entry.dtype))
        ):
            want = [CHUNK_TOKENS, *shapes[fmt]]
            return f"L{layer}.{fmt} is {list(entry.shape)} {entry.dtype}, the model's is {want} {exact}", []
        scale = layout.entries.get((layer, scale_format(fmt)))
        if is_encoded(entry.dtype) and (
            scale is None or (scale.shape, scale.dtype) != ((CHUNK_TOKENS, *scale_shape(shapes[fmt])), SCALE_DTYPE)
        ):
            return f"L{layer}.{fmt} is stored in {entry.dtype} without fitting scales", []
    return None, sorted({str(fmt) for _, fmt in need - optional - set(layout.entries)})


def _reject(tier: HostTier, key: str, index: int, exc: ChunkInvalid | OSError) -> tuple[str, MissReason]:
    """Log and say why the prefix ends here. A chunk proven bad is dropped, so the prefill that follows can
    save a good one; one that could not be read (an I/O error, perhaps passing), or of another layout
    version (another hcache's), is kept."""
    if isinstance(exc, OSError):
        reason = f"chunk {key}: cannot read ({exc})"
        log.warning("%s; recomputing from token %d", reason, index * CHUNK_TOKENS)
        return reason, MissReason.TIER_UNAVAILABLE
    if not exc.discard:
        log.warning("%s; leaving it and recomputing from token %d", exc, index * CHUNK_TOKENS)
        return str(exc), MissReason.OTHER_VERSION
    log.warning("%s; discarding it and recomputing from token %d", exc, index * CHUNK_TOKENS)
    try:
        tier.discard(key)
    except OSError as err:  # it stays unusable either way: it fails verification on every read
        log.warning("could not discard chunk %s: %s", key, err)
    return str(exc), MissReason.FAILED_VERIFICATION
