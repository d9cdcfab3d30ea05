"""The GPU prefix cache on the reference engine: what is served from it is exact, whatever the adoption's
shape, and eviction under pressure never breaks running work. Plus look-ahead prefetch and the metrics."""

import time
import urllib.request

import pytest
import torch
from support.helpers import loaded, random_prompt, serving_engine

from hcache.engine.reference import ReferenceEngine
from hcache.model.fingerprint import model_fingerprint
from hcache.serving.metrics import serve_metrics
from hcache.serving.runtime import HCacheRuntime
from hcache.serving.engine import ServingEngine
from hcache.serving.gpu_prefix_cache import GpuPrefixCache
from hcache.storage.chunk_key import CHUNK_TOKENS, KeyChain, chunk_keys, root_key

NO_STOP = set()


@pytest.fixture
def llama():
    return loaded("random:llama")


def _serving(store_dir, num_blocks: int, block_size: int = 64, **kwargs) -> ServingEngine:
    lm = loaded("random:llama")
    engine = ReferenceEngine(lm.model, lm.spec, num_blocks=num_blocks, block_size=block_size)
    return serving_engine(
        engine, model_fingerprint(lm.model, lm.spec), store_dir, model_name=lm.name, readers=0, **kwargs
    )


def _put_in_parts(serving: ServingEngine, uid: int, prompt: list[int], part: int) -> torch.Tensor:
    for start in range(0, len(prompt), part):
        logits = serving.put([uid], [prompt[start : start + part]])
    return logits


def _recompute(llama, prompt: list[int], n: int, tmp_path) -> list[int]:
    with HCacheRuntime(llama, tmp_path / "recompute", save="none") as runtime:
        return runtime.generate(prompt, n, restore=False, stop_token_ids=NO_STOP).output_ids


@pytest.mark.parametrize("plan, stage", [("KV", False), ("H", False), ("H", True)])  # stage: the saver's GPU way
def test_a_returning_conversation_is_served_from_the_gpu_cache_exactly(llama, tmp_path, rng, plan, stage):
    """Every token the first turn computed is adopted (full chunks and the partial last one), nothing is
    read from the store, the reply equals recompute's, and the chunk the adopted partial one became is
    still saved (the saver resumes it)."""
    vocab = llama.spec.vocab_size
    first = random_prompt(3 * CHUNK_TOKENS + 20, vocab, rng)
    with HCacheRuntime(llama, tmp_path / "store", plan=plan, gpu_cache=True) as runtime:
        runtime.saver.stage = stage
        reply = runtime.generate(first, 8, stop_token_ids=NO_STOP).output_ids
        second = first + reply + random_prompt(50, vocab, rng)
        r = runtime.generate(second, 8, stop_token_ids=NO_STOP)
        assert r.gpu_tokens == r.restored_tokens == len(first) + len(reply) - 1  # the last reply token was never put
        assert r.bytes_read == 0
        assert r.output_ids == _recompute(llama, second, 8, tmp_path)
        runtime.store.flush()
        held = second + r.output_ids[:-1]
        assert all(runtime.store.contains(k) for k in chunk_keys(held, root_key(runtime.fingerprint)))
        runtime.drop_device_cache()
        assert runtime.generate(second, 8, stop_token_ids=NO_STOP).output_ids == r.output_ids  # from the store


@pytest.mark.parametrize("part", [100, 40])
def test_adoption_in_the_middle_of_a_chunk(tmp_path, rng, part):
    """Puts of ``part`` tokens end inside chunks: each put adopts from the row its sequence holds, and the
    cache's rows and the logits equal a recompute's."""
    vocab = loaded("random:llama").spec.vocab_size
    prompt = random_prompt(4 * CHUNK_TOKENS + 30, vocab, rng)
    with (
        _serving(tmp_path / "a", 32, plan="KV", gpu_cache=True) as serving,
        _serving(tmp_path / "b", 32, save="none") as fresh,
    ):
        _put_in_parts(serving, 0, prompt[:-7], len(prompt))
        serving.flush(0)
        logits = _put_in_parts(serving, 1, prompt, part)
        want = _put_in_parts(fresh, 1, prompt, len(prompt))
        record = serving.record(1)
        # 100: 64 | 28 + 64 | 56 + 23 (the partial chunk); 40: 0 | 24 | 0 | 8 | 32 | 0 | 16 + 23 | 0. A put
        # adopts only chunks whose tokens have all arrived, and the partial chunk as far as they have.
        assert record.gpu_tokens == {100: 64 + 92 + 79, 40: 24 + 8 + 32 + 39}[part]
        assert record.computed_tokens == len(prompt) - record.restored_tokens
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
        for layer in range(serving.spec.num_layers):
            for got, ref in zip(serving.engine.kv(1, layer), fresh.engine.kv(1, layer)):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_blocks_of_two_chunks_are_shared_by_their_entries_and_freed_with_the_last(tmp_path, rng):
    """Blocks of 128 rows (FastGen's for a head size of 64) hold two chunks each: a finished sequence's blocks
    are taken over, its entries share them, a returning prompt adopts exactly, and a block goes back to the
    engine only when the last entry on it is evicted."""
    vocab = loaded("random:llama").spec.vocab_size
    first = random_prompt(3 * CHUNK_TOKENS + 10, vocab, rng)
    second = first + random_prompt(30, vocab, rng)
    with (
        _serving(tmp_path / "a", 8, 128, plan="KV", gpu_cache=True) as serving,
        _serving(tmp_path / "b", 8, 128, save="none") as fresh,
    ):
        serving.put([0], [first])
        serving.flush(0)
        cache = serving.stack.gpu_cache
        assert cache.blocks == 2 and serving.engine.cache.free_blocks == 6  # c0 c1 | c2 partial
        torch.testing.assert_close(serving.put([1], [second]), fresh.put([1], [second]), atol=1e-5, rtol=1e-5)
        assert serving.record(1).gpu_tokens == len(first)
        for layer in range(serving.spec.num_layers):
            for got, ref in zip(serving.engine.kv(1, layer), fresh.engine.kv(1, layer)):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        serving.flush(1)
        # its first block duplicates cached chunks and is freed; its second holds the longer partial chunk,
        # which replaces the shorter one (whose block c2 still holds). Least recently used first: the
        # partial chunk, c2, c1, c0.
        assert cache.blocks == 3 and serving.engine.cache.free_blocks == 5
        for free, blocks, evictions in [(6, 2, 2), (7, 1, 3), (8, 0, 5)]:
            assert cache.make_room(free)
            assert (serving.engine.cache.free_blocks, cache.blocks, cache.evictions) == (free, blocks, evictions)


def test_eviction_under_pressure_while_other_sequences_run(tmp_path, rng):
    """A small KV cache: one sequence decodes throughout while others come and go. Cached chunks are given
    up for running work (the engine never reports a full cache), entries being adopted are not (the put
    restores from the store instead), and every sequence's logits equal a run without the cache."""
    vocab = loaded("random:llama").spec.vocab_size
    runner = random_prompt(2 * CHUNK_TOKENS, vocab, rng)
    shared = random_prompt(3 * CHUNK_TOKENS + 10, vocab, rng)
    others = [shared + random_prompt(n, vocab, rng) for n in (5, 140, 30)]
    with (
        _serving(tmp_path / "a", 10, plan="KV", gpu_cache=True) as serving,
        _serving(tmp_path / "b", 32, save="none") as fresh,
    ):

        def both(uid: int, tokens: list[int]) -> torch.Tensor:
            got = serving.put([uid], [tokens])
            torch.testing.assert_close(got, fresh.put([uid], [tokens]), atol=1e-5, rtol=1e-5)
            return got

        both(0, runner)  # 2 blocks, held to the end
        for uid, prompt in enumerate(others, start=1):
            # everything the runner does not hold is there for the taking, cached or not
            assert int(min(serving.free_blocks)) == 10 - len(serving.engine.sequences[0].blocks)
            both(uid, prompt)
            for step in range(3):
                both(0, [step + 1])
                both(uid, [step + 7])
            record = serving.record(uid)
            serving.flush(uid)
            fresh.flush(uid)
            # 1: nothing cached yet; its flush hands its 4 blocks over (3 chunks and a partial one). 2: those
            # 3 chunks are pinned for adoption, but its 6 blocks need 2 of them: it adopts nothing, they are
            # evicted, and it restores from the store; its flush hands its 6 blocks over. 3: adopts the 3
            # shared chunks from them (its 4 blocks evict the 3 entries it does not match).
            assert (record.gpu_tokens, record.restored_tokens) == [(0, 0), (0, 192), (192, 192)][uid - 1]
        assert serving.stack.gpu_cache.evictions > 0
        both(0, [9])


def test_two_sequences_sharing_a_system_prompt_at_once(llama, tmp_path, rng):
    """One batch of two prompts that share a cached system prompt: both adopt it from the same entries, and
    both replies equal recompute's."""
    vocab = llama.spec.vocab_size
    system = random_prompt(2 * CHUNK_TOKENS + 40, vocab, rng)
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", gpu_cache=True) as runtime:
        runtime.generate(system + [0, 0, 0], 2, stop_token_ids=NO_STOP)
        prompts = [system + [1] + random_prompt(n, vocab, rng) for n in (20, 90)]
        results = runtime.generate_batch(prompts, 6, stop_token_ids=NO_STOP)
        for prompt, r in zip(prompts, results):
            assert r.gpu_tokens == len(system) and r.bytes_read == 0
            assert r.output_ids == _recompute(llama, prompt, 6, tmp_path)


def test_without_a_store_the_gpu_cache_alone_serves_returning_prompts(tmp_path, rng):
    """Prefix caching with nothing stored (MII with hcache off): the cache is all there is, and exact."""
    vocab = loaded("random:llama").spec.vocab_size
    prompt = random_prompt(2 * CHUNK_TOKENS + 30, vocab, rng)
    with _serving(None, 16, gpu_cache=True, enabled=False) as serving, _serving(None, 16, enabled=False) as fresh:
        serving.put([0], [prompt[:-1]])
        serving.flush(0)
        torch.testing.assert_close(serving.put([1], [prompt]), fresh.put([1], [prompt]), atol=1e-5, rtol=1e-5)
        assert serving.record(1).gpu_tokens == len(prompt) - 1


def test_prefetch_reads_a_waiting_prompt_into_the_host_pool(llama, tmp_path, rng):
    """A prompt waiting to run has its stored chunks read into the host pool; its restore then reports the
    reads as hidden, and is exact."""
    prompt = random_prompt(4 * CHUNK_TOKENS, llama.spec.vocab_size, rng)
    with HCacheRuntime(llama, tmp_path / "store", plan="KV") as runtime:
        runtime.generate(prompt, 1, stop_token_ids=NO_STOP)
        runtime.store.flush()
        runtime.store.drop_resident()
        keys = chunk_keys(prompt, root_key(runtime.fingerprint))
        assert runtime.prefetch(prompt) == len(keys)
        assert runtime.prefetch(prompt) == 0  # in flight or in memory: not read twice
        deadline = time.monotonic() + 30
        while not all(runtime.store.resident(k) for k in keys):
            assert time.monotonic() < deadline, "prefetched chunks never reached the host pool"
            time.sleep(0.01)
        r = runtime.generate(prompt + [5], 3, stop_token_ids=NO_STOP)
        assert r.restored_tokens == len(prompt) and r.prefetch_hidden_s > 0
        assert r.output_ids == _recompute(llama, prompt + [5], 3, tmp_path)
        assert runtime.metrics.snapshot()["hcache_prefetched_chunks_total"] == len(keys)


def test_metrics_count_and_are_served_for_prometheus(llama, tmp_path, rng):
    prompt = random_prompt(2 * CHUNK_TOKENS + 10, llama.spec.vocab_size, rng)
    with HCacheRuntime(llama, tmp_path / "store", plan="KV", gpu_cache=True) as runtime:
        began = time.perf_counter()
        runtime.generate(prompt, 2, stop_token_ids=NO_STOP)
        r = runtime.generate(prompt + [7, 8], 2, stop_token_ids=NO_STOP)
        wall = time.perf_counter() - began
        snap = runtime.metrics.snapshot()
        assert snap["hcache_steps_total"] == 4  # each generate: its prompt's put, then one put of its first token
        assert snap["hcache_decoded_tokens_total"] == 2  # the one-token puts
        assert 0 < snap["hcache_decoded_token_seconds_total"] < snap["hcache_step_seconds_total"] < wall
        assert snap['hcache_restored_tokens_total{source="gpu_cache"}'] == r.gpu_tokens > 0
        assert snap["hcache_gpu_cache_hit_tokens_total"] == r.gpu_tokens
        assert snap["hcache_gpu_cache_blocks"] == runtime.gpu_cache.blocks > 0
        assert snap["hcache_sequences_total"] == 2
        server, thread = serve_metrics(runtime.metrics, 0)
        try:
            text = urllib.request.urlopen(f"http://localhost:{server.server_port}/metrics", timeout=10).read().decode()
        finally:
            server.shutdown()
        assert f"hcache_gpu_cache_hit_tokens_total {float(r.gpu_tokens)}" in text


class _Blocks:
    """The part of an engine the cache's keep and evict use: blocks of 64 rows, and which are free."""

    block_size = CHUNK_TOKENS

    def __init__(self, n: int):
        self.free = list(range(n))

    @property
    def free_blocks(self) -> torch.Tensor:
        return torch.tensor([len(self.free)])

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release_blocks(self, blocks: list[int]) -> None:
        self.free += blocks


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _kept(eviction: str) -> tuple[GpuPrefixCache, _Blocks, _Clock, list[str], list[str]]:
    """A cache valuing rows by their depth, holding a conversation of 4 chunks kept at t=0 and one of 1
    chunk kept at t=1; now t=2."""
    engine, clock = _Blocks(8), _Clock()
    cache = GpuPrefixCache(engine, eviction=eviction, value=lambda start, tokens: float(start + tokens), clock=clock)
    chains = []
    for n, seed in ((4, 1), (1, 2)):
        chain = KeyChain(root_key("fake"))
        chain.extend([seed] * (n * CHUNK_TOKENS))
        cache.keep(engine.take(n), chain, n * CHUNK_TOKENS)
        chains.append([key for key, _ in chain.chunks])
        clock.now += 1
    return cache, engine, clock, *chains


def test_cost_eviction_keeps_the_deep_conversation_that_lru_drops():
    """Each policy evicts one block. LRU takes the least recently used entry, the long conversation's last
    chunk; cost takes the short one's chunk, which saves 64 per row against 256 (idle 1 s against 2 s)."""
    lru, _, _, long, short = _kept("lru")
    assert lru.make_room(4) and lru.evictions == 1
    assert [key in lru for key in long + short] == [True, True, True, False, True]
    cost, _, _, long, short = _kept("cost")
    assert cost.make_room(4) and cost.evictions == 1
    assert [key in cost for key in long + short] == [True, True, True, True, False]


def test_cost_eviction_takes_chain_ends_only_and_never_a_pinned_entry():
    """A prefix outlives its continuations however cheap it is, and an entry being adopted stays."""
    cache, engine, clock, long, short = _kept("cost")
    adoption = cache.match([2] * CHUNK_TOKENS + [0], short, root_key("fake"), 0, CHUNK_TOKENS)
    assert adoption.tokens == CHUNK_TOKENS
    clock.now = 100.0
    for free, kept in [(4, 3), (5, 2), (6, 1), (7, 0)]:
        assert cache.make_room(free)
        assert [key in cache for key in long] == [i < kept for i in range(4)] and short[0] in cache
    assert not cache.make_room(8)  # only the pinned entry's block is left
    cache.unpin(adoption)
    assert cache.make_room(8) and len(engine.free) == 8


def test_the_eviction_setting_reaches_the_gpu_cache_and_the_host_pool(llama, tmp_path):
    for eviction in ("lru", "cost"):
        with HCacheRuntime(llama, tmp_path / eviction, plan="KV", gpu_cache=True, eviction=eviction) as runtime:
            assert runtime.gpu_cache.eviction == runtime.store.eviction == eviction
