"""The worker's side of hcache's vLLM connector: it owns the store stack, loads stored prefixes into vLLM's
paged cache off the step (:mod:`hcache.paged.loader`), saves what the forward computes, and tells the
scheduler what its tiers hold.

Each step, when vLLM binds the scheduler's metadata (before the forward), the step's new loads go to the
loader, and the saver opens the step's batch. K/V are not handed over by layer: vLLM's paged cache holds
every row a running request computed, so when the forward is done (``wait_for_save``) the rows of each chunk
the step filled are read out of it, every layer's at once, into the chunk's host-pool slot; a decode step
that fills no chunk costs nothing per layer. Hidden states, which no cache holds, go to the saver after each
layer that saves them (:meth:`WorkerSide.save_layer`). The saver publishes full chunks and writes them back
to the stores in the background. After the forward, the loads finished meanwhile are reported to vLLM (with
the blocks they could not load, which vLLM recomputes), and the chunks the tiers gained or lost since the
last step to the scheduler's index. A recurrent layer's state is read out of vLLM's cache too, where a step
ended on one of vLLM's checkpoints, into the chunk that ends there (``docs/vllm.md``, hybrid models).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.ragged import Segment
from ..machine import helper_threads
from ..model.spec import ModelSpec
from ..model.tensor_parallel import TPGroup
from ..ops.paged_kv import block_slots
from ..ops.paged_layout import CacheWrite, PagedLayout, Places
from ..paged.loader import Loader
from ..paged.target import PagedLayer, StateLayer
from ..restore.miss_reasons import first_chunk_miss, lookup_miss, store_miss
from ..restore.records import MissReason, PutRestore, SequenceRecord, log_requests
from ..restore.session import Session
from ..serving.store_stack import StoreStack
from ..storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from ..storage.pins import PinnedPrefix
from ..storage.residency import Residency
from ..storage.stored_state import Format
from .hidden import HiddenLayers, registering_model
from .messages import Pinned, PinRequest, RequestStep, SchedulerStep
from .metadata import HCacheWorkerMetadata
from .settings import VllmSetup, uses_hidden_states

log = logging.getLogger(__name__)

# How long a step that computed nothing waits for a load to finish. vLLM steps on, empty, while requests
# wait for their loads, and each empty step asks for finished loads: without a wait, that loop would spin
# on the cores the loads need. A load that finishes ends the wait at once.
IDLE_WAIT_S = 0.01


@dataclass(frozen=True)
class VllmModel:
    """What the store stack needs of an engine: its model's facts, its device, and the block by which it
    holds a sliding-window layer's positions."""

    spec: ModelSpec
    device: torch.device
    block_size: int


@dataclass(kw_only=True)
class _Sequence(Session):
    # by KV cache group: block index in the request -> id, for the chunk being filled
    blocks: list[dict[int, int]] = field(default_factory=list)

    def track(self, step: RequestStep, sizes: list[int]) -> None:
        """Note the blocks of ``step``'s tokens, forgetting those before the chunk it begins in: the blocks of
        the chunks it fills, for :meth:`span`, and no more (a decode step's work does not grow with history)."""
        if not self.blocks:
            self.blocks = [{} for _ in sizes]
        kept = step.start // CHUNK_TOKENS * CHUNK_TOKENS
        for held, ids, size in zip(self.blocks, step.block_ids, sizes):
            for index in [i for i in held if i < kept // size]:
                del held[index]
            held.update(enumerate(ids, step.start // size))

    def span(self, group: int, size: int, start: int, length: int) -> tuple[list[int], int, int]:
        """Positions ``[start, start + length)`` as :func:`~hcache.ops.paged_kv.block_slots` takes them."""
        first = start // size
        ids = [self.blocks[group][i] for i in range(first, (start + length - 1) // size + 1)]
        return ids, start - first * size, start - first * size + length


def spare_cpus() -> set[int]:
    """The CPUs vLLM's CPU worker left to its other processes: those it may run on that no rank's OpenMP
    threads are bound to (vLLM passes a worker its own binding as ``OMP_PLACES``, ``GOMP_CPU_AFFINITY`` or
    ``KMP_AFFINITY``; every rank's is in ``VLLM_CPU_OMP_THREADS_BIND`` where the user gives it, ``|``
    between ranks). Empty where nothing is bound (a GPU worker) or every CPU is."""
    bound = (
        os.environ.get("OMP_PLACES")
        or os.environ.get("GOMP_CPU_AFFINITY")
        or os.environ.get("KMP_AFFINITY", "").partition("proclist=")[2]
    )
    if not bound:
        return set()
    allowed = os.sched_getaffinity(os.getppid())  # the engine process's, which vLLM does not bind
    return allowed - _cpus(bound) - _cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))


def _cpus(listed: str) -> set[int]:
    """The CPUs a binding names, singly or as ranges: ``{0},{1}``, ``0-3,8|4-7``."""
    return {
        cpu
        for first, last in re.findall(r"(\d+)(?:-(\d+))?", listed)
        for cpu in range(int(first), int(last or first) + 1)
    }


def _cache_write(module, write, spec: ModelSpec) -> CacheWrite:
    """The backend's cache write of ``module`` (vLLM's attention layer) as :meth:`PagedLayout.probe` calls it,
    with rows ``[T, parts, H, C]``: K and V apart for attention; for MLA, the latent and K's RoPE part of the
    one row, into the cache as the layer holds it (``[blocks, block_size, C]``, its head dim of one dropped)."""
    if spec.kv_lora_rank is None:
        return lambda rows, cache, slots: write(module, rows[:, 0], rows[:, 1], cache, slots)
    rank = spec.kv_lora_rank
    return lambda rows, cache, slots: write(
        rows[:, 0, 0, :rank], rows[:, 0, :, rank:], cache.squeeze(1), slots, module.kv_cache_dtype, module._k_scale
    )


class WorkerSide:
    """``rank``: the worker's tensor-parallel rank, which stores and loads its own K/V heads under keys of
    its own (:meth:`~hcache.model.tensor_parallel.TPGroup.fingerprint`), in directories of its own."""

    def __init__(self, setup: VllmSetup, device: torch.device, attention_layers: dict, rank: int = 0):
        self.setup, self.config = setup, setup.config
        # no process group: the ranks never talk, vLLM's scheduler decides for them
        self.tp = TPGroup(rank, setup.config.tensor_parallel)
        spare = spare_cpus() if device.type == "cpu" else set()
        helper_threads.run_on(spare)  # before the store stack starts its threads
        if spare:
            log.info("hcache's threads run on CPUs %s, apart from vLLM's OpenMP threads", sorted(spare))
        # a CPU's loads write their KV from a process of their own, which maps the host pool (:mod:`hcache.paged.copy_process`)
        self.stack = StoreStack(
            setup.config,
            VllmModel(setup.config.spec, device, setup.window_block),
            setup.fingerprint,
            self.tp,
            shareable_pool=device.type == "cpu",
        )
        self._attention = attention_layers  # layer name -> vLLM's Attention module (its backend's cache write)
        self._layers: dict[str, PagedLayer] = {}
        self._seqs: dict[str, _Sequence] = {}
        self._records: dict[str, SequenceRecord] = {}  # by request, from its load to its end
        self._uids = itertools.count()
        self._by_index: dict[int, PagedLayer] = {}
        self._states: dict[int, StateLayer] = {}  # the recurrent layers, by index
        self._saves_hidden: set[str] = set()  # layers whose input is saved
        self._computing: list[tuple[RequestStep, _Sequence]] = []  # this step's requests with tokens to compute
        self._hidden_group = 0  # the group of the layer whose slot mapping finds the captured rows
        self._kernel_block = 0  # tokens in a block of the cache tensors (vLLM may split its blocks into smaller ones)
        self._hidden: HiddenLayers | None = None  # the model's layers, where hidden states are saved or restored
        self._loader: Loader | None = None
        self._ending: set[str] = set()  # requests vLLM finished (aborted) while their load was in flight
        self._idle = False  # this step computes nothing: only loads are in flight, if anything
        self._errors: set[int] = set()
        self._failed: list[str] = []  # requests whose load fell short, for the scheduler
        self._short: set[str] = set()  # those among the loads the last ``finished`` reported
        self._changes: deque[tuple[str, MissReason | None]] = deque()  # tiers' gains and losses: the index's
        self._pins: dict[str, PinnedPrefix] = {}  # by request: the stored prefix held for its load
        self._pinned: list[Pinned] = []  # how much of each, for the scheduler
        self._residency: deque[Residency] = deque()  # where chunks are held, as it changed: for KV cache events
        if self.stack.store is not None:
            self.stack.store.watch(
                lambda key, loss: self._changes.append((key, None if loss is None else MissReason.of(loss)))
            )
            if setup.events:
                self.stack.store.follow(self._residency.append)
        log_path = setup.config.settings.request_log
        self.request_log = Path(log_path) if log_path is not None else None

    # ---- set-up ---------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn each layer's cache and its layout: probed through the backend's own cache write where it
        has one, else the standardized layout's strides. Layers whose caches are laid out alike share one."""
        from vllm.model_executor.models.utils import extract_layer_index

        spec = self.config.spec
        layouts: dict[tuple, PagedLayout] = {}
        for name, cache in kv_caches.items():
            index = extract_layer_index(name)
            if spec.is_recurrent(index):  # its state's tensors, as the layer holds them (a block a checkpoint)
                self._states[index] = StateLayer(index, tuple(self._attention[name].kv_cache), self.setup.groups[index])
                continue
            module = self._attention.get(name)
            write = getattr(getattr(module, "impl", None), "do_kv_cache_update", None)
            signature = (
                tuple(cache.shape[1:]),
                cache.stride(),
                cache.dtype,
                getattr(module, "isa", None),
                write is None,
            )
            if signature not in layouts:
                layouts[signature] = (
                    PagedLayout.probe(_cache_write(module, write, spec), cache, spec.kv_parts)
                    if write is not None
                    else PagedLayout.split_kv(cache, spec.kv_parts)
                )
            self._layers[name] = self._by_index[index] = PagedLayer(
                index, cache, layouts[signature], self.setup.groups[index]
            )
            self._kernel_block = cache.shape[2]
        layout = next(iter(layouts.values()))
        if (layout.kv_parts, layout.num_heads, layout.head_size) != (spec.kv_parts, spec.num_kv_heads, spec.head_size):
            raise RuntimeError(
                f"vLLM's cache holds {layout.kv_parts} rows of {layout.num_heads} heads of {layout.head_size} a token; "
                f"the model has {spec.kv_parts} of {spec.num_kv_heads} KV heads of {spec.head_size}"
            )
        if uses_hidden_states(self.config):
            saved = frozenset(layer for layer, formats in enumerate(self.config.save_formats) if Format.H in formats)
            layers = {layer.index: name for name, layer in self._layers.items()}
            self._hidden = HiddenLayers(
                spec, registering_model(self._attention), layers, saved if self.stack.saver else frozenset()
            )
            # HiddenLayers finds rows by its first layer's slots
            self._hidden_group = self.setup.groups[next(iter(layers))]
            if self.stack.capture is not None:
                self._saves_hidden = {layers[index] for index in saved}
        if self.stack.store is not None:
            rebuild = self._hidden.rebuild if self._hidden is not None else None
            # a load process needs the caches moved in place: only where the layers hold the tensors registered (not
            # views of them), and no recurrent layer's state shares their pages (vLLM pairs a Mamba layer's pages with
            # an attention layer's; moved, the two would part)
            movable = not self._states and all(
                getattr(self._attention.get(name), "kv_cache", None) is cache for name, cache in kv_caches.items()
            )
            if not movable and self.stack.store.pool.fd is not None:
                log.info(
                    "hcache: %s; loads run on a thread of the worker",
                    "vLLM keeps the recurrent layers' state in the attention caches' pages"
                    if self._states
                    else "vLLM's layers hold views of their caches, not the caches registered",
                )
            layers, states = list(self._layers.values()), tuple(self._states.values())
            lost = lambda key, reason: self._changes.append((key, reason))  # noqa: E731
            args = (self.stack, self.setup.block_sizes, self._kernel_block, layers, rebuild, lost)
            self._loader = Loader(*args, movable=movable, states=states)

    # ---- each step --------------------------------------------------------------------------------------
    def begin_step(self, metadata: SchedulerStep) -> None:
        """Before the forward: stored prefixes held or let go as the scheduler says, the step's loads handed to
        the loader, sequences opened or continued, their misses recorded, and the saver's batch begun."""
        self._idle = not metadata.requests
        for req_id in metadata.unpins:
            self._unpin(req_id)
        for ask in metadata.pins:
            self._pin(ask)
        for job in metadata.loads:
            self._loader.submit(job, self._records.setdefault(job.req_id, SequenceRecord()))
        short = self._load_in_step([job.req_id for job in metadata.loads if job.in_step])
        requests = [(step, self._sequence(step)) for step in metadata.requests]
        self._computing = [(step, seq) for step, seq in requests if step.length and step.req_id not in short]
        if not self._computing or self.stack.saver is None:
            return
        if self._hidden is not None:
            g = self._hidden_group
            size = self.setup.block_sizes[g]
            spans = [
                (step.block_ids[g], step.start % size, step.start % size + step.length) for step, _ in self._computing
            ]
            blocks, offsets = block_slots(spans, size, self._kernel_block)
            self._hidden.select(blocks * self._kernel_block + offsets)
        starts = itertools.accumulate((step.length for step, _ in self._computing), initial=0)
        segments = [Segment(seq.uid, step.start, step.length, row) for (step, seq), row in zip(self._computing, starts)]
        if self.stack.capture is None:  # nothing saved: chunks are published with their keys and tokens alone
            self.stack.saver.begin_batch(segments)
            return
        for step, seq in self._computing:  # the blocks :meth:`_read_kv` reads the chunks this step fills from
            seq.track(step, self.setup.block_sizes)
        self.stack.capture.begin_batch(segments, read_kv=self._read_kv)

    def _load_in_step(self, req_ids: list[str]) -> set[str]:
        """Wait for the in-step loads ``req_ids``; those that fell short. Their blocks not loaded are load errors:
        vLLM drops what this step computes of such a request and recomputes from them; nothing of it is saved."""
        done = self._loader.wait(req_ids) if req_ids else {}
        self._errors.update(*done.values())
        self._failed += [req_id for req_id, unloaded in done.items() if unloaded]
        return {req_id for req_id, unloaded in done.items() if unloaded}

    def _pin(self, ask: PinRequest) -> None:
        """Hold what the tiers have of a prefix the scheduler means to offer, until its load is over (every
        eviction is this process's, so nothing it holds goes meanwhile), and tell the scheduler how much
        that is; a chunk found gone, the index too."""
        self._unpin(ask.req_id)
        keys = chunk_keys(ask.tokens, root_key(self.stack.fingerprint, ask.namespace))
        held = self._pins[ask.req_id] = PinnedPrefix(self.stack.store, keys)
        why = None
        if held.count < len(keys):
            why = lookup_miss(self.stack.store, keys[held.count], seen=True)
            self._changes.append((keys[held.count], why))
        self._pinned.append(Pinned(ask.req_id, self.tp.rank, held.count, why))

    def _unpin(self, req_id: str) -> None:
        held = self._pins.pop(req_id, None)
        if held is not None:
            held.release()

    def _sequence(self, step: RequestStep) -> _Sequence:
        seq = self._seqs.get(step.req_id)
        if step.new or seq is None:  # its first step, or its first since it was preempted: its chain starts again
            if seq is not None:
                seq.close(self.stack)
            record = self._records.setdefault(step.req_id, SequenceRecord())
            seq = self._seqs[step.req_id] = _Sequence.open(self.stack, next(self._uids), step.namespace, record)
        misses = step.misses  # the stored prefix the scheduler could not offer, on the request's first step
        if misses and step.start == 0:  # nothing of it held: the miss is at the conversation's first chunk
            misses = first_chunk_miss(self.stack.anchors, seq.label, seq.chain, step.tokens, misses)
        seq.chain.extend(step.tokens)
        if misses:  # the store knows better than the files the scheduler read what it lost
            missed = seq.chain.chunk(step.start // CHUNK_TOKENS)
            misses = store_miss(self.stack.store, missed[0], misses) if missed is not None else misses
            seq.record.add(PutRestore(misses=misses))
        return seq

    def save_layer(self, name: str) -> None:
        """After layer ``name``'s attention: its captured input to the saver, where it saves hidden states. A
        layer whose input was not captured hands over nothing, and the saver saves none of this step's chunks
        (it logs a forward that skipped a layer)."""
        if name not in self._saves_hidden or not self._computing:  # vLLM calls this for every layer of every step
            return
        index = self._layers[name].index
        hidden = self._hidden.captured(index)
        if hidden is not None:
            self.stack.capture.on_layer(index, hidden, None)

    def _read_kv(self, segments: list[Segment], layers: list[int]) -> torch.Tensor:
        """The K/V rows of ``segments`` (chunks this step filled, of its computing requests) of ``layers``,
        ``[layers, T, parts, heads, head_size]``, read out of vLLM's cache: one gather a layer, whatever the
        number of chunks."""
        seqs = {seq.uid: seq for _, seq in self._computing}
        elements: dict[tuple[int, int], Places] = {}  # shared by the layers of a layout and group
        # segments of whole kernel blocks (a GPU's 16 tokens in a 64-token chunk) are read a block at a time
        k = self._kernel_block
        aligned = all(s.start % k == 0 and s.length % k == 0 for s in segments)
        whole = sum(s.length for s in segments) // k if aligned else 0
        rows = []
        for index in layers:
            layer = self._by_index[index]
            key = (id(layer.layout), layer.group)
            if key not in elements:
                size = self.setup.block_sizes[layer.group]
                spans = [seqs[s.uid].span(layer.group, size, s.start, s.length) for s in segments]
                elements[key] = layer.layout.elements(*block_slots(spans, size, k), whole)
            rows.append(layer.layout.read(layer.cache, elements[key]))
        return torch.stack(rows)

    def end_step(self) -> None:
        """After the forward: the saver's batch lands."""
        if self._computing and self.stack.saver is not None:
            if self._hidden is not None and self._hidden.held is not None:
                self.stack.saver.vouch(self._hidden.held)
            if self._states and self.stack.capture is not None:
                self._keep_states()
            (self.stack.capture or self.stack.saver).end_batch()
        for step, seq in self._computing:
            seq.record.computed_tokens += step.length
        self._computing = []
        if self._hidden is not None:
            self._hidden.select(None)

    def _keep_states(self) -> None:
        """The recurrent layers' state of each request whose step ended on a chunk's end, for the chunk (kept
        where the checkpoint rule stores one: :class:`~hcache.planning.checkpoints.StateRule`): vLLM holds it
        in the request's block of its last position, the step's last block, until its next step."""
        for step, seq in self._computing:
            end = step.start + step.length
            if end % CHUNK_TOKENS or not self.stack.states.saves(end // CHUNK_TOKENS - 1, end):
                continue
            for layer in self._states.values():
                rows = layer.read(step.block_ids[layer.group][-1])
                self.stack.capture.on_state(layer.index, seq.uid, end // CHUNK_TOKENS - 1, rows)

    def finished(self, req_ids: set[str]) -> set[str]:
        """Requests vLLM is done with (``req_ids``), and the loads finished since the last step, whose
        requests are returned; their unloaded blocks are kept for :meth:`load_errors`. A finished request's
        chunks are published (the write-back goes on in the background) and its record logged, once its
        load, if one is in flight, is over. A load's held prefix is let go as it ends."""
        loads = self._loader.finished(IDLE_WAIT_S if self._idle else 0.0) if self._loader is not None else {}
        self._short = set()
        for req_id, unloaded in loads.items():
            self._unpin(req_id)
            self._errors |= unloaded
            if unloaded:
                self._failed.append(req_id)
                self._short.add(req_id)
        loaded = set(loads)
        ending = {r for r in req_ids if self._loader is not None and self._loader.loading(r)}
        self._ending |= ending
        done = (set(req_ids) - ending) | (self._ending & loaded)
        self._ending -= loaded
        self._close(done)
        return loaded

    def _close(self, req_ids: set[str]) -> None:
        finished = []
        for req_id in req_ids:
            self._unpin(req_id)  # ended before its load was sent
            seq = self._seqs.pop(req_id, None)
            record = self._records.pop(req_id, None)
            if seq is not None:
                seq.close(self.stack)
            if record is not None:
                finished.append(
                    ({"request_id": req_id, **({"tp_rank": self.tp.rank} if self.tp.world_size > 1 else {})}, record)
                )
        if self.request_log is not None:
            log_requests(self.request_log, finished)

    def load_errors(self) -> set[int]:
        """The blocks the loads finished since the last call could not load, which vLLM recomputes: with one KV
        cache group. With several, a block id names no request, and vLLM takes the requests instead
        (:meth:`failed_loads`): their blocks are not reported."""
        errors, self._errors = self._errors, set()
        return errors if len(self.setup.block_sizes) == 1 else set()

    def failed_loads(self) -> set[str]:
        """The requests whose load, reported by the last :meth:`finished`, fell short, which vLLM then
        recomputes whole: with several KV cache groups (:meth:`load_errors` otherwise)."""
        return set(self._short) if len(self.setup.block_sizes) > 1 else set()

    def scheduler_news(self) -> HCacheWorkerMetadata | None:
        """The chunks the tiers gained and lost since the last step, for the scheduler's index, the loads
        that fell short, and how much of each prefix asked for this rank holds."""
        changes = [self._changes.popleft() for _ in range(len(self._changes))]
        residency = [self._residency.popleft() for _ in range(len(self._residency))]
        failed, self._failed = self._failed, []
        pinned, self._pinned = self._pinned, []
        news = HCacheWorkerMetadata(changes, failed, pinned, residency)
        return news if changes or failed or pinned or residency else None

    def close(self) -> None:
        for req_id in list(self._pins):
            self._unpin(req_id)
        if self._loader is not None:
            self._loader.close()
        if self._hidden is not None:
            self._hidden.close()
        self.stack.close()
