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

from support import fastgen_kernel  # noqa: E402
from hcache.engine.fastgen import FastGenEngine, build_fastgen_engine  # noqa: E402
from hcache.errors import CacheFullError, UnsupportedModelError  # noqa: E402
from hcache.engine.ragged import Segment  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD, VOCAB, BLOCK = 3, 32, 4, 2, 8, 50, 8
MAX_BATCH = 16  # FastGen's max_ragged_batch_size: recompute must split longer restores


def hf_config(**overrides) -> LlamaConfig:
    args = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=LAYERS,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rope_theta=10000.0,
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
            table = ids[
                (ptr - ids.data_ptr()) // (ids.stride(0) * ids.element_size()), 0
            ].long()  # what the kernel dereferences
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
                q.transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=ctx[None, :] <= pos[:, None],
                enable_gqa=True,
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
            Params(
                qkv_w=w((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN),
                attn_out_w=w(HIDDEN, HEADS * HEAD),
                mlp_1_w=w(64, HIDDEN),
                mlp_2_w=w(HIDDEN, 64),
                attn_norm_gamma=1 + w(HIDDEN),
                mlp_norm_gamma=1 + w(HIDDEN),
            )
            for _ in range(LAYERS)
        ]
        self._non_transformer = Params(
            word_emb=w(VOCAB, HIDDEN), word_unembed=w(VOCAB, HIDDEN), final_norm=1 + w(HIDDEN)
        )


def fake_inference_engine(num_blocks: int = 32, seed: int = 0) -> InferenceEngineV2:
    """A real ``InferenceEngineV2`` (its ``put``, ``query``, ``flush``...) over CPU state and a fake model."""
    config = RaggedInferenceEngineConfig(
        state_manager=dict(max_ragged_batch_size=MAX_BATCH, max_tracked_sequences=8, max_ragged_sequence_count=4)
    )
    sm_config = config.state_manager
    kv_config = KVCacheConfig(
        block_size=BLOCK,
        cache_shape=(LAYERS, KV_HEADS, HEAD),
        cache_dtype=torch.float32,
        max_blocks_per_allocation_group=32,
    )

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
    for name, shape, dtype in [
        ("_input_ids", (MAX_BATCH,), torch.int64),
        ("_batch_metadata_storage", (2,), torch.int32),
        ("_token_to_seq_storage", (MAX_BATCH,), torch.int32),
        ("_inflight_seq_descriptors", (sm_config.max_ragged_sequence_count, 4), torch.int32),
        ("_kv_ptrs", (sm_config.max_ragged_sequence_count,), torch.int64),
    ]:
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

    monkeypatch.setattr(
        v2, "build_hf_engine", lambda *a, **k: pytest.fail("build_hf_engine called past a failed check")
    )


def test_build_refuses_unsupported_model_type(tmp_path, no_build):
    LlamaConfig(model_type="llama").save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "opt"')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(
        UnsupportedModelError,
        match="'opt' cannot run on FastGen: DeepSpeed's FastGen implements it, but "
        "hcache's FastGen adapter serves llama, mistral, phi3, qwen2; engine='auto'",
    ):
        build_fastgen_engine(str(tmp_path))


def test_the_families_deepspeed_implements_are_the_ones_named():
    """A refusal names the families DeepSpeed's FastGen implements: the list read from its engine factory."""
    import inspect
    import re

    from deepspeed.inference.v2 import engine_factory

    from hcache.engine.fastgen import DEEPSPEED_MODEL_TYPES, SUPPORTED_MODEL_TYPES

    assert sorted(set(re.findall(r'model_type == "(\w+)"', inspect.getsource(engine_factory)))) == sorted(
        DEEPSPEED_MODEL_TYPES
    )
    assert set(SUPPORTED_MODEL_TYPES) <= set(DEEPSPEED_MODEL_TYPES)


def test_a_family_fastgen_lacks_is_refused_on_fastgen_and_served_by_the_reference_engine_under_auto(monkeypatch):
    """Qwen3: ``engine="fastgen"`` is refused where settings resolve, naming DeepSpeed's list; ``"auto"`` on a
    GPU machine runs it on the reference engine, and a family FastGen serves on FastGen."""
    from hcache.config import HCacheConfig, engine_and_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(
        UnsupportedModelError,
        match="'qwen3' cannot run on FastGen: DeepSpeed 0.19's FastGen has no "
        "implementation of it \\(it implements exaone4, .*qwen2_moe\\)",
    ):
        engine_and_device(HCacheConfig(engine="fastgen"), "qwen3")
    assert engine_and_device(HCacheConfig(), "qwen3") == ("reference", "cuda")
    assert engine_and_device(HCacheConfig(), "llama") == ("fastgen", "cuda")


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


def test_kv_reads_a_sequence_from_its_blocks():
    """``kv`` (what ``hcache check`` compares) is the cache's rows of the sequence, in token order."""
    engine = fastgen()
    prefill(engine, 3, TOKENS)  # 40 tokens over 5 blocks of 8
    for layer in range(LAYERS):
        k, v = engine.kv(3, layer)
        want = cached_kv(engine, 3, layer)
        assert k.shape == (len(TOKENS), KV_HEADS, HEAD) and torch.equal(k, want[:, 0]) and torch.equal(v, want[:, 1])
        assert torch.equal(engine.kv(3, layer, 13)[0], want[:13, 0])


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


def test_recompute_batches_wait_for_the_previous_batchs_uploads_before_rewriting_host_buffers(monkeypatch):
    """Each FastGen batch rewrites the ragged batch's pinned host buffers and uploads them without blocking:
    the next batch's finalize (and the put after a restore) must wait on an event recorded once the previous
    uploads were queued, or a middle batch's K/V may be computed from the next batch's tokens. The fakes run
    inline, so the order of the calls is what is checked; the GPU test below checks the K/V."""
    engine, calls = fastgen(), []

    class Event:
        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append("wait")

    engine._uploaded = Event()
    finalize = engine._engine._batch.finalize
    monkeypatch.setattr(
        engine._engine._batch, "finalize", lambda *a, **k: (calls.append("finalize"), finalize(*a, **k))[1]
    )
    engine.begin_restore(1, len(TOKENS))  # 40 tokens: batches of 16, 16 and 8
    engine.recompute_layers(1, TOKENS, LAYERS)
    engine.end_restore(1, TOKENS)
    engine.step([(1, [3])])
    assert calls == ["finalize", "record"] + ["wait", "finalize", "record"] * 2 + ["wait", "finalize"]


def test_begin_restore_without_room_raises_and_allocates_nothing():
    engine = fastgen(num_blocks=4)
    with pytest.raises(CacheFullError):
        engine.begin_restore(1, 4 * BLOCK + 1)
    assert engine.free_blocks == [4]


# ---- the real engine (needs FastGen's CUDA kernels) ----------------------------------------------------
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="FastGen's kernels need a CUDA GPU; the fakes above cover the logic"
)


@needs_gpu
def test_real_fastgen_restore_equals_recompute(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=4,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
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
    positions = torch.arange(len(prompt) - 1)
    for layer in range(cfg.num_hidden_layers):
        got, want = cached_kv(engine, 2, layer)[: len(prompt) - 1], reference_kv[layer][:-1]
        if layer in (1, 2):  # H: V is the same GEMM's bits; K rotated by hcache's copy of FastGen's RoPE rule,
            # which evaluates the kernel's arithmetic in IEEE fp32 where the kernel uses fast-math cos/sin/pow
            # and an FMA: a few fp16 ulps of each rotated pair (hcache.ops.rope_bound says why)
            assert torch.equal(got[:, 1], want[:, 1])
            fastgen_kernel.assert_within_rope_bound(got[:, 0].cpu(), want[:, 0].cpu(), positions, cfg.head_dim)
        else:  # RE runs FastGen's own layers; KV copies FastGen's own bits
            assert torch.equal(got, want)
    assert restored == recompute


@needs_gpu
def test_real_fastgen_recompute_over_many_batches_equals_prefill(tmp_path):
    """Recompute in FastGen batches of 64 tokens, queued without a sync between them, gives the K/V of a
    prefill in the same batches run one at a time: no batch reads another's tokens from the shared host
    buffers."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=4,
        vocab_size=1000,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(cfg).half().save_pretrained(tmp_path)
    engine = build_fastgen_engine(
        str(tmp_path),
        {"state_manager": {"max_ragged_batch_size": 64, "memory_config": {"mode": "allocate", "size": 64}}},
    )
    prompt = [int(t) for t in torch.randint(0, 1000, (700,))]
    for off in range(0, len(prompt), 64):
        engine.step([(1, prompt[off : off + 64])])
        torch.cuda.synchronize()
    engine.begin_restore(2, len(prompt))
    engine.recompute_layers(2, prompt, cfg.num_hidden_layers)
    engine.end_restore(2, prompt)
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(cached_kv(engine, 2, layer), cached_kv(engine, 1, layer)), f"layer {layer}"


# Tiny random models of each family FastGen runs, in shapes its kernels take (head size 64, full rotary).
FAMILY_OVERRIDES = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": {},
    "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
# per plan, each of the 3 layers' method
PLANS = {"RE": "RE RE RE", "H": "H H H", "KV": "KV KV KV", "1RE+1H+1KV": "RE H KV"}
GPU_FORWARD = 720  # one put (FastGen's batches hold 768 tokens): 11 full 64-token chunks are saved
RETURNING = 704  # its first 11 chunks: a put of them restores all but the last token, ending inside chunk 10


@pytest.fixture(scope="module", params=sorted(FAMILY_OVERRIDES))
def real_fastgen(request, tmp_path_factory):
    """A FastGen engine over a tiny random fp16 model of each family, its KV cache allocated at 512 blocks
    (not most of the GPU), so the families' engines fit one after another."""
    if not torch.cuda.is_available():
        pytest.skip("FastGen's kernels need a CUDA GPU; the fakes above cover the logic")
    from hcache.model.random_weights import random_model

    family = request.param
    path = tmp_path_factory.mktemp(family)
    model = random_model(
        family,
        dtype=torch.float16,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=2048,
        **FAMILY_OVERRIDES[family],
    )
    model.save_pretrained(path)
    engine = build_fastgen_engine(str(path), {"state_manager": {"memory_config": {"mode": "allocate", "size": 512}}})
    yield family, engine
    del engine
    torch.cuda.empty_cache()


def _greedy(engine: FastGenEngine, uid: int, logits: torch.Tensor, n: int = 4) -> list[int]:
    out = [int(logits.argmax(-1)[-1])]
    for _ in range(n - 1):
        out.append(int(engine.step([(uid, [out[-1]])]).argmax(-1)[-1]))
    return out


def _check_restored_kv(engine: FastGenEngine, uid: int, reference_uid: int, methods: list[str], n: int) -> None:
    """The first ``n`` positions of ``uid``'s cache against FastGen's own forward of the same tokens: RE
    (FastGen's own layers) and KV (FastGen's own bytes) bit for bit, H's V bit for bit and its K within
    the bound of hcache's copy of FastGen's RoPE rule (hcache.ops.rope_bound)."""
    positions = torch.arange(n)
    for layer, method in enumerate(methods):
        got, want = cached_kv(engine, uid, layer)[:n], cached_kv(engine, reference_uid, layer)[:n]
        if method == "H":
            assert torch.equal(got[:, 1], want[:, 1]), f"layer {layer}: V"
            fastgen_kernel.assert_within_rope_bound(got[:, 0].cpu(), want[:, 0].cpu(), positions, engine.spec.head_size)
        else:
            assert torch.equal(got, want), f"layer {layer} ({method})"


@needs_gpu
def test_real_fastgen_restores_each_family_by_each_method_ending_inside_a_chunk(real_fastgen, tmp_path):
    """Per family and plan, through hcache's serving engine: a 720-token conversation is saved; it returns
    with its first 704 tokens (11 chunks), so the restore covers 703 tokens and ends inside chunk 10 (the
    last token's logits are computed). The restored cache is FastGen's own forward's (up to the RoPE bound
    for H's K), and greedy decoding continues alike."""
    from support.helpers import serving_engine

    family, engine = real_fastgen
    history = [
        int(t)
        for t in torch.randint(0, engine.spec.vocab_size, (GPU_FORWARD,), generator=torch.Generator().manual_seed(3))
    ]
    reference_logits = engine.step([(900, history[:RETURNING])])
    reference = _greedy(engine, 900, reference_logits)
    engine.flush(900)
    engine.step([(901, history)])  # FastGen's own cache of the saved forward
    for i, (plan, methods) in enumerate(PLANS.items()):
        serving = serving_engine(
            engine, f"fp-{family}", tmp_path / plan, model_name=family, plan=plan, save="all", readers=0
        )
        saved, returning = 10 * i + 1, 10 * i + 2
        serving.put([saved], [history])
        serving.flush(saved)
        logits = serving.put([returning], [history[:RETURNING]])
        record = serving.record(returning)
        assert record.restored_tokens == RETURNING - 1 and record.fallback is None, (plan, record)
        _check_restored_kv(engine, returning, 901, methods.split(), RETURNING - 1)
        assert _greedy(engine, returning, logits) == reference, plan
        serving.flush(returning)
        serving.close()
    engine.flush(901)


@needs_gpu
def test_real_fastgen_falls_back_past_a_corrupt_chunk(real_fastgen, tmp_path):
    """A stored H tensor of chunk 3 is damaged: the restore ends at chunk 3, the rest is prefilled, and
    greedy decoding continues as after FastGen's own forward."""
    from support.helpers import corrupt_tensor, serving_engine

    from hcache.storage.chunk_key import chunk_keys, root_key

    family, engine = real_fastgen
    history = [
        int(t)
        for t in torch.randint(0, engine.spec.vocab_size, (GPU_FORWARD,), generator=torch.Generator().manual_seed(4))
    ]
    reference = _greedy(engine, 900, engine.step([(900, history)]))
    engine.flush(900)
    serving = serving_engine(
        engine, f"fp-{family}", tmp_path, model_name=family, plan="1RE+1H+1KV", save="all", readers=0
    )
    serving.put([1], [history])
    serving.flush(1)
    corrupt_tensor(serving.stack.store, chunk_keys(history, root_key(serving.fingerprint))[3], 1, "H")
    logits = serving.put([2], [history])
    record = serving.record(2)
    assert record.restored_tokens == 3 * 64 and "checksum mismatch" in record.fallback
    assert _greedy(engine, 2, logits) == reference
    serving.flush(2)
    serving.close()


def test_serving_engine_over_fastgen_restores_and_survives_a_corrupt_chunk(tmp_path):
    """hcache's serving engine over the adapter, driven as MII drives it (puts of at most
    max_ragged_batch_size tokens): a returning prompt is restored and gives the same logits, and so it does
    when a stored tensor is corrupt (the restore ends short, at that chunk, and the rest is prefilled)."""
    from support.helpers import corrupt_tensor, serving_engine

    from hcache.storage.chunk_key import chunk_keys, root_key

    prompt = [int(t) for t in torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(2))]
    serving = serving_engine(fastgen(), "fp", tmp_path, model_name="fake", plan="1RE+1H+1KV", save="all", readers=0)

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
    corrupt_tensor(serving.stack.store, key, 1, "H")
    got, record = put(2)  # chunk 1 is recomputed (and saved again); chunks 0 and 2 still restore
    assert record.restored_tokens == 2 * 15 and "checksum mismatch" in record.fallback
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    serving.close()


# ---- hcache bench ops: FastGen's kernel set up through DeepSpeed's own Python --------------------------
def test_bench_ops_sets_up_fastgens_rotary_kernel_as_fastgen_does(monkeypatch):
    """``hcache bench ops``'s FastGen column builds DeepSpeed's real state manager, KV cache and ragged batch
    (only the two JIT-built CUDA modules are faked) and calls ``BlockedRotaryEmbeddings``; the fake kernel
    reads what the CUDA kernel reads (batch metadata, sequence descriptors, the block list behind
    ``kv_ptrs``) and writes K rotated by tests/support/fastgen_kernel.py, so the cache shows whether every token
    reaches its block at its position."""
    import ctypes
    from types import SimpleNamespace

    from deepspeed.inference.v2.kernels.ragged_ops.linear_blocked_kv_rotary import blocked_kv_rotary
    from deepspeed.inference.v2.ragged import kv_cache, ragged_manager, ragged_wrapper

    from hcache.bench import ops as bench_ops

    host_buffers = SimpleNamespace(allocate_fast_host_buffer=lambda t: torch.empty_like(t, device="cpu"))
    for module in (ragged_manager, ragged_wrapper):
        monkeypatch.setattr(module, "RaggedUtilsBuilder", lambda: SimpleNamespace(load=lambda: host_buffers))
    for module in (kv_cache, ragged_manager, ragged_wrapper):  # the "device" is the host
        monkeypatch.setattr(module, "get_accelerator", lambda: SimpleNamespace(current_device=lambda: "cpu"))
    for module in (kv_cache, ragged_manager):  # the real one pins its host memory
        monkeypatch.setattr(module, "BlockedAllocator", FakeAllocator)
    calls = []

    def kv_rotary_embeddings(
        kv_cache, q, k, v, rotary_dim, theta_base, batch_metadata, seq_metadata, tokens_to_seq, kv_ptrs
    ):
        n_tokens = int(batch_metadata[0])
        ((start, n, seen, _),) = seq_metadata[: int(batch_metadata[1])].tolist()
        blocks = -(-n // kv_cache.shape[1])
        table = torch.tensor(
            list((ctypes.c_int32 * blocks).from_address(int(kv_ptrs[0])))
        )  # what the kernel dereferences
        pos = torch.arange(seen, seen + n)
        heads, head = kv_cache.shape[3:]
        rows = slice(start, start + n)
        rotated = fastgen_kernel.kv_rotary(k[rows].view(n, heads, head), pos, rotary_dim, theta_base)
        kv_cache[table[pos // kv_cache.shape[1]], pos % kv_cache.shape[1]] = torch.stack(
            (rotated, v[rows].view(n, heads, head)), 1
        )
        calls.append((n_tokens, tokens_to_seq[:n_tokens].tolist(), k, v, kv_cache))

    kernels = SimpleNamespace(kv_rotary_embeddings=kv_rotary_embeddings)
    monkeypatch.setattr(blocked_kv_rotary, "RaggedOpsBuilder", lambda: SimpleNamespace(load=lambda: kernels))

    tokens, block = 300, 4  # 75 blocks: more than a KV cache config's default of 64 per sequence
    rope = bench_ops._rope(2, 64, {"rope_type": "default", "rope_theta": 10000.0})
    run = bench_ops._fastgen(2, 64, rope, torch.float16, tokens, block, torch.device("cpu"))
    run()
    ((n_tokens, token_seq, k, v, cache),) = calls
    assert n_tokens == tokens and token_seq == [0] * tokens and cache.shape == (75, block, 2, 2, 64)
    assert k.shape == v.shape == (tokens, 128) and k.stride(0) == 3 * 128  # views of one fused qkv row
    flat = cache.flatten(0, 1)[:tokens]  # one sequence, blocks allocated in order
    pos = torch.arange(tokens)
    assert torch.equal(flat[:, 1], v.reshape(tokens, 2, 64))
    assert torch.equal(flat[:, 0], fastgen_kernel.kv_rotary(k.reshape(tokens, 2, 64), pos, 64, 10000.0))


# ---- hcache prepare --fastgen ---------------------------------------------------------------------------
def test_prepare_fastgen_without_a_gpu_says_so(capsys):
    from hcache.cli import main

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without a GPU")
    assert main(["prepare", "--fastgen"]) == 2
    assert "FastGen needs a CUDA GPU" in capsys.readouterr().err


def test_prepare_fastgen_builds_fastgens_three_ops_or_says_what_is_missing(monkeypatch, capsys):
    """With a GPU, each of DeepSpeed's builders for FastGen's dense models is loaded (compiled if not
    prebuilt); without nvcc and without prebuilt ops, the error says what to install."""
    import torch.utils.cpp_extension
    from deepspeed.ops import op_builder

    from hcache.cli import main

    loaded = []
    # the CUDA builders' names (on a machine without CUDA, op_builder exports placeholders)
    for name, op in [
        ("InferenceCoreBuilder", "inference_core_ops"),
        ("RaggedOpsBuilder", "ragged_device_ops"),
        ("RaggedUtilsBuilder", "ragged_ops"),
    ]:
        monkeypatch.setattr(
            op_builder, name, type(name, (), {"name": op, "load": lambda self: loaded.append(self.name)})
        )
    monkeypatch.setattr(deepspeed, "__version__", "0.19.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", None)
    assert main(["prepare", "--fastgen"]) == 2
    assert "no CUDA toolkit (nvcc)" in capsys.readouterr().err and loaded == []
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    assert main(["prepare", "--fastgen"]) == 0
    assert loaded == ["inference_core_ops", "ragged_device_ops", "ragged_ops"]
    assert "FastGen's ops ready" in capsys.readouterr().out


# ---- hcache profile --engine fastgen ---------------------------------------------------------------------
def test_profile_measures_through_the_fastgen_adapter():
    """The profiler's costs come from the FastGen engine's own restore primitives (here over the fakes)."""
    from hcache.planning.profiler import measure_engine

    profile = measure_engine(fastgen(), "fake", [64, 128], repeats=1, readers=1)
    assert profile.tokens == [64, 128]
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in profile.seconds.values())


def test_profile_fastgen_without_a_gpu_says_so(capsys):
    from hcache.cli import main

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without a GPU")
    assert main(["profile", "--engine", "fastgen", "--model", "random:llama", "--short"]) == 2
    assert "--engine fastgen needs a CUDA GPU" in capsys.readouterr().err


def test_serving_engine_over_fastgen_adopts_from_the_gpu_prefix_cache(tmp_path):
    """The GPU prefix cache over the adapter: a finished prompt's chunks are copied into blocks reserved from
    FastGen's own allocator; a returning prompt, put as MII puts it (16 tokens at a time, so every adoption
    starts inside a chunk), adopts them and gives a fresh engine's logits; clearing the cache gives every
    block back to FastGen."""
    from support.helpers import serving_engine

    prompt = [int(t) for t in torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(3))]
    serving = serving_engine(
        fastgen(num_blocks=64), "fp", tmp_path, model_name="fake", plan="KV", readers=0, gpu_cache=True
    )
    fresh = fastgen(num_blocks=64)
    for off in range(0, 195, MAX_BATCH):  # 3 chunks and 3 tokens of a 4th
        serving.put([0], [prompt[off : min(off + MAX_BATCH, 195)]])
    serving.flush(0)
    assert serving.stack.gpu_cache.blocks == 3 * 64 // BLOCK + 1 and serving.engine.free_blocks == [64 - 25]
    assert int(min(serving.free_blocks)) == 64
    for off in range(0, len(prompt), MAX_BATCH):
        logits = serving.put([1], [prompt[off : off + MAX_BATCH]])
        want = fresh.step([(1, prompt[off : off + MAX_BATCH])])
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # a chunk is keyed by all its tokens: each full chunk's last put adopts its 15 rows before the last
    # token; the last put adopts the 3 cached rows of the partial chunk
    assert serving.record(1).gpu_tokens == 3 * 15 + 3
    for layer in range(LAYERS):
        torch.testing.assert_close(
            cached_kv(serving.engine, 1, layer), cached_kv(fresh, 1, layer), rtol=1e-5, atol=1e-5
        )
    serving.flush(1)
    serving.stack.gpu_cache.clear()
    assert serving.engine.free_blocks == [64]
    serving.close()
