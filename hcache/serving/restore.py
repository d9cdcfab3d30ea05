"""Restore a stored token prefix into an engine's KV cache, layer by layer, by a :class:`RestorePlan`.

Stored state is never trusted: a chunk that is missing, unreadable, saved by another model, for other
tokens, or that fails its checksum ends the usable prefix there. Tokens past that point are prefilled
from scratch, which is exact. A chunk found bad half-way through the layers is still safe: the prefill
of the remaining tokens rewrites every layer's K/V from that position on.

Each chunk's tensors say how they are encoded: the model's dtype, or 8-bit codes with a scale tensor
beside them (:mod:`hcache.storage.stored_state`), whatever this runtime saves; a restore may span both kinds. Codes
cross to the device as stored and are dequantised there: KV inside the copy into the paged cache, H just
before its K/V GEMM.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..engine.interface import Engine
from ..model.spec import ModelSpec
from ..model.tensor_parallel import SINGLE, TPGroup, model_fingerprint
from ..ops.quant import SCALE_DTYPE, QuantRows
from ..planning.window import WindowRule
from ..planning.plan import Method, RestorePlan, row_shapes
from ..storage.chunk import ChunkImage, ChunkInvalid, ChunkLayout
from ..storage.anchor_log import AnchorLog
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain, content_key
from ..storage.host_tier import HostTier
from ..storage.stored_state import decode_rows, is_encoded, scale_format, scale_shape, stored_rows
from ..storage.tp_ownership import shared_chunks, stores
from ..transfer.copier import Copier
from ..transfer.scratch import Scratch
from .records import MissReason, PutRestore

log = logging.getLogger(__name__)


@dataclass
class RestoreOutcome:
    tokens: int  # tokens whose KV is now in the cache, after those the sequence held
    bytes_read: int  # bytes of the stored tensors the restore copied from (whole 64-row tensors)
    fallback: str | None  # why stored state stopped short of what the lookup found, if it did
    sources: dict[str, int] = field(default_factory=dict)  # tokens by where their chunk was read from (HostTier.take_source)
    lossy: bool = False  # some of it was stored in an 8-bit encoding
    misses: dict[str, int] = field(default_factory=dict)  # full-chunk tokens wanted but not restored, by MissReason
    type_bytes: dict[str, int] = field(default_factory=dict)  # ``bytes_read`` by layer type (restore_accounting)
    windowed: bool = False  # sliding-window layers were written from their window on only: the cache before it is not theirs

    def record(self, step: PutRestore, plan: RestorePlan) -> None:
        """Fill ``step``, a put's record, with this restore from the store by ``plan``: the one accounting
        of every engine's restore (the DeepSpeed path's and vLLM's loader)."""
        step.plan, step.tokens, step.sources, step.bytes_read = str(plan), self.tokens, dict(self.sources), self.bytes_read
        step.fallback, step.lossy, step.misses = self.fallback, step.lossy or self.lossy, dict(self.misses)
        step.type_bytes = dict(self.type_bytes)
        if plan.count(Method.RE) == len(plan.layers) and self.tokens:  # recomputed, not restored
            step.misses[MissReason.PLAN_RECOMPUTE.value] = self.tokens
        step.layer_tokens = {m.value: plan.count(m) * self.tokens for m in Method if plan.count(m)}


def restorable(tokens: int) -> int:
    """How many of a prompt's ``tokens`` a restore may load: all but the last, whose logits give the first
    output token, so the engine computes it."""
    return max(0, tokens - 1)


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
            return MissReason(why.value)
    return None


def anchor_label(fingerprint: str, namespace: str | None) -> str:
    """A chain's root as the anchor log files it: the fingerprint, then the namespace hashed (a tenant's
    ``cache_salt`` may be a secret)."""
    return f"{fingerprint}/{hashlib.blake2b((namespace or '').encode(), digest_size=8).hexdigest()}"


def first_chunk_miss(anchors: AnchorLog | None, label: str, chain: KeyChain, tokens: list[int], misses: dict[str, int]) -> dict[str, int]:
    """``misses``, where a conversation's first chunk (``tokens`` from the first, ``chain`` holding no full
    chunk yet) was never stored under the root ``label`` names: told apart if the anchor log says it was
    stored in this namespace at another tensor-parallel layout, or under another namespace or model."""
    never = misses.get(MissReason.NEVER_STORED.value)
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


def store_miss(tier: HostTier | None, key: str, misses: dict[str, int]) -> dict[str, int]:
    """``misses``, where a look-up made away from the stores (vLLM's scheduler reads the files, not the
    store's memory) said ``never_stored`` of the chunk ``key`` and the store knows it lost it (evicted it,
    or found it bad: at start-up, say)."""
    lost = _lost(tier, key) if tier is not None and MissReason.NEVER_STORED.value in misses else None
    return misses if lost is None else _relabel(misses, lost)


def _relabel(misses: dict[str, int], reason: MissReason) -> dict[str, int]:
    """``misses`` with its ``never_stored`` tokens counted under ``reason`` instead."""
    never = misses[MissReason.NEVER_STORED.value]
    return {**{r: n for r, n in misses.items() if r != MissReason.NEVER_STORED.value}, reason.value: never}


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


def restore_prefix(
    engine: Engine,
    tier: HostTier,
    uid: int,
    tokens: list[int],
    keys: list[str],
    fingerprint: str,
    plan: RestorePlan,
    copier: Copier,
    tp: TPGroup = SINGLE,
    *,
    held: int = 0,
    limit: int | None = None,
    window: WindowRule | None = None,
) -> RestoreOutcome:
    """Restore the longest verified prefix of ``keys`` into sequence ``uid``, after the tokens it holds.

    ``tokens`` start at a chunk boundary, and ``keys`` are the chain keys of their full chunks. The
    sequence already holds the first ``held`` of them (``held < 64``: it ends inside the first chunk), and
    at most the first ``limit`` are wanted; so a sequence can be restored in steps, as its prompt arrives
    in parts, and a chunk can be restored in part. ``window``: the rule by which sliding-window layers
    were saved and are read (the store stack's; by default, the engine's model's windows).

    The chunks are fetched into the host pool first (from disk on the tier's reader threads, while the RE
    layers compute); then each stored layer is copied from the pool, ``copier.depth`` layers ahead of the
    compute that consumes it.

    With tensor parallelism every rank of ``tp`` calls this at once, with its engine shard, and ``keys``
    and ``fingerprint`` of its own chunks: the ranks agree on the prefix, and an H layer's rows are
    gathered from the ranks that store them (:class:`~hcache.model.tensor_parallel.TPGroup`)."""
    limit = len(keys) * CHUNK_TOKENS if limit is None else limit
    rule = window or WindowRule(engine.spec, engine.block_size)
    keys = keys[: -(-limit // CHUNK_TOKENS)]

    def end(chunks: int) -> int:  # where a restore of that many chunks stops in ``tokens``
        return max(held, min(chunks * CHUNK_TOKENS, limit))

    first = engine.seen_tokens(uid) // CHUNK_TOKENS  # with TP, which rank stores a chunk's H depends on it
    present = tier.stored_prefix(keys)
    fetches: list[Future] = []
    images: list[ChunkImage] = []
    try:
        fetches += (tier.fetch(key) for key in keys[:present])
        agreed = tp.min(present)  # a prefix that one rank lacks is no prefix at all
        engine.begin_restore(uid, end(agreed) - held)
        copier.follow()  # the copies wait for the blocks' allocation, not for the RE layers queued next
        if agreed and plan.count(Method.RE):
            engine.recompute_layers(uid, tokens[held : end(agreed)], plan.count(Method.RE))
        fallback, miss = (_elsewhere(agreed), MissReason.OTHER_RANK) if agreed < present else (None, None)
        verified, why = verify_fetched(
            tier, keys, fetches[:agreed], images, tokens, fingerprint, plan, tp, first, engine.spec, lambda m: first * CHUNK_TOKENS + end(m), rule
        )
        fallback, miss = verified or fallback, why or miss
        n = len(images)
        jobs = [(layer, m.value) for layer, m in enumerate(plan.layers) if m is not Method.RE] if agreed else []
        # Chunks each layer reads: all of them, or a sliding-window layer's last window (at TP > 1 only on
        # vLLM's path, which restores no H: ``resolve`` refuses sliding-window models to the DeepSpeed path's TP).
        reads = {
            (layer, fmt): range(max(0, rule.first_read(layer, first * CHUNK_TOKENS + end(n)) - first), n)
            if fmt == Method.KV.value or tp.world_size == 1 else _reading(tp, fmt, n, agreed, first)
            for layer, fmt in jobs
        }  # fmt: skip
        if n or tp.world_size > 1:  # with TP, the other ranks still gather this rank's rows of the H layers
            _restore_layers(engine, copier, tp, uid, images, jobs, reads, held, end(n), agreed, first)
        restored = tp.min(n)
        if restored < n:
            fallback, miss = fallback or _elsewhere(restored), miss or MissReason.OTHER_RANK
        missed = end(len(keys)) - end(restored)
        if missed and miss is None:
            miss = lookup_miss(tier, keys[present])
        engine.end_restore(uid, tokens[held : end(restored)])
        read, lossy = restore_accounting(engine.spec, images, reads, restored)
        sources = tokens_by_source(tier, images[:restored], 0, held, end(restored))
        windowed = any(chunks.start for (layer, _), chunks in reads.items() if rule.window(layer) is not None)
        misses = {miss.value: missed} if missed else {}
        return RestoreOutcome(end(restored) - held, sum(read.values()), fallback, sources, lossy, misses, read, windowed)
    finally:
        copier.drain()  # no copy may still read a slot given back below
        for f in fetches:
            try:
                image = f.result()
            except BaseException:  # reported above, or the restore is failing anyway: release the rest
                continue
            if image is not None:
                tier.release(image)


def _reading(tp: TPGroup, fmt: str, n: int, agreed: int, first: int) -> range:
    """The chunks whose ``fmt`` rows this rank reads."""
    return shared_chunks(tp.rank, tp.world_size, agreed if tp.world_size > 1 else n, first) if fmt == Method.H.value else range(n)


def _restore_layers(
    engine: Engine, copier: Copier, tp: TPGroup, uid: int, images: list[ChunkImage], jobs: list[tuple[int, str]],
    reads: dict[tuple[int, str], range], held: int, stop: int, agreed: int, first: int,
) -> None:
    """Each stored layer's rows from the pool into the engine, from the chunks it ``reads``: KV copied into
    the paged cache, H copied to the device and projected. Copies run ``copier.depth`` layers ahead of the
    compute. A layer that reads from chunk ``j`` on writes from that chunk's first row (or ``held``) on."""
    n, spec = len(images), engine.spec
    dtype = spec.torch_dtype
    filler = torch.zeros(CHUNK_TOKENS, spec.hidden_size, dtype=dtype) if tp.world_size > 1 else None  # TP only

    def origin(layer: int, fmt: str) -> int:  # where the layer's rows begin: its first chunk read (H with TP: all, gathered)
        return reads[(layer, fmt)].start * CHUNK_TOKENS if tp.world_size == 1 or fmt == Method.KV.value else 0

    def stage(job: tuple[int, str]) -> list:
        layer, fmt = job
        if fmt == Method.H.value:  # rows past another rank's bad chunk are garbage: the agreement ends the prefix there
            parts = [stored_rows(images[j], layer, fmt) if j < n else filler for j in reads[(layer, fmt)]]
            return gather_runs(copier, parts)
        chunks = reads[(layer, fmt)]
        if chunks:  # one call for the layer: the rows from ``held`` (or its first chunk) to ``stop`` in the last
            parts = [stored_rows(images[j], layer, fmt) for j in chunks]
            parts[-1] = parts[-1][: stop - (n - 1) * CHUNK_TOKENS]
            if chunks.start == 0:
                parts[0] = parts[0][held:]
            engine.restore_kv(uid, layer, parts, max(held, origin(layer, fmt)) - held)
        return []

    def finish(job: tuple[int, str], runs: list, done) -> None:
        layer, fmt = job
        if fmt != Method.H.value:
            return
        copier.wait(done, *run_tensors(runs))
        pieces = [decode_rows(run, dtype) for run in runs]
        if len(pieces) == 1:  # a layer stored in one encoding: its gathered rows as they are
            rows = pieces[0]
        else:  # none (a TP rank with no chunk's H), or chunks stored in several encodings
            rows = torch.cat(pieces) if pieces else torch.empty(0, spec.hidden_size, dtype=dtype, device=engine.device)
        rows = tp.gather_in_turn(rows, agreed, CHUNK_TOKENS, first)  # collective: every rank gathers
        base = origin(layer, fmt)
        rows = rows[max(held, base) - base : stop - base]
        if len(rows):
            engine.restore_from_hidden(uid, layer, rows, max(held, base) - held)

    last = copier.pipeline(jobs, stage, finish)
    copier.wait(last)  # the KV copies land before anything reads the cache


def gather_runs(copier: Copier, parts: list[torch.Tensor | QuantRows], scratch: Scratch | None = None) -> list[torch.Tensor | QuantRows]:
    """H rows of consecutive chunks on the device, one gather per run of chunks stored alike (one run,
    unless the chunks were saved in different encodings): lossless rows, or codes and scales (in
    ``scratch``'s buffers, if given: :meth:`Copier.gather`)."""
    runs = [list(run) for _, run in itertools.groupby(parts, lambda p: (type(p), (p.codes if isinstance(p, QuantRows) else p).dtype))]
    return [
        QuantRows(copier.gather([p.codes for p in run], scratch), copier.gather([p.scale for p in run], scratch))
        if isinstance(run[0], QuantRows) else copier.gather(run, scratch)
        for run in runs
    ]  # fmt: skip


def run_tensors(runs: list[torch.Tensor | QuantRows]) -> list[torch.Tensor]:
    """The device tensors :func:`gather_runs` made: what a stream that reads them must keep alive."""
    return [t for run in runs for t in ((run.codes, run.scale) if isinstance(run, QuantRows) else (run,))]


def verify_fetched(
    tier: HostTier, keys: list[str], fetches: list[Future], images: list[ChunkImage], tokens: list[int],
    fingerprint: str, plan: RestorePlan, tp: TPGroup, first: int, spec: ModelSpec, end: Callable[[int], int], rule: WindowRule,
) -> tuple[str | None, MissReason | None]:
    """Append to ``images`` the fetched chunks, in order, up to the first that is missing, bad, or short of
    a format the plan restores from, and then no further than the last whose sliding-window layers find
    their window stored by ``rule`` (:meth:`~hcache.planning.window.WindowRule.usable`; ``first``: the
    sequence's chunk that ``keys[0]`` is, ``end(m)``: the sequence's length once ``m`` chunks are
    restored); why the prefix
    ends there (a message if it ends early for a reason worth one, and the :class:`MissReason`)."""
    stored = {(layer, m.stored_format) for layer, m in enumerate(plan.layers) if m is not Method.RE}
    shapes, dtype = row_shapes(spec), spec.torch_dtype
    # The tensors a chunk must hold, by which TP rank owns its H; chunks share a few layouts, each checked once.
    # A sliding-window layer's are checked if present, and wanted only in the window (below).
    needs = [{(layer, fmt) for layer, fmt in stored if stores(tp.rank, tp.world_size, r, fmt)} for r in range(tp.world_size)]
    optional = {(layer, fmt) for layer, fmt in stored if rule.window(layer) is not None}
    checked: dict[tuple, tuple[str | None, list[str]]] = {}
    for j, (key, f) in enumerate(zip(keys, fetches)):
        try:
            image = f.result()
            if image is None:  # gone since the lookup, or its tier failed: the prefix ends here
                log.info("chunk %s is gone since the lookup; recomputing from token %d", key, j * CHUNK_TOKENS)
                return None, lookup_miss(tier, key, seen=True)
            image.check(tokens[j * CHUNK_TOKENS : (j + 1) * CHUNK_TOKENS], fingerprint)
            r = (first + j) % tp.world_size
            if (image.layout.signature, r) not in checked:
                checked[(image.layout.signature, r)] = _layout_problems(image.layout, needs[r], optional, shapes, dtype)
            wrong, missing = checked[(image.layout.signature, r)]
            if wrong is not None:
                raise ChunkInvalid(f"chunk {key}: {wrong}")
        except (ChunkInvalid, OSError) as exc:
            return _reject(tier, key, j, exc)
        if missing:
            reason = f"chunk {key} was saved without {missing} state that plan {plan} needs"
            log.info("%s; recomputing from token %d", reason, j * CHUNK_TOKENS)
            return reason, MissReason.OTHER_SETTINGS
        images.append(image)
    verified = len(images)
    layer_format = dict(stored)
    usable = rule.usable(sorted(layer_format), first, verified, end, lambda j, layer: images[j].has(layer, layer_format[layer]))
    if usable == verified:
        return None, None
    del images[usable:]  # still fetched: the caller releases them with the rest
    reason = (f"the sliding-window layers' rows before token {end(verified)} were not kept (saved more than a window before "
              f"where their conversation was saved); restoring {end(usable)} tokens")  # fmt: skip
    log.info("%s", reason)
    return reason, MissReason.OUTSIDE_WINDOW


def _layout_problems(
    layout: ChunkLayout, need: set[tuple[int, str]], optional: set[tuple[int, str]], shapes: dict, dtype: torch.dtype
) -> tuple[str | None, list[str]]:
    """Why a chunk of ``layout`` cannot serve ``need``: a tensor of another shape or dtype than the model's,
    or 8-bit codes without their scales (a copy would broadcast or convert it: the chunk is bad), and the
    formats it lacks, but for the ``optional`` tensors (it is merely short)."""
    for layer, fmt in sorted(need & set(layout.entries)):
        entry = layout.entries[(layer, fmt)]
        if entry.shape != (CHUNK_TOKENS, *shapes[fmt]) or not (entry.dtype == dtype or is_encoded(entry.dtype)):
            want = [CHUNK_TOKENS, *shapes[fmt]]
            return f"L{layer}.{fmt} is {list(entry.shape)} {entry.dtype}, the model's is {want} {dtype}", []
        scale = layout.entries.get((layer, scale_format(fmt)))
        if is_encoded(entry.dtype) and (scale is None or (scale.shape, scale.dtype) != ((CHUNK_TOKENS, *scale_shape(shapes[fmt])), SCALE_DTYPE)):
            return f"L{layer}.{fmt} is stored in {entry.dtype} without fitting scales", []
    return None, sorted({str(fmt) for _, fmt in need - optional - set(layout.entries)})


def _elsewhere(n: int) -> str:
    reason = f"another tensor-parallel rank's stored state ends at token {n * CHUNK_TOKENS}"
    log.info("%s; recomputing from there", reason)
    return reason


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
