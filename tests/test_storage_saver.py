"""The two-stage saver: what it stores, back-pressure, and degraded saving on write faults."""
import errno
import logging
import threading

import pytest
import torch
from helpers import loaded, random_prompt

from hcache.ragged import Segment
from hcache.runtime import HCacheRuntime
from hcache.storage import direct_io
from hcache.storage.chunk import ChunkReader
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.saver import ChunkSaver
from hcache.storage.store_config import StoreConfig

FP = "saver-test"
LAYERS = 3


def _rows(uid: int, positions: range, layer: int) -> dict[str, torch.Tensor]:
    """Rows whose values say whose they are, so a misplaced row cannot go unnoticed."""
    base = torch.tensor([uid * 1_000_000 + p * 10 + layer for p in positions], dtype=torch.float32)
    return {"H": base[:, None].expand(-1, 8).clone(), "KV": base[:, None, None, None].expand(-1, 2, 2, 4).clone()}


def _run(saver: ChunkSaver, streams: dict[int, list[int]], steps: list[dict[int, int]]) -> None:
    """Feed the saver like an engine would: each step processes some tokens of some sequences as a batch."""
    done = {uid: 0 for uid in streams}
    for uid in streams:
        saver.open(uid, root_key(FP, str(uid)))
    for step in steps:
        segments, parts, row = [], [], 0
        for uid, n in step.items():
            saver.add_tokens(uid, streams[uid][done[uid] : done[uid] + n])
            segments.append(Segment(uid, done[uid], n, row))
            parts.append((uid, range(done[uid], done[uid] + n)))
            done[uid] += n
            row += n
        saver.begin_batch(segments)
        for layer in range(LAYERS):
            rows = [_rows(uid, positions, layer) for uid, positions in parts]
            saver.on_layer(layer, {fmt: torch.cat([r[fmt] for r in rows]) for fmt in ("H", "KV")})
        saver.end_batch()
    for uid in streams:
        saver.close(uid)


def _check_store(store, streams: dict[int, list[int]], processed: dict[int, int]) -> int:
    checked = 0
    for uid, tokens in streams.items():
        keys = chunk_keys(tokens[: processed[uid]], root_key(FP, str(uid)))
        for c, key in enumerate(keys):
            with store.open(key) as f:
                reader = ChunkReader.open(f, key, tokens[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS], FP)
                for layer in range(LAYERS):
                    expected = _rows(uid, range(c * CHUNK_TOKENS, (c + 1) * CHUNK_TOKENS), layer)
                    for fmt in ("H", "KV"):
                        assert torch.equal(reader.read(layer, fmt), expected[fmt])
            checked += 1
    return checked


def test_saver_stores_every_full_chunk_of_every_sequence_exactly(tmp_path, rng):
    store = DiskChunkStore(tmp_path, fsync=False)
    saver = ChunkSaver(store, FP, threads=4, staging_bytes=1 << 20)
    streams = {uid: random_prompt(300, 1000, rng) for uid in range(5)}
    # a prefill of uneven lengths (chunks straddle batches), then decode steps of one token each
    steps = [{uid: 37 + 20 * uid for uid in streams}]
    steps += [{uid: 1 for uid in streams if 37 + 20 * uid + k < 300} for k in range(300 - 37)]
    steps = [s for s in steps if s]
    _run(saver, streams, steps)
    processed = {uid: 300 for uid in streams}
    assert _check_store(store, streams, processed) == 5 * (300 // 64) == saver.chunks_written
    assert saver.save_errors == 0 and len(store.keys()) == saver.chunks_written  # no partial chunk stored
    saver.shutdown()


def test_full_ring_applies_back_pressure_and_drops_nothing(tmp_path, rng, monkeypatch):
    store = DiskChunkStore(tmp_path, fsync=False)
    row_bytes = (8 + 16) * 4
    saver = ChunkSaver(store, FP, threads=2, staging_bytes=3 * 130 * row_bytes)  # room for ~2 layers' snapshots
    gate = threading.Event()
    scatter = saver._scatter_rows

    def slow_scatter(*args):
        gate.wait()  # stage 2 is stuck until the timer fires: the ring fills and stage 1 must wait
        scatter(*args)

    monkeypatch.setattr(saver, "_scatter_rows", slow_scatter)
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    streams = {0: random_prompt(256, 1000, rng), 1: random_prompt(256, 1000, rng)}
    _run(saver, streams, [{0: 128, 1: 128}, {0: 128, 1: 128}])
    timer.join()
    assert saver.stalls >= 1 and saver.stall_seconds > 0.1
    assert _check_store(store, streams, {0: 256, 1: 256}) == 8 == saver.chunks_written
    saver.shutdown()


def test_disk_full_degrades_saving_and_serving_goes_on(tmp_path, rng, monkeypatch, caplog):
    prompt = random_prompt(140, 256, rng)

    def disk_full(fd, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io, "_write_all", disk_full)
    with HCacheRuntime(loaded("random:llama"), tmp_path) as runtime, caplog.at_level(logging.WARNING):
        first = runtime.generate(prompt, 4, stop_token_ids=set())
        assert runtime.saver.save_errors == 2 and runtime.store.write_errors == 2 and runtime.store.keys() == []
        assert "could not save chunk" in caplog.text
        expected = runtime.generate(prompt, 4, restore=False, stop_token_ids=set()).output_ids
        assert first.output_ids == expected and first.restored_tokens == 0
        monkeypatch.undo()  # space again: saving resumes
        runtime.generate(prompt, 4, stop_token_ids=set())
        again = runtime.generate(prompt, 4, stop_token_ids=set())
        assert again.restored_tokens == 128 and again.output_ids == expected
    assert not list(tmp_path.rglob("*.tmp"))


def test_runtime_over_two_dirs_a_quota_and_a_dram_tier_matches_recompute(tmp_path, rng):
    llama = loaded("random:llama")
    config = StoreConfig(quota_bytes=4 << 20, dram_bytes=1 << 20, saver_threads=3)
    with HCacheRuntime(llama, [tmp_path / "ssd0", tmp_path / "ssd1"], save="all", store=config) as runtime:
        prompts = [random_prompt(n, 256, rng) for n in (300, 150, 400)]
        expected = [runtime.generate(p, 5, restore=False, stop_token_ids=set()).output_ids for p in prompts]
        for p, out in zip(prompts, expected):
            for plan in ("1RE+1H+1KV", "KV"):
                assert runtime.generate(p, 5, plan=plan, stop_token_ids=set()).output_ids == out
        disk = runtime.store.backing
        assert disk.used_bytes <= 4 << 20 and runtime.store.used_bytes <= 1 << 20
        assert all(list((tmp_path / d / "chunks").glob("*/*.safetensors")) for d in ("ssd0", "ssd1"))


def test_quota_smaller_than_one_chunk_is_a_clear_error(tmp_path):
    from hcache.errors import StorageError

    with pytest.raises(StorageError, match="smaller than one chunk"):
        HCacheRuntime(loaded("random:llama"), tmp_path, store=StoreConfig(quota_bytes=1000))
    assert not (tmp_path / "chunks").exists()


def test_a_forward_that_fails_mid_batch_publishes_nothing_and_never_hangs(tmp_path, rng):
    store = DiskChunkStore(tmp_path, fsync=False)
    saver = ChunkSaver(store, FP, threads=2)
    tokens = random_prompt(64, 1000, rng)
    saver.open(0, root_key(FP, "0"))
    saver.add_tokens(0, tokens)
    saver.begin_batch([Segment(0, 0, 64, 0)])
    saver.on_layer(0, _rows(0, range(64), 0))  # the forward raises after layer 0: no end_batch
    saver.close(0)  # must return, not wait for a batch that never ends
    assert store.keys() == [] and saver.chunks_written == 0
    saver.shutdown()
