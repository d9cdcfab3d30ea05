"""The FastGen adapter on a CPU: its checks, and its capture and restore logic against FastGen's own code.

FastGen's kernels are CUDA-only, so the model's modules here are fakes with FastGen's shapes and buffer
reuse (every module writes into one preallocated output buffer, as ``empty_from`` does), around DeepSpeed's
real pure-Python pieces: ``InferenceEngineV2.put``/``query``/``flush``, ``DSStateManager``,
``DSSequenceDescriptor``, ``RaggedBatchWrapper`` (with host buffers instead of pinned ones), the cache
layout of ``BlockedKVCache``, and Llama's own ``forward``/``_forward_transformer_layer``. The attention fake
finds each sequence's blocks through the batch's ``kv_ptrs``, as the CUDA kernel does, and applies its own
RoPE (not hcache's), so restore results are checked against an independent forward.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

import deepspeed  # noqa: E402
from deepspeed.inference.v2 import InferenceEngineV2, RaggedInferenceEngineConfig  # noqa: E402
from deepspeed.inference.v2.model_implementations.inference_model_base import DSInferenceModelBase  # noqa: E402
from deepspeed.inference.v2.model_implementations.inference_transformer_base import DSTransformerModelBase  # noqa: E402
from deepspeed.inference.v2.model_implementations.llama_v2.model import Llama2InferenceModel  # noqa: E402
from deepspeed.inference.v2.modules.configs import RotateHalfConfig  # noqa: E402
from deepspeed.inference.v2.ragged import DSStateManager, KVCacheConfig, RaggedBatchWrapper  # noqa: E402
from deepspeed.inference.v2.ragged.kv_cache import BlockedKVCache  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from hcache.engine.fastgen import FastGenEngine, build_fastgen_engine  # noqa: E402
from hcache.errors import CacheFullError, UnsupportedModelError  # noqa: E402
from hcache.ragged import Segment  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD, VOCAB, BLOCK = 3, 32, 4, 2, 8, 50, 8
MAX_BATCH = 16  # FastGen's max_ragged_batch_size: recompute must split longer restores


def hf_config(**overrides) -> LlamaConfig:
    args = dict(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=10000.0,
    )
    return LlamaConfig(**{**args, **overrides})


# ---- fakes of FastGen's CUDA pieces ------------------------------------------------------------------
class FakeAllocator:
    """``BlockedAllocator``'s interface (the real one pins memory, which needs CUDA)."""

    def __init__(self, n: int):
        self._free = list(range(n))

    def allocate(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise ValueError("out of blocks")
        out, self._free = self._free[:n], self._free[n:]
        return torch.tensor(out, dtype=torch.int32)

    def free(self, blocks) -> None:
        self._free.extend(int(b) for b in torch.as_tensor(blocks).flatten())

    @property
    def free_blocks(self) -> int:
        return len(self._free)


def rms(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma


class FakeLinear(torch.nn.Module):
    def __init__(self, out_features: int):
        super().__init__()
        self._output = torch.empty(MAX_BATCH, out_features)

    def forward(self, hidden_states, w, b=None):
        out = self._output[: hidden_states.shape[0]]
        torch.matmul(hidden_states, w.t(), out=out)
        if b is not None:
            out += b
        return out


class FakePreRMSNorm(torch.nn.Module):
    """``DSPreRMSCUDAModule``: one hidden and one residual output buffer, reused by every call."""

    def __init__(self):
        super().__init__()
        self._hidden_output = torch.empty(MAX_BATCH, HIDDEN)
        self._residual_output = torch.empty(MAX_BATCH, HIDDEN)

    def forward(self, residual, hidden_in, gamma, beta=None):
        hidden_out = self._hidden_output[: residual.shape[0]]
        if hidden_in is None:
            residual_out = residual
        else:
            residual_out = self._residual_output[: residual.shape[0]]
            torch.add(residual, hidden_in, out=residual_out)
        hidden_out.copy_(rms(residual_out, gamma))
        return residual_out, hidden_out


def fake_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE written independently of hcache.ops (complex multiplication on paired channels)."""
    half = HEAD // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD)
    rot = torch.polar(torch.ones(len(positions), half, dtype=torch.float64), positions[:, None].double() * inv_freq)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


class FakeAttention(torch.nn.Module):
    """``DSDenseBlockedAttention``: rotate, write K/V to the blocked cache, causal attention over it."""

    kv_block_size = BLOCK

    def __init__(self, state_manager: DSStateManager):
        super().__init__()
        self._state = state_manager
        self._output = torch.empty(MAX_BATCH, HEADS * HEAD)

    def build_atoms(self, batch) -> None:
        pass

    def forward(self, q_k_v, kv_cache, batch, inv_freqs=None):
        ids = self._state._all_block_ids[0]
        out = self._output[: q_k_v.shape[0]]
        q_dim, kv_dim = HEADS * HEAD, KV_HEADS * HEAD
        for (start, n, seen, _), ptr in zip(batch.inflight_seq_descriptors().tolist(), batch.kv_ptrs().tolist()):
            table = ids[(ptr - ids.data_ptr()) // (ids.stride(0) * ids.element_size()), 0].long()  # what the kernel dereferences
            pos = torch.arange(seen, seen + n)
            rows = q_k_v[start : start + n]
            q = fake_rope(rows[:, :q_dim].view(n, HEADS, HEAD), pos)
            k = fake_rope(rows[:, q_dim : q_dim + kv_dim].view(n, KV_HEADS, HEAD), pos)
            v = rows[:, q_dim + kv_dim :].view(n, KV_HEADS, HEAD)
            kv_cache[table[pos // BLOCK], pos % BLOCK, 0] = k
            kv_cache[table[pos // BLOCK], pos % BLOCK, 1] = v
            ctx = torch.arange(seen + n)
            keys, values = kv_cache[table[ctx // BLOCK], ctx % BLOCK].unbind(1)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=ctx[None, :] <= pos[:, None], enable_gqa=True,
            )
            out[start : start + n] = o.transpose(0, 1).reshape(n, -1)
        return out


class FakeEmbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._output = torch.empty(MAX_BATCH, HIDDEN)

    def forward(self, batch, word_emb):
        ids = batch.input_ids()
        out = self._output[: ids.shape[0]]
        torch.index_select(word_emb, 0, ids, out=out)
        return out


class FakeUnembed(torch.nn.Module):
    def forward(self, hidden_states, word_unembed, batch, gamma):
        last = [start + n - 1 for start, n, _, _ in batch.inflight_seq_descriptors().tolist()]
        return rms(hidden_states[last], gamma) @ word_unembed.t()


class Params:
    def __init__(self, **tensors):
        self.__dict__.update(tensors)


class FakeLlama(torch.nn.Module):
    """Llama's FastGen model with its real forward, layer and KV-accounting methods over fake modules."""

    forward = Llama2InferenceModel.forward
    _forward_embed = Llama2InferenceModel._forward_embed
    _forward_transformer_layer = Llama2InferenceModel._forward_transformer_layer
    _forward_unembed = Llama2InferenceModel._forward_unembed
    get_kv_requirements = DSTransformerModelBase.get_kv_requirements
    get_remaining_block_capacity = DSTransformerModelBase.get_remaining_block_capacity
    maybe_allocate_kv = DSTransformerModelBase.maybe_allocate_kv
    maybe_free_kv = DSInferenceModelBase.maybe_free_kv
    prepare_batch = DSTransformerModelBase.prepare_batch

    num_layers, model_dim, head_size, n_heads_q_local, n_heads_kv_local = LAYERS, HIDDEN, HEAD, HEADS, KV_HEADS
    tp_size = 1
    positional_embedding_config = RotateHalfConfig(theta_base=10000.0)

    def __init__(self, state_manager: DSStateManager, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

        self.state_manager = state_manager
        self.qkv, self.attn_out = FakeLinear((HEADS + 2 * KV_HEADS) * HEAD), FakeLinear(HIDDEN)
        self.mlp_1, self.mlp_2 = FakeLinear(64), FakeLinear(HIDDEN)
        self.attn, self.norm = FakeAttention(state_manager), FakePreRMSNorm()
        self.embed, self.unembed = FakeEmbed(), FakeUnembed()
        self._transformer = [
            Params(qkv_w=w((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN), attn_out_w=w(HIDDEN, HEADS * HEAD),
                   mlp_1_w=w(64, HIDDEN), mlp_2_w=w(HIDDEN, 64),
                   attn_norm_gamma=1 + w(HIDDEN), mlp_norm_gamma=1 + w(HIDDEN))
            for _ in range(LAYERS)
        ]
        self._non_transformer = Params(word_emb=w(VOCAB, HIDDEN), word_unembed=w(VOCAB, HIDDEN), final_norm=1 + w(HIDDEN))


def fake_inference_engine(num_blocks: int = 32, seed: int = 0) -> InferenceEngineV2:
    """A real ``InferenceEngineV2`` (its ``put``, ``query``, ``flush``...) over CPU state and a fake model."""
    config = RaggedInferenceEngineConfig(state_manager=dict(max_ragged_batch_size=MAX_BATCH, max_tracked_sequences=8, max_ragged_sequence_count=4))
    sm_config = config.state_manager
    kv_config = KVCacheConfig(block_size=BLOCK, cache_shape=(LAYERS, KV_HEADS, HEAD), cache_dtype=torch.float32, max_blocks_per_allocation_group=32)

    kv_cache = BlockedKVCache.__new__(BlockedKVCache)  # its __init__ sizes from GPU memory
    kv_cache._configs, kv_cache._allocators = (kv_config,), (FakeAllocator(num_blocks),)
    kv_cache._caches = (torch.zeros(LAYERS, num_blocks, BLOCK, 2, KV_HEADS, HEAD),)
    state = DSStateManager.__new__(DSStateManager)  # its __init__ JIT-builds CUDA host-buffer helpers
    state._config, state._kv_configs, state._kv_cache, state._seqs = sm_config, (kv_config,), kv_cache, {}
    state._tracking_allocator = FakeAllocator(sm_config.max_tracked_sequences)
    ids = torch.zeros(sm_config.max_tracked_sequences, 1, 32, dtype=torch.int32)
    state._all_block_ids, state._all_block_ids_shadow = (ids,), (ids.clone(),)

    batch = RaggedBatchWrapper.__new__(RaggedBatchWrapper)  # same buffers as its __init__, on the host
    batch._config, batch._is_padded = sm_config, False
    for name, shape, dtype in [("_input_ids", (MAX_BATCH,), torch.int64), ("_batch_metadata_storage", (2,), torch.int32),
                               ("_token_to_seq_storage", (MAX_BATCH,), torch.int32),
                               ("_inflight_seq_descriptors", (sm_config.max_ragged_sequence_count, 4), torch.int32),
                               ("_kv_ptrs", (sm_config.max_ragged_sequence_count,), torch.int64)]:
        setattr(batch, name, torch.zeros(shape, dtype=dtype))
        setattr(batch, name + "_shadow", torch.zeros(shape, dtype=dtype))
    batch.clear()

    engine = InferenceEngineV2.__new__(InferenceEngineV2)
    engine._config, engine._state_manager, engine._batch = config, state, batch
    engine._model = FakeLlama(state, seed)
    return engine


def fastgen(num_blocks: int = 32, **config) -> FastGenEngine:
    return FastGenEngine(fake_inference_engine(num_blocks), hf_config(**config))


def cached_kv(engine: FastGenEngine, uid: int, layer: int) -> torch.Tensor:
    """``[seen, 2, kv_heads, head]`` of a sequence, gathered here from its descriptor's blocks."""
    desc = engine._state.get_sequence(uid)
    pos = torch.arange(desc.seen_tokens)
    table = desc.all_block_ids().long()
    return engine._state.get_cache(layer)[table[pos // engine.block_size], pos % engine.block_size]


class Recorder:
    """A capture that copies what it keeps before returning, as the protocol asks."""

    def __init__(self):
        self.segments, self.hidden, self.kv, self.ended = None, {}, {}, False

    def begin_batch(self, segments):
        self.segments = segments

    def on_layer(self, layer, hidden, kv):  # rows of successive batches (one sequence) are concatenated
        rows = kv()
        self.hidden[layer] = torch.cat([self.hidden.get(layer, hidden[:0]), hidden])
        self.kv[layer] = torch.cat([self.kv.get(layer, rows[:0]), rows])

    def end_batch(self):
        self.ended = True


def prefill(engine: FastGenEngine, uid: int, tokens: list[int], capture=None) -> torch.Tensor:
    """Dynamic SplitFuse's way: steps of at most ``max_ragged_batch_size`` tokens."""
    for off in range(0, len(tokens), MAX_BATCH):
        logits = engine.step([(uid, tokens[off : off + MAX_BATCH])], capture)
    return logits


TOKENS = [int(t) for t in torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))]


# ---- build checks ----------------------------------------------------------------------------------
@pytest.fixture
def llama_dir(tmp_path):
    hf_config().save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.fixture
def no_build(monkeypatch):
    """Fail loudly if a check lets the build through."""
    import deepspeed.inference.v2 as v2

    monkeypatch.setattr(v2, "build_hf_engine", lambda *a, **k: pytest.fail("build_hf_engine called past a failed check"))


def test_build_refuses_unsupported_model_type(tmp_path, no_build):
    LlamaConfig(model_type="llama").save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "opt"')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedModelError, match="'opt'.*supported: llama, mistral, phi3, qwen2"):
        build_fastgen_engine(str(tmp_path))


@pytest.mark.parametrize("version", ["0.18.5", "0.20.0", "1.19.0"])
def test_build_refuses_untested_deepspeed(llama_dir, no_build, monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(RuntimeError, match=rf"deepspeed>=0.19,<0.20.*found deepspeed {version}"):
        build_fastgen_engine(llama_dir)


def test_build_refuses_without_cuda(llama_dir, no_build, monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.19.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="FastGen needs a CUDA GPU.*use the reference engine"):
        build_fastgen_engine(llama_dir)


def test_build_refuses_tensor_parallel(llama_dir, no_build, monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.19.8")
    with pytest.raises(NotImplementedError, match="tp_size=2"):
        build_fastgen_engine(llama_dir, {"tensor_parallel": {"tp_size": 2}})


@pytest.mark.parametrize("config", [dict(num_key_value_heads=4), dict(num_hidden_layers=2), dict(rope_theta=500000.0)])
def test_engine_refuses_config_that_disagrees_with_fastgen_model(config):
    with pytest.raises(UnsupportedModelError, match="FastGen"):
        fastgen(**config)


# ---- scheduling interface ------------------------------------------------------------------------------
def test_capacity_delegates_to_fastgen():
    engine = fastgen()
    assert engine.seen_tokens(7) == 0 and engine.query(7, 20, 10) == (20, 3)
    engine.step([(7, TOKENS[:10])])
    assert engine.seen_tokens(7) == 10
    assert engine.free_blocks == [30] and engine.get_remaining_block_capacity(7) == 2
    assert engine.config is engine._engine._config
    engine.flush(7)
    assert engine.seen_tokens(7) == 0 and engine.free_blocks == [32]


# ---- capture --------------------------------------------------------------------------------------------
def test_capture_gets_each_layers_input_and_kv_and_changes_nothing():
    plain, captured = fastgen(), fastgen()
    plain.step([(1, TOKENS[:6])])
    captured.step([(1, TOKENS[:6])])
    rec = Recorder()
    batch = [(2, TOKENS[6:15]), (1, TOKENS[15:19])]
    logits = captured.step(batch, rec)
    torch.testing.assert_close(logits, plain.step(batch), rtol=0, atol=0)
    assert rec.segments == [Segment(2, 0, 9, 0), Segment(1, 6, 4, 9)] and rec.ended
    assert sorted(rec.hidden) == list(range(LAYERS))
    for layer in range(LAYERS):
        # K/V of exactly this batch's tokens, read back from the cache
        expected = torch.cat([cached_kv(captured, 2, layer), cached_kv(captured, 1, layer)[6:]])
        torch.testing.assert_close(rec.kv[layer], expected, rtol=0, atol=0)
        # ... and they are this layer's projection of the hidden state handed over: a capture fired after the
        # MLP norm overwrote the buffer, or for the wrong layer, would not reproduce them
        w = captured._model._transformer[layer].qkv_w
        v = (rec.hidden[layer] @ w[HEADS * HEAD :].t())[:, KV_HEADS * HEAD :]
        torch.testing.assert_close(rec.kv[layer][:, 1].flatten(1), v, rtol=1e-5, atol=1e-5)
    model = captured._model
    assert "_forward_transformer_layer" not in vars(model)
    assert "forward" not in vars(model.qkv) and "forward" not in vars(model.attn)


def test_buffer_is_reused_so_a_late_reader_would_see_other_data():
    """The fake reuses buffers as FastGen does: the view handed to on_layer changes after it returns."""

    class KeepsView(Recorder):
        def on_layer(self, layer, hidden, kv):
            super().on_layer(layer, hidden, kv)
            self.view = getattr(self, "view", {}) | {layer: hidden}

    rec = KeepsView()
    fastgen().step([(1, TOKENS[:8])], rec)
    assert not torch.equal(rec.view[0], rec.hidden[0])


def test_capture_wrappers_are_removed_when_the_forward_raises():
    class Fails(Recorder):
        def on_layer(self, layer, hidden, kv):
            raise RuntimeError("disk full")

    engine = fastgen()
    with pytest.raises(RuntimeError, match="disk full"):
        engine.step([(1, TOKENS[:4])], Fails())
    assert "forward" not in vars(engine._model.attn) and "_forward_transformer_layer" not in vars(engine._model)


# ---- restore --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", [0, 10])
def test_restore_rebuilds_the_forwards_kv_and_next_token(prefix):
    """Layer 0 by recompute (3 FastGen batches), layer 1 from hidden states in two parts, layer 2 from KV;
    after a prefix the restore starts at position ``prefix``."""
    source, rec = fastgen(), Recorder()
    prefill(source, 1, TOKENS, rec)
    target = fastgen()
    if prefix:
        prefill(target, 1, TOKENS[:prefix])
    rest = TOKENS[prefix:]
    target.begin_restore(1, len(rest))
    target.recompute_layers(1, rest, 1)
    target.recompute_layers(1, rest, 1)  # repeatable until end_restore (the profiler times it)
    assert target.seen_tokens(1) == prefix
    hidden = rec.hidden[1][prefix:]
    target.restore_from_hidden(1, 1, hidden[:13])
    target.restore_from_hidden(1, 1, hidden[13:], start=13)
    kv = rec.kv[2][prefix:]
    target.restore_kv(1, 2, kv[:13])
    target.restore_kv(1, 2, kv[13:], start=13)
    target.end_restore(1, rest)
    assert target.seen_tokens(1) == len(TOKENS)
    for layer in range(LAYERS):
        torch.testing.assert_close(cached_kv(target, 1, layer), cached_kv(source, 1, layer), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.step([(1, [3])]), source.step([(1, [3])]), rtol=1e-5, atol=1e-5)


def test_begin_restore_without_room_raises_and_allocates_nothing():
    engine = fastgen(num_blocks=4)
    with pytest.raises(CacheFullError):
        engine.begin_restore(1, 4 * BLOCK + 1)
    assert engine.free_blocks == [4]


# ---- the real engine (needs FastGen's CUDA kernels) ----------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FastGen's kernels need a CUDA GPU; the fakes above cover the logic")
def test_real_fastgen_restore_equals_recompute(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                    num_hidden_layers=4, vocab_size=1000, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).half().save_pretrained(tmp_path)
    engine = build_fastgen_engine(str(tmp_path))
    prompt = [int(t) for t in torch.randint(0, 1000, (700,))]

    def greedy(uid, first, n=8):
        out = [int(first.argmax(-1)[0])]
        for _ in range(n - 1):
            out.append(int(engine.step([(uid, [out[-1]])]).argmax(-1)[0]))
        return out

    rec = Recorder()
    recompute = greedy(1, engine.step([(1, prompt)], rec))  # 700 rows: one FastGen batch (768 by default)
    reference_kv = [cached_kv(engine, 1, layer)[: len(prompt)].clone() for layer in range(cfg.num_hidden_layers)]
    engine.flush(1)

    engine.begin_restore(2, len(prompt) - 1)
    engine.recompute_layers(2, prompt[:-1], 1)
    for layer in range(1, 3):
        engine.restore_from_hidden(2, layer, rec.hidden[layer][:-1])
    engine.restore_kv(2, 3, rec.kv[3][:-1])
    engine.end_restore(2, prompt[:-1])
    restored = greedy(2, engine.step([(2, prompt[-1:])]))
    for layer in range(cfg.num_hidden_layers):
        # hcache's RoPE rounds like FastGen's kernel up to fp16 ulps, not bit for bit
        torch.testing.assert_close(cached_kv(engine, 2, layer)[: len(prompt)], reference_kv[layer], rtol=1e-2, atol=1e-2)
    assert restored == recompute


def test_serving_engine_over_fastgen_restores_and_survives_a_corrupt_chunk(tmp_path):
    """hcache's serving engine over the adapter, driven as MII drives it (puts of at most
    max_ragged_batch_size tokens): a returning prompt is restored and gives the same logits, and so it does
    when a stored tensor is corrupt (the restore ends short, at that chunk, and the rest is prefilled)."""
    from helpers import corrupt_tensor

    from hcache.serving_engine import ServingEngine
    from hcache.storage.chunk_key import chunk_keys, root_key

    prompt = [int(t) for t in torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(2))]
    serving = ServingEngine(fastgen(), "fp", tmp_path, model_name="fake", plan="1RE+1H+1KV", save="all", readers=0)

    def put(uid: int) -> torch.Tensor:
        for off in range(0, len(prompt), MAX_BATCH):
            logits = serving.put([uid], [prompt[off : off + MAX_BATCH]])
        record = serving.record(uid)
        serving.flush(uid)
        return logits, record

    want, _ = put(0)
    got, record = put(1)
    # A chunk is keyed by all 64 of its tokens, so with puts of 16 each restore covers the last 15 of one.
    assert record.restored_tokens == 3 * 15 and record.fallback is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    key = chunk_keys(prompt, root_key(serving.fingerprint))[1]
    corrupt_tensor(serving.store, key, 1, "H")
    got, record = put(2)  # chunk 1 is recomputed (and saved again); chunks 0 and 2 still restore
    assert record.restored_tokens == 2 * 15 and "checksum mismatch" in record.fallback
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    serving.close()


def test_serving_engine_over_fastgen_adopts_from_the_gpu_prefix_cache(tmp_path):
    """The GPU prefix cache over the adapter: a finished prompt's chunks are copied into blocks reserved from
    FastGen's own allocator; a returning prompt, put as MII puts it (16 tokens at a time, so every adoption
    starts inside a chunk), adopts them and gives a fresh engine's logits; clearing the cache gives every
    block back to FastGen."""
    from hcache.serving_engine import ServingEngine

    prompt = [int(t) for t in torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(3))]
    serving = ServingEngine(fastgen(num_blocks=64), "fp", tmp_path, model_name="fake", plan="KV", readers=0, gpu_cache=True)
    fresh = fastgen(num_blocks=64)
    for off in range(0, 195, MAX_BATCH):  # 3 chunks and 3 tokens of a 4th
        serving.put([0], [prompt[off : min(off + MAX_BATCH, 195)]])
    serving.flush(0)
    assert serving.gpu_cache.blocks == 3 * 64 // BLOCK + 1 and serving.engine.free_blocks == [64 - 25]
    assert int(min(serving.free_blocks)) == 64
    for off in range(0, len(prompt), MAX_BATCH):
        logits = serving.put([1], [prompt[off : off + MAX_BATCH]])
        want = fresh.step([(1, prompt[off : off + MAX_BATCH])])
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # a chunk is keyed by all its tokens: each full chunk's last put adopts its 15 rows before the last
    # token; the last put adopts the 3 cached rows of the partial chunk
    assert serving.record(1).gpu_tokens == 3 * 15 + 3
    for layer in range(LAYERS):
        torch.testing.assert_close(cached_kv(serving.engine, 1, layer), cached_kv(fresh, 1, layer), rtol=1e-5, atol=1e-5)
    serving.flush(1)
    serving.gpu_cache.clear()
    assert serving.engine.free_blocks == [64]
    serving.close()
