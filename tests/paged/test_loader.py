"""The paged loader (hcache/paged/loader.py) without vLLM: a stored prefix, saved by the serving engine
over the reference engine, loaded into a paged cache laid out as FlashAttention's, in blocks split into
smaller kernel blocks, from inside a chunk; a chunk gone since the look-up ends the load there, with its
blocks reported and its key told lost, and a corrupt one with its check; and the budgets a GPU would hold
it to, counted on the CPU."""

import shutil
import signal

import pytest
import torch
from support.budgets import Counter, FakeCuda, counting
from support.helpers import corrupt_tensor, random_prompt, serving_engine

from hcache.engine.reference import ReferenceEngine
from hcache.model.fingerprint import model_fingerprint
from hcache.model.random_weights import random_model
from hcache.model.spec import ModelSpec
from hcache.paged import copy_process
from hcache.ops.paged_kv import block_slots
from hcache.ops.paged_layout import PagedLayout
from hcache.paged.load_job import LoadJob
from hcache.paged.loader import Loader
from hcache.paged.target import PagedLayer
from hcache.planning.plan import Method, RestorePlan
from hcache.restore.records import MissReason, SequenceRecord
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from hcache.storage.stored_state import decode_rows, stored_rows

LAYERS, BLOCK, KERNEL_BLOCK = 3, 32, 16


@pytest.fixture(scope="module")
def model():
    model = random_model("llama", num_hidden_layers=LAYERS, max_position_embeddings=256 * CHUNK_TOKENS + 64)
    return model, ModelSpec.from_config(model.config, torch.float32)


def _saved(model, tmp_path, rng, chunks: int, **settings):
    """A serving engine whose store holds a ``chunks``-chunk prompt, every format, and the prompt."""
    model, spec = model
    blocks = max(40, chunks + 2)  # of the reference engine's 64 tokens
    serving = serving_engine(
        ReferenceEngine(model, spec, num_blocks=blocks),
        model_fingerprint(model, spec),
        tmp_path,
        save="all",
        **settings,
    )
    prompt = random_prompt(chunks * CHUNK_TOKENS + 1, spec.vocab_size, rng)
    serving.put([0], [prompt])
    serving.flush(0)
    return serving, prompt


def _cache(spec: ModelSpec, blocks: int) -> list[PagedLayer]:
    """One FlashAttention-layout cache per layer (physically [blocks, tokens, heads, 2 x head], viewed as
    vLLM hands it over)."""
    caches = [
        torch.zeros(blocks, KERNEL_BLOCK, spec.num_kv_heads, 2 * spec.head_size).transpose(1, 2) for _ in range(LAYERS)
    ]
    layout = PagedLayout.split_kv(caches[0])
    return [PagedLayer(layer, cache, layout) for layer, cache in enumerate(caches)]


def _stored(serving, keys: list[str], fmt: str) -> list[torch.Tensor]:
    """Each layer's stored rows of ``keys``' chunks, in order."""
    images = [serving.stack.store.fetch(key).result() for key in keys]
    try:
        return [
            torch.cat([decode_rows(stored_rows(image, layer, fmt), torch.float32) for image in images])
            for layer in range(LAYERS)
        ]
    finally:
        for image in images:
            serving.stack.store.release(image)


def _assert_landed(serving, layers: list[PagedLayer], tokens: list[int], block_ids: list[int]) -> None:
    """Each layer's cache holds the stored KV rows of ``tokens``' chunks in ``block_ids``."""
    blocks, offsets = block_slots([(block_ids, 0, len(tokens))], BLOCK, KERNEL_BLOCK)
    stored = _stored(serving, chunk_keys(tokens, root_key(serving.fingerprint)), "KV")
    for layer in layers:
        assert torch.equal(layer.layout.read(layer.cache, layer.layout.elements(blocks, offsets)), stored[layer.index])


def _load(loader: Loader, job: LoadJob) -> tuple[set[int], SequenceRecord]:
    record = SequenceRecord()
    loader.submit(job, record)
    done: dict[str, set[int]] = {}
    while not done:
        done = loader.finished()
    assert set(done) == {job.req_id}
    return done[job.req_id], record


def _rebuild(spec: ModelSpec, rng):
    weight = torch.randn(spec.hidden_size, 2 * spec.kv_dim, generator=rng)

    def rebuild(layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # any K/V rule will do
        return (hidden @ weight + positions[:, None] + layer).view(len(hidden), 2, spec.num_kv_heads, spec.head_size)

    return rebuild


@pytest.mark.parametrize(
    "plan, stored_dtype, process",
    [
        ("KV", "auto", False),
        ("H", "auto", False),
        ("2H+1KV", "auto", False),
        ("2H+1KV", "fp8", False),
        ("KV", "int8", False),
        ("KV", "auto", True),
        ("2H+1KV", "fp8", True),
        ("KV", "int8", True),
    ],
)
def test_a_stored_prefix_lands_in_its_blocks_from_inside_a_chunk(
    model, tmp_path, rng, monkeypatch, plan, stored_dtype, process
):
    """Each layer by its plan's method; H's rebuilds run a layer behind the copies (the restore's pipeline);
    8-bit rows decoded as every restore decodes them. Over a shareable host pool (vLLM's CPU worker's), the
    KV layers are written by the load process, into the same caches, and none by this process."""
    spec = model[1]
    serving, prompt = _saved(model, tmp_path, rng, 4, plan=plan, stored_dtype=stored_dtype, shareable_pool=process)
    rebuild = _rebuild(spec, rng)
    methods = RestorePlan.parse(plan, LAYERS).layers
    layers = _cache(spec, 40)
    loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, layers, rebuild)
    assert (loader._process is not None) == process
    written = []  # the layers this process writes
    write = PagedLayout.write
    monkeypatch.setattr(
        PagedLayout,
        "write",
        lambda self, cache, *a: (
            written.append(next(x.index for x in layers if x.cache is cache)) or write(self, cache, *a)
        ),
    )
    block_ids = [9, 2, 14, 5, 11, 7, 3, 1]  # 32-token blocks, each two 16-token kernel blocks
    start, end = 40, 4 * CHUNK_TOKENS  # from inside the first chunk (after a prefix-cache hit, say)
    try:
        errors, record = _load(loader, LoadJob("r", None, prompt[:end], [block_ids], start, end))
        by_h = [layer for layer, method in enumerate(methods) if method is Method.H]
        assert sorted(written) == (by_h if process else list(range(LAYERS)))
        assert not errors and record.restored_tokens == end - start and record.tier_tokens == {"host": end - start}
        assert record.plan == str(RestorePlan.parse(plan, LAYERS)) and not record.miss_tokens
        blocks, offsets = block_slots([(block_ids, start, end)], BLOCK, KERNEL_BLOCK)
        keys = chunk_keys(prompt[:end], root_key(serving.fingerprint))
        stored = {m: _stored(serving, keys, m) for m in ("H", "KV")}
        positions = torch.arange(start, end)
        for layer, method in zip(layers, methods):
            rows = layer.layout.read(layer.cache, layer.layout.elements(blocks, offsets))
            want = stored[method.value][layer.index][start:end]
            torch.testing.assert_close(
                rows, rebuild(layer.index, want, positions) if method is Method.H else want, rtol=0, atol=0
            )
        untouched = torch.ones(40 * KERNEL_BLOCK, dtype=torch.bool)
        untouched[blocks * KERNEL_BLOCK + offsets] = False
        assert not layers[0].cache.transpose(1, 2).reshape(-1, spec.num_kv_heads * 2 * spec.head_size)[untouched].any()
    finally:
        loader.close()
        serving.close()


@pytest.mark.parametrize("stored_dtype", ["auto", "int8", "fp8"])
def test_a_cpu_load_stages_its_rows_in_kept_buffers(model, tmp_path, rng, stored_dtype):
    """On a CPU, a load stages no rows in new memory once an earlier one of its length has (it makes only its
    tokens' places), 8-bit rows decoded there too: a fresh tensor a layer costs
    the engine's own threads the kernel's unmapping of it (hcache/transfer/scratch.py). And a load into
    the buffers an earlier load used still lands its own rows."""
    from torch.profiler import ProfilerActivity, profile

    spec = model[1]
    serving, prompt = _saved(model, tmp_path, rng, 4, plan="KV", stored_dtype=stored_dtype)
    other = random_prompt(4 * CHUNK_TOKENS + 1, spec.vocab_size, rng)
    serving.put([1], [other])
    serving.flush(1)
    layers = _cache(spec, 40)
    loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, layers)
    end = 4 * CHUNK_TOKENS
    try:
        assert _load(loader, LoadJob("a", None, prompt[:end], [list(range(8))], 0, end))[0] == set()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            assert (
                loader._load(LoadJob("b", None, other[:end], [list(range(8, 16))], 0, end), SequenceRecord()) == set()
            )
        allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
        layer_rows = (
            end * 2 * spec.kv_dim * 4
        )  # one layer's rows staged, float32: a fresh tensor a layer would be LAYERS of them
        assert allocated < layer_rows, (
            f"a second load allocated {allocated} bytes (its places only would be {end * 3 * 8})"
        )
        _assert_landed(serving, layers, other[:end], list(range(8, 16)))
    finally:
        loader.close()
        serving.close()


@pytest.mark.parametrize("how", ["killed-between-loads", "hung-in-a-load"])
def test_a_load_process_lost_leaves_its_loads_to_the_thread_and_never_a_load_half_known(
    model, tmp_path, rng, monkeypatch, how
):
    """The load process killed before a load: nothing of it was sent, and the thread writes it, and it lands.
    The process hung while it has a load (stopped): after :data:`REPLY_S` it is killed and that load reports
    every block (recomputed: nothing unknown served). Either way the loads after it are written by the
    loader's thread, and land."""
    monkeypatch.setattr(copy_process, "REPLY_S", 1.0)
    spec = model[1]
    serving, prompt = _saved(model, tmp_path, rng, 2, plan="KV", shareable_pool=True)
    layers = _cache(spec, 40)
    loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, layers)
    end, block_ids = 2 * CHUNK_TOKENS, [3, 1, 4, 0]
    try:
        child = loader._process._child
        if how == "killed-between-loads":
            child.kill()
            child.wait()
        else:
            child.send_signal(signal.SIGSTOP)
        errors, _ = _load(loader, LoadJob("a", None, prompt[:end], [block_ids], 0, end))
        assert errors == (set() if how == "killed-between-loads" else set(block_ids))
        assert loader._process is None and child.poll() is not None
        errors, record = _load(loader, LoadJob("b", None, prompt[:end], [block_ids], 0, end))
        assert not errors and record.restored_tokens == end
        _assert_landed(serving, layers, prompt[:end], block_ids)
    finally:
        loader.close()
        serving.close()


def test_the_load_process_ends_with_its_loader(model, tmp_path, rng):
    serving, _ = _saved(model, tmp_path, rng, 1, plan="KV", shareable_pool=True)
    loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, _cache(model[1], 8))
    child = loader._process._child
    try:
        assert child.poll() is None
    finally:
        loader.close()
        serving.close()
    assert child.poll() == 0


def test_a_chunk_gone_since_the_look_up_ends_the_load_and_is_told_lost(model, tmp_path, rng):
    spec = model[1]
    serving, prompt = _saved(model, tmp_path, rng, 4, plan="KV")
    keys = chunk_keys(prompt[: 4 * CHUNK_TOKENS], root_key(serving.fingerprint))
    serving.stack.store.flush()
    serving.stack.store.drop_resident()
    serving.stack.store.stores[0].path(keys[2]).unlink()  # deleted from the disk after it was offered
    lost = []
    loader = Loader(
        serving.stack, (BLOCK,), KERNEL_BLOCK, _cache(spec, 40), lost=lambda key, reason: lost.append((key, reason))
    )
    block_ids = list(range(8))
    try:
        errors, record = _load(loader, LoadJob("r", None, prompt[: 4 * CHUNK_TOKENS], [block_ids], 0, 4 * CHUNK_TOKENS))
        assert errors == {4, 5, 6, 7}  # from position 128: the blocks vLLM computes again
        assert record.restored_tokens == 2 * CHUNK_TOKENS and record.miss_tokens == {"evicted": 2 * CHUNK_TOKENS}
        assert lost == [(keys[2], MissReason.EVICTED)] and lost[0][1] is MissReason.EVICTED
    finally:
        loader.close()
        serving.close()


def test_a_corrupt_chunk_ends_the_load_with_its_check_and_is_discarded(model, tmp_path, rng):
    serving, prompt = _saved(model, tmp_path, rng, 4, plan="KV")
    keys = chunk_keys(prompt[: 4 * CHUNK_TOKENS], root_key(serving.fingerprint))
    corrupt_tensor(serving.stack.store, keys[1], 2, "KV")
    loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, _cache(model[1], 40), lost=lambda key, reason: None)
    try:
        errors, record = _load(
            loader, LoadJob("r", None, prompt[: 4 * CHUNK_TOKENS], [list(range(8))], 0, 4 * CHUNK_TOKENS)
        )
        assert errors == {2, 3, 4, 5, 6, 7} and record.restored_tokens == CHUNK_TOKENS
        assert (
            record.miss_tokens == {"failed_verification": 3 * CHUNK_TOKENS}
            and "checksum mismatch in L0002.KV" in record.fallback
        )
        assert not serving.stack.store.contains(keys[1])  # discarded: the recompute saves a good one
    finally:
        loader.close()
        serving.close()


@pytest.mark.parametrize("damaged", [False, True])
def test_a_load_reports_a_stored_prefix_as_the_serving_engines_restore_does(model, tmp_path, rng, damaged):
    """One restore core for both integrations (restore/stored_prefix.py): the same stored prefix, in two
    copies of one store, loaded into a paged cache and restored by the serving engine, gives the same
    record: tokens by tier, bytes by layer type, plan, and, for a corrupt chunk, where and why it fell short."""
    loaded, spec = model
    saved, prompt = _saved(model, tmp_path / "a", rng, 4, plan="2H+1KV")
    saved.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    fingerprint = model_fingerprint(loaded, spec)
    restoring = serving_engine(
        ReferenceEngine(loaded, spec, num_blocks=40), fingerprint, tmp_path / "a", save="all", plan="2H+1KV"
    )
    loading = serving_engine(
        ReferenceEngine(loaded, spec, num_blocks=40), fingerprint, tmp_path / "b", save="all", plan="2H+1KV"
    )
    loader = Loader(loading.stack, (BLOCK,), KERNEL_BLOCK, _cache(spec, 40), _rebuild(spec, rng))
    try:
        if damaged:
            for serving in (restoring, loading):
                corrupt_tensor(serving.stack.store, chunk_keys(prompt, root_key(fingerprint))[2], 2, "KV")
        restoring.put([0], [prompt])
        _, loaded_record = _load(
            loader, LoadJob("r", None, prompt[: 4 * CHUNK_TOKENS], [list(range(8))], 0, 4 * CHUNK_TOKENS)
        )
        fields = (
            "restored_tokens",
            "tier_tokens",
            "bytes_read",
            "type_bytes",
            "plan",
            "fallback",
            "miss_tokens",
            "lossy",
        )
        restored = {name: getattr(restoring.record(0), name) for name in fields}
        assert restored == {name: getattr(loaded_record, name) for name in fields}
        assert restored["restored_tokens"] == (2 if damaged else 4) * CHUNK_TOKENS and restored["bytes_read"] > 0
        assert restored["miss_tokens"] == ({"failed_verification": 2 * CHUNK_TOKENS} if damaged else {})
    finally:
        loader.close()
        loading.close()
        restoring.close()


@pytest.mark.parametrize(
    "plan, many",
    [("KV", 64), ("H", 64), ("2H+1KV", 64), pytest.param("2H+1KV", 256, marks=pytest.mark.slow)],
)
def test_a_load_never_syncs_its_work_does_not_grow_with_chunks_and_makes_no_stream(
    model, tmp_path, rng, monkeypatch, plan, many
):
    """Counted as tests/serving/test_gpu_budgets.py counts a restore: no host sync from a load's start to its
    end; one transfer from the pool per layer (a gather reading every chunk's slot in place), at 16 chunks
    as at 256, and the same device ops (per layer one gather, one scatter, and for H one rebuild); and, on
    the GPU branches, no stream, event or pinned buffer made by a load: its copies run on the copier's side
    stream, its rebuilds on the loader's stream, both made once."""
    spec = model[1]
    cuda = FakeCuda(monkeypatch)
    counts = {}
    for chunks in (16, many):
        serving, prompt = _saved(model, tmp_path / str(chunks), rng, chunks, plan=plan)
        layers = _cache(spec, 4 * chunks)  # kernel blocks of 16 tokens
        loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, layers, _rebuild(spec, rng))
        made = dict(cuda.made)
        job = LoadJob("r", None, prompt[: chunks * CHUNK_TOKENS], [list(range(2 * chunks))], 0, chunks * CHUNK_TOKENS)
        try:
            with counting(Counter(serving.stack.store.pool.arena), monkeypatch) as counter:
                assert loader._load(job, SequenceRecord()) == set()  # on this thread: the counter is the thread's
        finally:
            loader.close()
            serving.close()
        counts[chunks] = counter
        print(f"\n{chunks} chunks: {dict(counter.ops)}; {counter.deviceward} transfers; syncs {dict(counter.syncs)}")
        assert not counter.syncs, f"host syncs in a load of {chunks} chunks: {dict(counter.syncs)}"
        assert cuda.made == made, f"made by a load: {dict(cuda.made)} after {made}"
        assert counter.deviceward == LAYERS, f"{counter.deviceward} transfers from the pool for {LAYERS} layers"
    assert counts[16].ops == counts[many].ops, (
        f"device ops grow with chunks: {dict(counts[16].ops)} against {dict(counts[many].ops)}"
    )


def test_a_cpu_load_reads_a_layers_rows_of_every_chunk_in_one_call(model, tmp_path, rng, monkeypatch):
    """On a CPU, the calls a load makes for each layer do not grow with its chunks: a layer's rows of every
    chunk are gathered out of the host pool in one call, not read chunk by chunk (each call a helper thread
    makes hands the GIL to the engine's thread: hcache/storage/image_rows.py)."""
    from hcache.storage.chunk import ChunkImage

    spec = model[1]
    reads, counts, tensor = {}, {}, ChunkImage.tensor
    for chunks in (2, 6):
        serving, prompt = _saved(model, tmp_path / str(chunks), rng, chunks, plan="2H+1KV")
        layers = _cache(spec, 40)
        loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, layers, _rebuild(spec, rng))
        job = LoadJob("r", None, prompt[: chunks * CHUNK_TOKENS], [list(range(2 * chunks))], 0, chunks * CHUNK_TOKENS)
        try:
            calls = []
            with monkeypatch.context() as m, counting(Counter(serving.stack.store.pool.arena), monkeypatch) as counter:
                m.setattr(ChunkImage, "tensor", lambda self, *a: (calls.append(a), tensor(self, *a))[1])
                assert loader._load(job, SequenceRecord()) == set()
            blocks, offsets = block_slots([(list(range(2 * chunks)), 0, chunks * CHUNK_TOKENS)], BLOCK, KERNEL_BLOCK)
            stored = _stored(serving, chunk_keys(prompt[: chunks * CHUNK_TOKENS], root_key(serving.fingerprint)), "KV")
            assert torch.equal(
                layers[2].layout.read(layers[2].cache, layers[2].layout.elements(blocks, offsets)), stored[2]
            )
        finally:
            loader.close()
            serving.close()
        reads[chunks], counts[chunks] = len(calls), counter.ops
    assert reads[2] == reads[6], f"a chunk's tensor read {reads[2]} times in a load of 2 chunks, {reads[6]} in one of 6"
    assert counts[2] == counts[6], f"ops grow with chunks: {dict(counts[2])} against {dict(counts[6])}"


def test_the_store_stacks_and_the_loaders_threads_use_no_cpu_while_idle(model, tmp_path, rng):
    """vLLM's CPU worker binds its OpenMP threads to the cores: threads hcache starts beside them (the
    store's readers and writers, the loader's) must wait, not spin, between loads and saves."""
    import time

    spec = model[1]
    serving, prompt = _saved(model, tmp_path, rng, 2, plan="KV", readers=2)
    loader = Loader(serving.stack, (BLOCK,), KERNEL_BLOCK, _cache(spec, 40))
    try:
        _load(loader, LoadJob("r", None, prompt[: 2 * CHUNK_TOKENS], [list(range(4))], 0, 2 * CHUNK_TOKENS))
        serving.stack.store.flush()
        began, cpu = time.monotonic(), time.process_time()
        time.sleep(1.0)
        used = time.process_time() - cpu
        assert used < 0.05 * (time.monotonic() - began), f"{used:.3f} s of CPU in a second idle"
    finally:
        loader.close()
        serving.close()
