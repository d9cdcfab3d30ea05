"""The worker's side of hcache's vLLM connector: it owns the store stack, loads stored chunks into vLLM's
paged cache layer by layer, and saves what the forward computes.

Each step, when vLLM binds the scheduler's metadata (before the forward), the chunks to load are fetched
into the host pool on the stack's reader threads and the saver opens the step's batch. Each attention
layer then waits for its load (:meth:`WorkerSide.load_layer`): the first waits for the fetches and
verifies every chunk (the same rule as every restore, :func:`~hcache.serving.restore.verify_fetched`), and
each writes its own layer's K/V into the cache, by the request's plan: the stored K/V rows (KV) or K/V
rebuilt from the stored hidden states with the layer's own weights (H, :mod:`hcache.vllm.hidden`). So a
layer's rows land just before it runs, and the disk reads overlap the steps before them. After the layer's
attention has written the new tokens' K/V, :meth:`save_layer` reads them back and hands them, with the
layer's captured input where hidden states are saved, to the saver, which fills host-pool chunks off the
forward's path and writes them back to the stores.

A chunk that is gone, unreadable or bad ends what is loaded there: its blocks and those after it are
reported as load errors, and vLLM (``kv_load_failure_policy="recompute"``) computes them again. The worker
never writes state it has not verified.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..engine.ragged import Segment
from ..model.spec import ModelSpec
from ..model.tensor_parallel import SINGLE
from ..planning.plan import Method, RestorePlan
from ..serving.records import MissReason, PutRestore, SequenceRecord
from ..serving.restore import lookup_miss, restore_accounting, verify_fetched
from ..serving.store_stack import StoreStack
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain, root_key
from ..storage.stored_state import decode, stored_rows
from .hidden import HiddenLayers, registering_model
from .layout import PagedLayout
from .metadata import HCacheStepMetadata, RequestStep
from .settings import VllmSetup, uses_hidden_states

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmModel:
    """What the store stack needs of an engine: its model's facts and its device."""

    spec: ModelSpec
    device: torch.device


@dataclass
class _Sequence:
    uid: int
    chain: KeyChain
    tokens: list[int] = field(default_factory=list)
    record: SequenceRecord = field(default_factory=SequenceRecord)


@dataclass
class _Load:
    """One request's load this step: positions ``[start, end)`` from chunks ``first`` onwards."""

    step: RequestStep
    seq: _Sequence
    first: int
    keys: list[str]
    fetches: list
    slots: tuple  # (blocks, offsets) of positions [step.load_start, step.load_end) in the cache
    plan: RestorePlan  # each layer's method: H or KV
    images: list = field(default_factory=list)
    end: int = 0  # the verified end, once the fetches are in
    positions: torch.Tensor | None = None  # of the verified tokens, on the cache's device: made once for every H layer


class WorkerSide:
    def __init__(self, setup: VllmSetup, device: torch.device, attention_layers: dict):
        self.setup, self.config = setup, setup.config
        self.stack = StoreStack(setup.config, VllmModel(setup.config.spec, device), setup.fingerprint, SINGLE)
        self._attention = attention_layers  # layer name -> vLLM's Attention module (its backend's cache write)
        self._layers: dict[str, tuple[int, torch.Tensor, PagedLayout]] = {}
        self._seqs: dict[str, _Sequence] = {}
        self._uids = itertools.count()
        self._loads: list[_Load] = []
        self._fetched = False
        self._computing: list[tuple[RequestStep, _Sequence]] = []  # this step's requests with tokens to compute
        self._computed_slots: tuple | None = None  # (blocks, offsets) of the tokens this step computes
        self._elements: dict[tuple[int, int], torch.Tensor] = {}  # this step's element indices, by (layout, load or -1)
        self._kernel_block = 0  # tokens in a block of the cache tensors (vLLM may split its blocks into smaller ones)
        self._hidden: HiddenLayers | None = None  # the model's layers, where hidden states are saved or restored
        self._errors: set[int] = set()
        log_path = setup.config.settings.request_log
        self.request_log = Path(log_path) if log_path is not None else None

    # ---- set-up ---------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn each layer's cache and its layout: probed through the backend's own cache write where it
        has one, else the standardized layout's strides. Layers whose caches are laid out alike share one."""
        from vllm.model_executor.models.utils import extract_layer_index

        layouts: dict[tuple, PagedLayout] = {}
        for name, cache in kv_caches.items():
            module = self._attention.get(name)
            write = getattr(getattr(module, "impl", None), "do_kv_cache_update", None)
            signature = (tuple(cache.shape[1:]), cache.stride(), cache.dtype, getattr(module, "isa", None), write is None)
            if signature not in layouts:
                layouts[signature] = (
                    PagedLayout.probe(lambda k, v, c, s: write(module, k, v, c, s), cache) if write is not None else PagedLayout.split_kv(cache)
                )
            self._layers[name] = (extract_layer_index(name), cache, layouts[signature])
            self._kernel_block = cache.shape[2]
        spec = self.config.spec
        layout = next(iter(layouts.values()))
        if (layout.num_heads, layout.head_size) != (spec.num_kv_heads, spec.head_size):
            raise RuntimeError(f"vLLM's cache holds {layout.num_heads} heads of {layout.head_size}; the model has "
                               f"{spec.num_kv_heads} KV heads of {spec.head_size}")  # fmt: skip
        if uses_hidden_states(self.config):
            saved = frozenset(layer for layer, formats in enumerate(self.config.save_formats) if Method.H.value in formats)
            layers = {layer: name for name, (layer, _, _) in self._layers.items()}
            self._hidden = HiddenLayers(spec, registering_model(self._attention), layers, saved if self.stack.saver else frozenset())

    # ---- each step --------------------------------------------------------------------------------------
    def begin_step(self, metadata: HCacheStepMetadata) -> None:
        """Before the forward: sequences opened or continued, loads fetched, the saver's batch begun."""
        self._loads, self._fetched, self._errors, self._elements = [], False, set(), {}
        requests = [(step, self._sequence(step)) for step in metadata.requests]
        for step, seq in requests:
            if step.load_end > step.load_start and self.stack.store is not None:
                self._fetch(step, seq)
        self._computing = [(step, seq) for step, seq in requests if step.length]
        if self._computing:
            slots = [self._slots(step, step.start, step.start + step.length) for step, _ in self._computing]
            self._computed_slots = torch.cat([b for b, _ in slots]), torch.cat([o for _, o in slots])
            if self._hidden is not None and self.stack.saver is not None:
                blocks, offsets = self._computed_slots
                self._hidden.select(blocks * self._kernel_block + offsets)
        if self._computing and self.stack.saver is not None:
            starts = itertools.accumulate((step.length for step, _ in self._computing), initial=0)
            self.stack.saver.begin_batch([Segment(seq.uid, step.start, step.length, row) for (step, seq), row in zip(self._computing, starts)])

    def _sequence(self, step: RequestStep) -> _Sequence:
        seq = self._seqs.get(step.req_id)
        if step.new or seq is None:
            if seq is not None and self.stack.saver is not None:
                self.stack.saver.close(seq.uid)
            root = root_key(self.stack.fingerprint, step.namespace)
            seq = self._seqs[step.req_id] = _Sequence(next(self._uids), KeyChain(root))
            if self.stack.saver is not None:
                self.stack.saver.open(seq.uid, seq.chain)
        seq.tokens += step.tokens
        seq.chain.extend(step.tokens)
        return seq

    def _fetch(self, step: RequestStep, seq: _Sequence) -> None:
        first, last = step.load_start // CHUNK_TOKENS, -(-step.load_end // CHUNK_TOKENS)
        keys = [key for key, _ in seq.chain.chunks[first:last]]
        fetches = [self.stack.store.fetch(key) for key in keys]
        plan = self.config.plan_for(self.config.plan, step.load_end - step.load_start)
        self._loads.append(_Load(step, seq, first, keys, fetches, self._slots(step, step.load_start, step.load_end), plan))

    def _verify(self) -> None:
        """Wait for this step's fetches and keep each load's verified prefix; the blocks of what fell short
        are load errors."""
        self._fetched = True
        for load in self._loads:
            step, start = load.step, load.first * CHUNK_TOKENS
            began = time.perf_counter()
            why, miss = verify_fetched(
                self.stack.store, load.keys, load.fetches, load.images, load.seq.tokens[start:], self.stack.fingerprint,
                load.plan, SINGLE, 0, self.config.spec,
            )  # fmt: skip
            self._release(load.fetches[len(load.images) :])  # those past the prefix's end, fetched all the same
            load.end = min(step.load_end, start + len(load.images) * CHUNK_TOKENS)
            if load.end < step.load_end:
                first_bad = load.end // self.setup.block_size
                self._errors.update(step.block_ids[first_bad : -(-step.load_end // self.setup.block_size)])
                miss = miss or lookup_miss(self.stack.store, load.keys[len(load.images)])
            sources = Counter()
            for j, image in enumerate(load.images):
                lo, hi = max(step.load_start, (load.first + j) * CHUNK_TOKENS), min(load.end, (load.first + j + 1) * CHUNK_TOKENS)
                sources[self.stack.store.take_source(image)] += max(0, hi - lo)
            restored = load.end - step.load_start if load.end > step.load_start else 0
            missed = {miss.value: step.load_end - max(load.end, step.load_start)} if miss is not None and step.load_end > load.end else {}
            jobs = [(layer, method.value) for layer, method in enumerate(load.plan.layers)]
            used, lossy = restore_accounting(load.images, jobs, list(range(len(load.images))), len(load.images))
            load.seq.record.add(PutRestore(
                plan=str(load.plan), tokens=restored, sources=dict(sources), restore_s=time.perf_counter() - began,
                bytes_read=used, fallback=why, misses=missed, lossy=lossy,
                layer_tokens={m.value: restored * load.plan.count(m) for m in (Method.H, Method.KV) if load.plan.count(m)},
            ))  # fmt: skip

    def _release(self, fetches: list) -> None:
        for fetch in fetches:
            image = fetch.result() if fetch.exception() is None else None
            if image is not None:
                self.stack.store.release(image)

    def load_layer(self, name: str) -> None:
        """Before layer ``name``'s attention: its K/V of this step's verified loads, into the cache: the
        stored rows (KV) or rebuilt from the stored hidden states (H)."""
        if not self._loads or name not in self._layers:
            return
        if not self._fetched:
            self._verify()
        layer, cache, layout = self._layers[name]
        for i, load in enumerate(self._loads):
            step = load.step
            n = load.end - step.load_start
            if n <= 0:
                continue
            method = load.plan.layers[layer]
            rows = torch.cat([decode(stored_rows(image, layer, method.value), cache.dtype) for image in load.images])
            offset = step.load_start - load.first * CHUNK_TOKENS
            rows = rows[offset : offset + n]
            if method is Method.H:
                if load.positions is None:
                    load.positions = torch.arange(step.load_start, step.load_start + n, device=cache.device)
                rows = self._hidden.rebuild(layer, rows.to(cache.device), load.positions)
            layout.write(cache, self._indices(layout, i, lambda: (load.slots[0][:n], load.slots[1][:n])), rows)

    def save_layer(self, name: str, cache: torch.Tensor) -> None:
        """After layer ``name``'s attention wrote this step's K/V: its hidden states and K/V rows to the
        saver. A layer whose hidden states were not captured hands over nothing, and the saver saves none of
        this step's chunks (it logs a forward that skipped a layer)."""
        if not self._computing or self.stack.capture is None or name not in self._layers:
            return
        layer, _, layout = self._layers[name]
        hidden = self._hidden.captured(layer) if self._hidden is not None else None
        if hidden is None and Method.H.value in self.config.save_formats[layer]:
            return
        elements = self._indices(layout, -1, lambda: self._computed_slots)
        self.stack.capture.on_layer(layer, hidden, lambda: layout.read(cache, elements))

    def _indices(self, layout: PagedLayout, load: int, slots) -> torch.Tensor:
        """The element indices of a load's tokens (``load`` -1: the computed tokens) in caches laid out by
        ``layout``: made by the step's first layer, on the cache's device, and used by every layer."""
        key = (id(layout), load)
        if key not in self._elements:
            self._elements[key] = layout.elements(*slots())
        return self._elements[key]

    def _slots(self, step: RequestStep, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache blocks and offsets in them of positions ``[start, end)``: vLLM's blocks may be split
        into smaller kernel blocks, which the cache tensors hold."""
        kernel = self._kernel_block
        positions = torch.arange(start, end)
        block_ids = torch.tensor(step.block_ids, dtype=torch.int64)[positions // self.setup.block_size]
        within = positions % self.setup.block_size
        return block_ids * (self.setup.block_size // kernel) + within // kernel, within % kernel

    def end_step(self) -> None:
        """After the forward: the saver's batch lands, and the loads' chunks go back to the pool. A load no
        attention layer took (a step that ran no layer) loaded nothing: its blocks are load errors."""
        if self._computing and self.stack.saver is not None:
            self.stack.saver.end_batch()
        for load in self._loads:
            if self._fetched:
                for image in load.images:
                    self.stack.store.release(image)
            else:
                self._release(load.fetches)
                bs = self.setup.block_size
                self._errors.update(load.step.block_ids[load.step.load_start // bs : -(-load.step.load_end // bs)])
        for step, seq in self._computing:
            seq.record.computed_tokens += step.length
        self._loads, self._computing, self._computed_slots, self._elements = [], [], None, {}
        if self._hidden is not None:
            self._hidden.select(None)

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def finished(self, req_ids: set[str]) -> None:
        """Requests vLLM is done with: their full chunks are published and written back, so the next turn
        of the conversation, here or in a restarted vLLM, finds them; then their records are logged."""
        done = [(req_id, self._seqs.pop(req_id)) for req_id in req_ids if req_id in self._seqs]
        if not done:
            return
        for _, seq in done:
            if self.stack.saver is not None:
                self.stack.saver.close(seq.uid)
        if self.stack.store is not None:
            self.stack.store.flush()
        if self.request_log is not None:
            with os.fdopen(os.open(self.request_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
                for req_id, seq in done:
                    f.write(json.dumps({"request_id": req_id, "time": time.time(), **asdict(seq.record)}) + "\n")

    def close(self) -> None:
        if self._hidden is not None:
            self._hidden.close()
        self.stack.close()
