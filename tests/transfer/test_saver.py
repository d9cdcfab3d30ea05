"""The two-stage saver: what it stores, back-pressure, and degraded saving on write faults."""

import errno
import logging
import threading

import pytest
import torch
from support.helpers import loaded, random_prompt
from support.storage_chunks import read_back

from hcache.errors import StorageError
from hcache.engine.ragged import Segment
from hcache.serving.runtime import HCacheRuntime
from hcache.storage import direct_io
from hcache.storage.chunk import decode
from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, chunk_keys, root_key
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.host_tier import HostTier
from hcache.transfer import saver as saver_module
from hcache.transfer.saver import ChunkSaver
from hcache.storage.store_config import StoreConfig
from hcache.storage.host_pool import HostPool

FP = "saver-test"
LAYERS = 3
TENSORS = [
    (layer, fmt, shape, torch.float32) for layer in range(LAYERS) for fmt, shape in (("H", (8,)), ("KV", (2, 2, 4)))
]
MIXED = [t for t in TENSORS if t[:2] != (1, "H")]  # layer 1 stores no H: the layers' tensors are not evenly spaced


def _rows(uid: int, positions: range, layer: int) -> dict[str, torch.Tensor]:
    """Rows whose values say whose they are, so a misplaced row cannot go unnoticed."""
    base = torch.tensor([uid * 1_000_000 + p * 10 + layer for p in positions], dtype=torch.float32)
    return {"H": base[:, None].expand(-1, 8).clone(), "KV": base[:, None, None, None].expand(-1, 2, 2, 4).clone()}


def _tier(path, pool_bytes: int = 16 << 20) -> HostTier:
    return HostTier([DiskChunkStore(path, fsync=False)], HostPool(pool_bytes), readers=0)


def _run(
    saver: ChunkSaver,
    streams: dict[int, list[int]],
    steps: list[dict[int, int]],
    tensors: list = TENSORS,
    keep: tuple = (),
    reads: list | None = None,
) -> None:
    """Feed the saver like the serving engine and an engine would: each step processes some tokens of some
    sequences as a batch, after the sequence's key chain has taken them. ``keep``: formats whose rows are
    handed over as the saver's to keep (an engine's K/V copied for it), the others as a buffer to copy.
    ``reads``: K/V not handed over but read when a batch ends, as vLLM's worker reads its cache; each read's
    number of chunks is appended."""
    done = {uid: 0 for uid in streams}
    stored = {t[:2] for t in tensors}
    handed = ("H",) if reads is not None else ("H", "KV")

    def read(segments: list[Segment]) -> dict[str, torch.Tensor]:
        reads.append(len(segments))
        layers = sorted(layer for layer, fmt in stored if fmt == "KV")
        return {
            "KV": torch.stack(
                [
                    torch.cat([_rows(s.uid, range(s.start, s.start + s.length), layer)["KV"] for s in segments])
                    for layer in layers
                ]
            )
        }

    chains = {uid: KeyChain(root_key(FP, str(uid))) for uid in streams}
    for uid in streams:
        saver.open(uid, chains[uid])
    for step in steps:
        segments, parts, row = [], [], 0
        for uid, n in step.items():
            chains[uid].extend(streams[uid][done[uid] : done[uid] + n])
            segments.append(Segment(uid, done[uid], n, row))
            parts.append((uid, range(done[uid], done[uid] + n)))
            done[uid] += n
            row += n
        saver.begin_batch(segments, later=("KV",) if reads is not None else ())
        for layer in range(LAYERS):
            rows = [_rows(uid, positions, layer) for uid, positions in parts]
            saver.on_layer(
                layer, {fmt: torch.cat([r[fmt] for r in rows]) for fmt in handed if (layer, fmt) in stored}, keep=keep
            )
        saver.end_batch(read if reads is not None else None)
    for uid in streams:
        saver.close(uid)


def _check_store(
    tier: HostTier, streams: dict[int, list[int]], processed: dict[int, int], tensors: list = TENSORS
) -> int:
    """Every chunk is right in memory and, once written back, on disk."""
    tier.flush()
    checked = 0
    for uid, tokens in streams.items():
        keys = chunk_keys(tokens[: processed[uid]], root_key(FP, str(uid)))
        for c, key in enumerate(keys):
            image = tier.fetch(key).result()
            on_disk = decode(read_back(tier.stores[0], key), key)
            assert image.tokens == on_disk.tokens == tokens[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS]
            assert set(on_disk.tensors) == {t[:2] for t in tensors}
            for layer, fmt, *_ in tensors:
                expected = _rows(uid, range(c * CHUNK_TOKENS, (c + 1) * CHUNK_TOKENS), layer)[fmt]
                assert torch.equal(image.tensor(layer, fmt), expected)
                assert torch.equal(on_disk.tensors[(layer, fmt)], expected)
            tier.release(image)
            checked += 1
    return checked


# run_bytes: rows held back as the saver does (None), in runs of at most 2 layers for a decode step's KV and
# all 3 for its H and copied as they come for the prefill's (700), or copied as they come always (1); K/V
# handed over to be kept, or copied as they come (keep); or not handed over but read when a chunk fills (later).
@pytest.mark.parametrize(
    "stage", [False, True]
)  # True: the GPU's way, rows staged on their device until a chunk is full
@pytest.mark.parametrize(
    "tensors, run_bytes, keep, later",
    [
        (TENSORS, None, (), False),
        (TENSORS, None, ("KV",), False),
        (TENSORS, 700, ("KV",), False),
        (TENSORS, 1, (), False),
        (MIXED, None, ("KV",), False),
        (TENSORS, None, (), True),
        (MIXED, 1, (), True),
    ],
    ids=["runs", "runs-kept", "short-runs-kept", "no-runs", "mixed-kept", "kv-later", "mixed-no-runs-later"],
)
def test_saver_stores_every_full_chunk_of_every_sequence_exactly(
    tmp_path, rng, stage, tensors, run_bytes, keep, later, monkeypatch
):
    if run_bytes is not None:
        monkeypatch.setattr(saver_module, "RUN_BYTES", run_bytes)
    tier = _tier(tmp_path)
    saver = ChunkSaver(tier, FP, tensors, stage=stage)
    streams = {uid: random_prompt(300, 1000, rng) for uid in range(5)}
    # a prefill of uneven lengths (chunks straddle batches), then decode steps of one token each
    steps = [{uid: 37 + 20 * uid for uid in streams}]
    steps += [{uid: 1 for uid in streams if 37 + 20 * uid + k < 300} for k in range(300 - 37)]
    steps = [s for s in steps if s]
    reads = [] if later else None
    _run(saver, streams, steps, tensors, keep, reads)
    processed = {uid: 300 for uid in streams}
    assert reads is None or sum(reads) == 5 * (300 // 64)  # each chunk's K/V read once
    assert _check_store(tier, streams, processed, tensors) == 5 * (300 // 64) == saver.chunks_published
    assert saver.save_errors == 0 and len(tier.keys()) == saver.chunks_published  # no partial chunk stored
    assert (
        tier.pool.used_bytes
        == saver.chunks_published * tier.pool.view(tier.fetch(tier.keys()[0]).result().slot).numel()
    )
    saver.shutdown()
    tier.close()


def test_a_pool_full_of_write_backs_applies_back_pressure_and_drops_nothing(tmp_path, rng, monkeypatch):
    chunk_bytes = (
        -(-(ChunkSaver(_tier(tmp_path / "probe"), FP, TENSORS)._layout(0, CHUNK_TOKENS).nbytes) // 4096) * 4096
    )
    tier = _tier(tmp_path, 5 * chunk_bytes)  # the second batch needs 4 chunks where 1 is free
    saver = ChunkSaver(tier, FP, TENSORS)
    gate, put = threading.Event(), tier.stores[0].put
    monkeypatch.setattr(tier.stores[0], "put", lambda *a: (gate.wait(), put(*a)))  # a slow disk
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    streams = {0: random_prompt(256, 1000, rng), 1: random_prompt(256, 1000, rng)}
    _run(saver, streams, [{0: 128, 1: 128}, {0: 128, 1: 128}])
    timer.join()
    assert saver.stalls >= 1 and saver.stall_seconds > 0.1 and tier.unsaved == 0
    monkeypatch.undo()
    assert _check_store(tier, streams, {0: 256, 1: 256}) == 8 == saver.chunks_published
    saver.shutdown()
    tier.close()


def test_disk_full_degrades_saving_and_serving_goes_on(tmp_path, rng, monkeypatch, caplog):
    prompt = random_prompt(140, 256, rng)

    def disk_full(fd, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io, "_write_all", disk_full)
    with HCacheRuntime(loaded("random:llama"), tmp_path) as runtime, caplog.at_level(logging.WARNING):
        first = runtime.generate(prompt, 4, stop_token_ids=set())
        runtime.store.flush()
        assert (
            runtime.saver.save_errors == 2
            and runtime.store.stores[0].write_errors == 2
            and runtime.store.stores[0].keys() == []
        )
        assert "could not write chunk" in caplog.text
        expected = runtime.generate(prompt, 4, restore=False, stop_token_ids=set()).output_ids
        assert first.output_ids == expected and first.restored_tokens == 0
        from_memory = runtime.generate(prompt, 4, stop_token_ids=set())  # the chunks were kept in the host pool
        assert from_memory.restored_tokens == 128 and from_memory.output_ids == expected
        monkeypatch.undo()  # space again
        runtime.store.drop_resident()  # the chunks are nowhere now: recompute, and save them again
        assert runtime.generate(prompt, 4, stop_token_ids=set()).restored_tokens == 0
        runtime.store.flush()
        runtime.store.drop_resident()
        again = runtime.generate(prompt, 4, stop_token_ids=set())
        assert again.restored_tokens == 128 and again.output_ids == expected
    assert not list(tmp_path.rglob("*.tmp"))


def test_runtime_over_two_dirs_a_quota_and_a_small_host_pool_matches_recompute(tmp_path, rng):
    llama = loaded("random:llama")
    config = StoreConfig(quota_bytes=4 << 20, host_bytes=1 << 20, writers=3)
    with HCacheRuntime(llama, [tmp_path / "ssd0", tmp_path / "ssd1"], save="all", store=config) as runtime:
        prompts = [random_prompt(n, 256, rng) for n in (300, 150, 400)]
        expected = [runtime.generate(p, 5, restore=False, stop_token_ids=set()).output_ids for p in prompts]
        for p, out in zip(prompts, expected):
            for plan in ("1RE+1H+1KV", "KV"):
                assert runtime.generate(p, 5, plan=plan, stop_token_ids=set()).output_ids == out
        runtime.store.flush()
        assert runtime.store.stores[0].used_bytes <= 4 << 20 and runtime.store.pool.used_bytes <= 1 << 20
        assert runtime.store.evictions > 0  # the pool was too small for everything: chunks came back from disk
        assert runtime.store.bytes_loaded > 0
        assert all(list((tmp_path / d / "chunks").glob("*/*.safetensors")) for d in ("ssd0", "ssd1"))


@pytest.mark.parametrize("option", ["quota_bytes", "host_bytes"])
def test_a_store_smaller_than_one_chunk_is_a_clear_error(tmp_path, option):
    with pytest.raises(StorageError, match=f"{option}=1000 is smaller than one chunk"):
        HCacheRuntime(loaded("random:llama"), tmp_path, store=StoreConfig(**{option: 1000}))
    assert not (tmp_path / "chunks").exists()


@pytest.mark.parametrize("ends", [False, True])
def test_an_incomplete_batch_publishes_nothing_and_never_hangs(tmp_path, rng, caplog, ends):
    """The forward raises after layer 0 (no ``end_batch``), or a capture skips layer 1: the slot's rows of
    the missing layers are whatever was there, so nothing is published."""
    tier = _tier(tmp_path)
    saver = ChunkSaver(tier, FP, TENSORS)
    chain = KeyChain(root_key(FP, "0"))
    saver.open(0, chain)
    chain.extend(random_prompt(64, 1000, rng))
    saver.begin_batch([Segment(0, 0, 64, 0)])
    for layer in (0, 2) if ends else (0,):
        saver.on_layer(layer, _rows(0, range(64), layer))
    if ends:
        saver.end_batch()
    saver.close(0)  # must return, not wait for a batch that never ends
    assert tier.keys() == [] and saver.chunks_published == 0 and tier.pool.used_bytes == 0
    assert ("handed over 4 of 6 layer tensors" in caplog.text) == ends
    saver.shutdown()
    tier.close()


def test_a_chunk_finished_by_a_restore_gives_its_slot_back_at_once(tmp_path, rng):
    """Rows 0-35 of chunk 0 computed, 36-63 restored, then chunk 1 computed: chunk 0 can never fill."""
    tier = _tier(tmp_path)
    saver = ChunkSaver(tier, FP, TENSORS)
    tokens = random_prompt(100, 1000, rng)
    chain = KeyChain(root_key(FP, "0"))
    saver.open(0, chain)
    chain.extend(tokens[:36])
    saver.begin_batch([Segment(0, 0, 36, 0)])
    for layer in range(LAYERS):
        saver.on_layer(layer, _rows(0, range(36), layer))
    saver.end_batch()
    held = tier.pool.used_bytes
    assert held > 0  # chunk 0 waits for its other rows
    chain.extend(tokens[36:])  # 36-63 restored, 64-99 computed
    saver.begin_batch([Segment(0, 64, 36, 0)])
    for layer in range(LAYERS):
        saver.on_layer(layer, _rows(0, range(64, 100), layer))
    saver.end_batch()
    assert tier.pool.used_bytes == held  # chunk 0's slot went back; chunk 1 took one of the same size
    saver.close(0)
    assert tier.pool.used_bytes == 0 and saver.chunks_published == 0
    saver.shutdown()
    tier.close()


@pytest.mark.parametrize("keep", [(), ("KV",)], ids=["copied", "kv-kept"])
@pytest.mark.parametrize("tensors", [TENSORS, MIXED], ids=["alike", "mixed"])
def test_a_decode_step_copies_each_sequences_rows_once_a_format_not_once_a_layer(
    tmp_path, rng, monkeypatch, tensors, keep
):
    """A prefill of 70 tokens (two chunks each) and a decode step, of 5 sequences over 3 layers: each one
    batched copy per format, of one strided run of layers per chunk a sequence reaches (two where layer 1
    stores no H, which breaks the KV tensors' even spacing), rather than one copy per layer. Rows handed over
    to be kept are not copied as they come, but in one call for the run's layers when it is copied."""
    calls, copied, stacked = [], [], []
    foreach_copy, copy, stack = torch._foreach_copy_, torch.Tensor.copy_, torch.stack
    monkeypatch.setattr(
        torch, "_foreach_copy_", lambda dst, src, **kw: (calls.append(len(dst)), foreach_copy(dst, src, **kw))
    )
    monkeypatch.setattr(
        torch, "stack", lambda tensors, *a, **kw: (stacked.append(len(tensors)), stack(tensors, *a, **kw))[1]
    )
    tier = _tier(tmp_path)
    saver = ChunkSaver(tier, FP, tensors)
    hand_over = saver.on_layer

    def on_layer(
        layer, rows, keep=()
    ):  # the copies a layer's hand-over makes, by the rows' width (not the write-back's, on threads of its own)
        caller = threading.get_ident()
        with monkeypatch.context() as m:
            m.setattr(
                torch.Tensor,
                "copy_",
                lambda dst, src, **kw: (
                    threading.get_ident() == caller and copied.append(dst.shape[-1]),
                    copy(dst, src, **kw),
                )[1],
            )
            hand_over(layer, rows, keep)

    saver.on_layer = on_layer
    streams = {uid: random_prompt(71, 1000, rng) for uid in range(5)}
    _run(saver, streams, [{uid: 70 for uid in streams}, {uid: 1 for uid in streams}], tensors, keep)
    kv_spans = 1 if tensors is TENSORS else 2  # KV: layers 0-1, then 2; H: layers 0 and 2, evenly spaced
    assert sorted(calls) == sorted([10, 10 * kv_spans, 5, 5 * kv_spans]), (
        f"copies (tensors each) in a prefill and a decode step: {calls}"
    )
    assert stacked == ([LAYERS, LAYERS] if keep else []), "each step's kept K/V rows into their run in one call"
    h_layers = sum(fmt == "H" for _, fmt, *_ in tensors)
    assert sorted(copied) == sorted([8] * 2 * h_layers + ([] if keep else [4] * 2 * LAYERS)), (
        "a layer's rows copied as they come: H's (8 wide), KV's unless kept"
    )
    saver.shutdown()
    tier.close()


def test_k_v_read_later_are_read_in_one_call_a_batch_that_fills_chunks_and_never_otherwise(tmp_path, rng, monkeypatch):
    """K/V that the engine keeps (named ``later``): a prefill that fills a chunk of each of 5 sequences reads
    them in one call, and copies them in one; a decode step that fills none reads and copies no K/V, only H;
    the step that fills the next chunk of each reads once again."""
    calls = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(
        torch, "_foreach_copy_", lambda dst, src, **kw: (calls.append(dst[0].shape[-1]), foreach_copy(dst, src, **kw))
    )
    tier = _tier(tmp_path)
    saver = ChunkSaver(tier, FP, TENSORS)
    streams = {uid: random_prompt(128, 1000, rng) for uid in range(5)}
    steps = [{uid: 70 for uid in streams}] + [{uid: 1 for uid in streams} for _ in range(128 - 70)]
    reads = []
    _run(saver, streams, steps, TENSORS, (), reads)
    assert reads == [5, 5], "one read a batch that fills chunks, of all of them"
    assert calls.count(4) == 2 and calls.count(8) == len(steps), (
        "K/V (4 wide) copied in the two batches that fill chunks; H (8 wide) each step"
    )
    assert _check_store(tier, streams, {uid: 128 for uid in streams}) == 10 == saver.chunks_published
    saver.shutdown()
    tier.close()


def test_a_batch_that_names_k_v_later_and_ends_without_a_read_saves_nothing(tmp_path, rng):
    tier = _tier(tmp_path)
    saver = ChunkSaver(tier, FP, TENSORS)
    chain = KeyChain(root_key(FP, "0"))
    saver.open(0, chain)
    chain.extend(random_prompt(64, 1000, rng))
    saver.begin_batch([Segment(0, 0, 64, 0)], later=("KV",))
    for layer in range(LAYERS):
        saver.on_layer(layer, {"H": _rows(0, range(64), layer)["H"]})
    with pytest.raises(ValueError, match="must end with a read"):
        saver.end_batch()
    saver.close(0)
    assert tier.keys() == [] and saver.chunks_published == 0 and tier.pool.used_bytes == 0
    saver.shutdown()
    tier.close()


@pytest.mark.parametrize("streams", [False, True], ids=["cpu", "gpu-branches"])
@pytest.mark.parametrize("bad", [None, 0, 1], ids=["all-held", "bad-first-batch", "bad-last-batch"])
def test_rows_a_voucher_says_are_not_the_engines_publish_nothing_of_their_sequences(
    tmp_path, rng, monkeypatch, streams, bad
):
    """vLLM's worker finds a step's hidden-state rows by their cache slots and vouches for them with a bool
    it does not read (on a GPU, reading it would wait for the forward). Sequence 0's chunk fills over two
    batches, 40 rows and 24: a voucher that does not hold in either keeps that chunk and every later one of
    sequence 0 out of the store, and sequence 1, in neither batch, publishes; on the GPU branches the voucher
    is read only by stage 2, so its batch makes no host sync."""
    from support.budgets import Counter, FakeCuda, counting

    if streams:
        FakeCuda(monkeypatch)
    tier = _tier(tmp_path)
    saver = ChunkSaver(tier, FP, TENSORS)
    tokens = {uid: random_prompt(128, 1000, rng) for uid in (0, 1)}
    chains = {uid: KeyChain(root_key(FP, str(uid))) for uid in tokens}
    for uid in tokens:
        saver.open(uid, chains[uid])
    done = {0: 0, 1: 0}
    syncs = []
    for k, step in enumerate([{0: 40}, {0: 24}, {1: 64}, {0: 64}]):
        segments, row = [], 0
        for uid, n in step.items():
            chains[uid].extend(tokens[uid][done[uid] : done[uid] + n])
            segments.append(Segment(uid, done[uid], n, row))
            row += n
        with counting(Counter(tier.pool.arena), monkeypatch) as counter:
            saver.begin_batch(segments)
            for layer in range(LAYERS):
                saver.on_layer(
                    layer,
                    {
                        fmt: torch.cat(
                            [_rows(uid, range(done[uid], done[uid] + n), layer)[fmt] for uid, n in step.items()]
                        )
                        for fmt in ("H", "KV")
                    },
                )
            saver.vouch(torch.tensor(k != bad))
            saver.end_batch()
        syncs += list(counter.syncs)
        for uid, n in step.items():
            done[uid] += n
    for uid in tokens:
        saver.close(uid)
    tier.flush()
    published = {
        uid: sum(tier.contains(key) for key in chunk_keys(tokens[uid], root_key(FP, str(uid)))) for uid in tokens
    }
    assert published == ({0: 2, 1: 1} if bad is None else {0: 0, 1: 1}), published
    assert not streams or not syncs, f"host syncs with a voucher on the GPU branches: {syncs}"
    saver.shutdown()
    tier.close()
