"""Budgets of launches, syncs and allocations that the CPU suite holds the GPU path to.

A CPU cannot time a GPU, but it can count what would cost time there. These tests drive hcache's serving
engine over the reference engine (a tiny random Llama) and count, at the aten dispatch level
(:class:`Counter`), what a restore and a saving forward ask of the device:

- **host syncs**: ops that make the host wait for the device when their operand is on a GPU.
- **device ops**: non-view aten ops touching a device tensor, a proxy for kernel launches and copies.
- **engine calls** per restored layer.

On a CPU every tensor lives in host memory, so "device tensor" needs a rule. The one here: a tensor is a
*host* tensor iff its storage is hcache's host pool (the pinned arena every chunk lives in; on a GPU, the
only host memory a restore or a save touches); every other tensor is a device tensor, as it would be on a
GPU (the cache, weights, activations, slots). So a hostward copy is a copy into the pool from elsewhere,
and a sync is a sync op (``_local_scalar_dense`` — ``item()``, ``int()``, ``bool()`` —, ``nonzero``,
``masked_select``, ``equal``, boolean-mask indexing...) on a device tensor, or ``tolist()``, ``cpu()``,
``numpy()`` of one. Host bookkeeping must therefore stay in Python ints and lists, never round-trip
through a tensor: strict, but then a count of zero here is zero on a GPU. Work on the host pool's own
bytes (checksums of chunks) is host work by construction and is not counted.

Streams, events and ``pin_memory`` calls are counted in the GPU branches of hcache's own copy paths,
driven on the CPU by :class:`FakeCuda` (stream and event objects that count themselves; copies run
inline). hcache's one pinned buffer is the host pool, registered once per store (tests/storage/test_host_pool.py).

``pytest -s`` prints every count; a broken budget fails with the count it found.
"""

from __future__ import annotations

import collections
import contextlib
import itertools

import pytest
import torch
from support.budgets import Counter, FakeCuda, counting
from support.helpers import random_prompt, serving_engine

import hcache.serving.engine as serving_module
import hcache.storage.chunk_key as chunk_key
import hcache.transfer.copier as copier_module
from hcache.engine.reference import ReferenceEngine
from hcache.model.fingerprint import model_fingerprint
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.planning.plan import Method, RestorePlan
from hcache.storage.chunk_key import CHUNK_TOKENS

LAYERS = 4
FEW = 16  # chunks of a restore, whose budgets are those of many more
PLANS = ["RE", "H", "KV", f"1RE+{LAYERS - 2}H+1KV"]


@pytest.fixture(scope="module")
def model():
    model = random_model(
        "llama", num_hidden_layers=LAYERS, max_position_embeddings=256 * CHUNK_TOKENS + 64
    )  # the longest history
    return model, ModelSpec.from_config(model.config, torch.float32)


def _serving(model, tmp_path, plan: str, num_blocks: int = 40, **settings):
    model, spec = model
    engine = ReferenceEngine(model, spec, num_blocks=num_blocks)
    return serving_engine(
        engine,
        model_fingerprint(model, spec),
        tmp_path,
        model_name="budget",
        plan=plan,
        save="all",
        readers=0,
        **settings,
    )


class Restores:
    """Counts each restore (``restore_prefix`` from start to end) and the engine's restore calls per layer."""

    def __init__(self, serving, monkeypatch):
        self.serving, self.monkeypatch = serving, monkeypatch
        self.counters: list[Counter] = []
        self.calls: collections.Counter = collections.Counter()  # (primitive, layer) -> calls
        restore = serving_module.restore_prefix

        def counted(*args, **kwargs):
            with counting(Counter(serving.stack.store.pool.arena), monkeypatch) as counter:
                self.counters.append(counter)
                return restore(*args, **kwargs)

        monkeypatch.setattr(serving_module, "restore_prefix", counted)
        for name in ("restore_kv", "restore_from_hidden"):
            self._count_calls(serving.engine, name)
        recompute = serving.engine.recompute_layers

        def recompute_apart(*args, **kwargs):  # the RE layers' compute, which grows with tokens as a prefill does
            with self.counters[-1].apart():
                return recompute(*args, **kwargs)

        monkeypatch.setattr(serving.engine, "recompute_layers", recompute_apart)

    def _count_calls(self, engine, name: str) -> None:
        original = getattr(engine, name)

        def call(uid, layer, *args, **kwargs):
            self.calls[(name, layer)] += 1
            return original(uid, layer, *args, **kwargs)

        self.monkeypatch.setattr(engine, name, call)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """``saved(chunks, stored_dtype)``: a serving engine built on hcache's GPU branches (fake streams) that
    has saved a history of that many chunks, every layer as H and KV, and the history; made once a module."""
    made, tmp = {}, tmp_path_factory.mktemp("budgets")
    with contextlib.ExitStack() as stack:

        def history(chunks: int, stored_dtype: str):
            if (chunks, stored_dtype) not in made:
                rng = torch.Generator().manual_seed(chunks)
                prompt = random_prompt(chunks * CHUNK_TOKENS + 1, model[1].vocab_size, rng)
                blocks = 2 * -(-len(prompt) // ReferenceEngine.BLOCK_SIZE)  # the saved sequence's, a restore's
                with pytest.MonkeyPatch.context() as patch:
                    FakeCuda(patch)
                    where = tmp / f"{chunks}-{stored_dtype}"
                    serving = stack.enter_context(_serving(model, where, "KV", blocks, stored_dtype=stored_dtype))
                    serving.put([0], [prompt])
                    serving.flush(0)
                    serving.stack.store.flush()  # its writers idle before another engine's restore is counted
                made[chunks, stored_dtype] = serving, prompt
            return made[chunks, stored_dtype]

        yield history


def _restore(
    saved, monkeypatch, plan: str, chunks: int, stored_dtype: str = "auto"
) -> tuple[Counter, collections.Counter]:
    """Restore a saved ``chunks``-chunk history by ``plan`` in one put, on the GPU branches; its counts."""
    serving, prompt = saved(chunks, stored_dtype)
    FakeCuda(monkeypatch)
    restores = Restores(serving, monkeypatch)
    uid = next(_UIDS)
    serving.open(uid, plan=plan)
    serving.put([uid], [prompt])
    assert serving.record(uid).restored_tokens == chunks * CHUNK_TOKENS
    serving.flush(uid)
    (counter,) = restores.counters
    return counter, restores.calls


_UIDS = itertools.count(1)  # a restore's sequence (0 saved each history)


def _holds_budgets(found: dict, plan: str, stored_dtype: str = "auto") -> None:
    """No host sync; one engine call per stored layer; one transfer from the pool per stored layer (each
    tensor of it, 8-bit codes and scales apart), however many chunks; the same device ops for few chunks as
    for many."""
    stored = sum(method is not Method.RE for method in RestorePlan.parse(plan, LAYERS).layers)
    transfers_per_layer = 2 if stored_dtype == "8bit" else 1
    plan = f"{plan} {stored_dtype}"
    for n, (counter, calls) in found.items():
        print(
            f"\n{plan}, {n} chunks: {sum(counter.ops.values())} device ops {dict(counter.ops)}; "
            f"{counter.deviceward} transfers from the pool; syncs {dict(counter.syncs)}; engine calls {dict(calls)}"
        )
    for n, (counter, calls) in found.items():
        assert not counter.syncs, f"{plan}, {n} chunks: host syncs during a restore: {dict(counter.syncs)}"
        assert set(calls.values()) <= {1}, f"{plan}, {n} chunks: engine calls per layer: {dict(calls)}"
        assert counter.deviceward == transfers_per_layer * stored, (
            f"{plan}, {n} chunks: {counter.deviceward} transfers from the pool for {stored} stored layers"
        )
    (few, _), (many, _) = found.values()
    assert many.ops == few.ops, f"{plan}: device ops grow with chunks: {dict(few.ops)}, then {dict(many.ops)}"


MANY = [64, pytest.param(256, marks=pytest.mark.slow)]  # chunks, against 16: the quick check's, the suite's


@pytest.mark.parametrize("many", MANY)
@pytest.mark.parametrize("plan", PLANS)
def test_a_restore_never_syncs_and_its_work_does_not_grow_with_chunks(saved, monkeypatch, plan, many):
    """From a restore's start to its end, on the GPU branches: a KV layer is one transfer from the pool (a
    gather reading every chunk's slot in place) and one scatter, an H layer one gather and one projection,
    at 16 chunks as at 256; an RE layer's compute aside."""
    _holds_budgets({n: _restore(saved, monkeypatch, plan, n) for n in (FEW, many)}, plan)


def test_a_put_hashes_each_chunk_once_for_its_lookups(model, tmp_path, monkeypatch, rng):
    """A put of several sequences, with the GPU prefix cache, prefetches, adopts and restores: its chunk keys
    are hashed once for all three look-ups, and once more as the sequence's key chain takes the tokens
    (the chain computes its own keys)."""
    prompts = [random_prompt(3 * CHUNK_TOKENS + 1, model[1].vocab_size, rng) for _ in range(2)]
    with _serving(model, tmp_path, "KV", gpu_cache=True) as serving:
        serving.put([0, 1], prompts)
        serving.flush(0)
        hashes = collections.Counter()
        next_key = chunk_key.next_key

        def counted(parent, tokens):
            hashes[tuple(tokens)] += 1
            return next_key(parent, tokens)

        monkeypatch.setattr(chunk_key, "next_key", counted)
        serving.put([2, 3], prompts)
        assert serving.record(2).gpu_tokens and serving.record(3).restored_tokens  # adopted, and restored
    print(f"\nhashes per chunk in one put: {sorted(hashes.values())}")
    assert len(hashes) == 6 and max(hashes.values()) == 2, (
        f"hashes per chunk in one put: {dict(collections.Counter(hashes.values()))}"
    )


def test_a_saving_forward_never_syncs_and_copies_each_chunk_to_the_host_once(model, tmp_path, monkeypatch, rng):
    """The forwards of a prefill and of decode steps that save every layer as H and KV, with the saver
    staging rows as on a GPU: no host sync, and no copy to the host until a chunk is full, then one copy of
    the whole chunk (all its tensors), not one per layer, format and sequence at every step."""
    prompt = random_prompt(100, model[1].vocab_size, rng)
    with _serving(model, tmp_path, "KV") as serving:
        serving.stack.saver.stage = True
        counters = []
        step = serving.engine.step

        def counted(requests, capture=None):
            with counting(Counter(serving.stack.store.pool.arena), monkeypatch) as counter:
                counters.append(counter)
                return step(requests, capture)

        monkeypatch.setattr(serving.engine, "step", counted)
        serving.put([0], [prompt])  # chunk 0 is full
        for token in range(40):  # chunk 1 is full at the 28th decode step
            serving.put([0], [[token]])
        serving.flush(0)
        assert serving.stack.saver.chunks_published == 2
    hostward = [c.hostward for c in counters]
    syncs = collections.Counter()
    for c in counters:
        syncs.update(c.syncs)
    print(f"\nhostward copies per forward (prefill, then 40 decode steps): {hostward}; syncs {dict(syncs)}")
    assert not syncs, f"host syncs in saving forwards: {dict(syncs)}"
    assert hostward == [1] + [0] * 27 + [1] + [0] * 12, f"hostward copies per forward: {hostward}"


def test_streams_events_and_pinned_memory_are_made_once_not_per_restore_or_layer(model, tmp_path, monkeypatch, rng):
    """hcache's GPU branches (the restore copier's side stream and events, the saver's staging and save
    stream), driven on the CPU with fake streams: after the serving engine is built, a first save and
    restore make the saver's stream and its landing events; more saves and restores by every plan, over more
    chunks and layers, make nothing more. Restores stay exact on the GPU branches."""
    cuda = FakeCuda(monkeypatch)
    spec = model[1]
    with _serving(model, tmp_path, "KV") as serving:
        built = dict(cuda.made)
        logits, restored = {}, {}

        def turn(uid: int, prompt: list[int], plan: str) -> None:
            serving.open(uid, plan=plan)
            logits[uid] = serving.put([uid], [prompt])
            restored[uid] = serving.record(uid).restored_tokens
            serving.put([uid], [[1]])  # a decode step saves too
            serving.flush(uid)

        short = random_prompt(2 * CHUNK_TOKENS + 1, spec.vocab_size, rng)
        turn(0, short, "KV")
        turn(1, short, "KV")
        first = dict(cuda.made)
        long = short[:-1] + random_prompt(6 * CHUNK_TOKENS + 1, spec.vocab_size, rng)
        for uid, plan in enumerate(PLANS, start=2):
            turn(uid, long, plan)
        assert restored == {0: 0, 1: 2 * CHUNK_TOKENS} | {uid: 2 * CHUNK_TOKENS for uid in range(2, 3)} | {
            uid: 8 * CHUNK_TOKENS for uid in range(3, 2 + len(PLANS))
        }
    print(
        f"\nmade with the engine {built}; by the first save and restore {first}; after {len(PLANS)} more {dict(cuda.made)}"
    )
    assert built == {"Stream": 1, "Event": copier_module.DEFAULT_DEPTH + 1}, f"made with the engine: {built}"
    assert first["Stream"] == 2 and cuda.made == first, (
        f"made by restores and saves: first {first}, then {dict(cuda.made)}"
    )
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    for uid in range(3, 2 + len(PLANS)):
        torch.testing.assert_close(logits[uid], logits[2], atol=1e-5, rtol=1e-5)


def test_a_restores_copies_wait_for_its_allocation_not_for_its_re_layers(model, tmp_path, monkeypatch, rng):
    """The copy stream is ordered after the compute queued when the restore's blocks were allocated, before
    the RE layers are queued: its copies then overlap those layers, as the scheduler's plan assumes."""
    cuda = FakeCuda(monkeypatch)
    prompt = random_prompt(2 * CHUNK_TOKENS + 1, model[1].vocab_size, rng)
    with _serving(model, tmp_path, "1RE+2H+1KV") as serving:
        serving.put([0], [prompt])
        serving.flush(0)
        for name in ("begin_restore", "recompute_layers"):
            original = getattr(serving.engine, name)
            monkeypatch.setattr(serving.engine, name, lambda *a, _f=original, _n=name: (cuda.log.append(_n), _f(*a))[1])
        cuda.log.clear()
        serving.put([1], [prompt])
    print(f"\norder: {cuda.log}")
    assert cuda.log[:3] == ["begin_restore", "copies wait for compute", "recompute_layers"], cuda.log


@pytest.mark.parametrize("many", MANY)
@pytest.mark.parametrize("plan", ["H", "KV"])
def test_a_restore_from_8_bit_state_never_syncs_and_its_work_does_not_grow_with_chunks(saved, monkeypatch, plan, many):
    """Dequantising 8-bit state happens on the device inside the restore: its codes and its scales are a
    transfer each."""
    found = {n: _restore(saved, monkeypatch, plan, n, "8bit") for n in (FEW, many)}
    _holds_budgets(found, plan, "8bit")
