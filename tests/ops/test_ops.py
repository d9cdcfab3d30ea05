"""RoPE and the rotate-and-write op: the torch reference against transformers, and the Triton kernel (run
by Triton's interpreter on the CPU) against the reference, bit for bit, on a poisoned paged cache."""

import json

from support import fastgen_kernel
import pytest
import torch
from support.helpers import loaded, random_prompt
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

from hcache.cli import main
from hcache.engine.reference import ReferenceEngine
from hcache.model.spec import ModelSpec, RopeSpec
from hcache.ops import apply_rope, read_kv, rope_cos_sin, rotate_and_write, slot_mapping
from hcache.ops.paged_kv import copy_slots
from hcache.ops.rope_bound import fast_math_angle_error
from hcache.ops.rope_scatter import resolve_backend

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# RoPE variants, as (model_type, rope_parameters) of a config: partial rotary is half the head, as in phi
ROPES = {
    "full": ("llama", {"rope_type": "default", "rope_theta": 10000.0}),
    "partial": ("phi3", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "llama3": ("llama", LLAMA3),
}
HF_ROPE = {"llama": (LlamaRotaryEmbedding, llama_apply), "phi3": (Phi3RotaryEmbedding, phi3_apply)}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def config(kind: str, head_size: int):
    model_type, rope_parameters = ROPES[kind]
    return AutoConfig.for_model(
        model_type,
        hidden_size=4 * head_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )


def rope_spec(kind: str, head_size: int) -> RopeSpec | None:
    """RoPE as hcache derives it from a model config, or none (OPT)."""
    return None if kind == "none" else ModelSpec.from_config(config(kind, head_size)).rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["full", "llama3", "partial"])
def test_reference_equals_transformers(kind, dtype, rng):
    cfg = config(kind, 64)
    hf_rotary, hf_apply = HF_ROPE[cfg.model_type]
    rope = ModelSpec.from_config(cfg).rope
    positions = torch.randint(0, 20000, (37,), generator=rng)
    q, k = torch.randn(2, 37, 2, 64, generator=rng).to(dtype)
    cos_hf, sin_hf = hf_rotary(cfg)(q, positions[None])
    cos, sin = rope_cos_sin(rope, positions, dtype)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])
    # transformers rotates [batch, heads, seq, dim]
    q_hf, k_hf = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)
    assert torch.equal(apply_rope(q, cos, sin), q_hf[0].transpose(0, 1))
    cache = torch.zeros(4, 16, 2, 2, 64, dtype=dtype)
    slots = torch.randperm(64, generator=rng)[:37]
    rotate_and_write(cache, slots, k, q, (cos, sin), backend="torch")
    k_cached, v_cached = read_kv(cache, slots).unbind(1)
    assert torch.equal(k_cached, k_hf[0].transpose(0, 1)) and torch.equal(v_cached, q)


def ragged_batch(lengths_starts, block_size, num_blocks, rng):
    """Flat slots and positions of sequences ``(length, first position)`` with random, disjoint, non-contiguous
    block tables, and the blocks in no table."""
    blocks = torch.randperm(num_blocks, generator=rng)
    slots, positions, used = [], [], 0
    for length, start in lengths_starts:
        table = blocks[used : used + -(-(start + length) // block_size)]
        used += len(table)
        pos = torch.arange(start, start + length)
        slots.append(slot_mapping(table, pos, block_size))
        positions.append(pos)
    assert used < num_blocks
    return torch.cat(slots), torch.cat(positions), blocks[used:]


# Three sequences: starting mid-block, a single token on a block's last slot (a decode step), and one
# starting mid-block past position 128; 16-token blocks make every sequence cross several blocks.
SEQUENCES = [(37, 5), (1, 63), (70, 130)]
BLOCK_SIZE, NUM_BLOCKS = 16, 24
N_KV = {64: 1, 80: 2, 96: 3, 128: 8, 256: 2}  # GQA and MHA alike: K/V see only the KV heads


def check_kernel_against_reference(head_size, n_kv, dtype, rope, rng, rule="hf"):
    slots, positions, unused_blocks = ragged_batch(SEQUENCES, BLOCK_SIZE, NUM_BLOCKS, rng)
    n = len(slots)
    # K and V as the K/V GEMM leaves them: strided views of one [T, 2·kv_dim] output
    kv = torch.randn(n, 2 * n_kv * head_size, generator=rng).to(dtype)
    k, v = (x.view(n, n_kv, head_size) for x in kv.split(n_kv * head_size, dim=-1))
    cos_sin = rope_cos_sin(rope, positions, dtype, rule) if rope else None
    poison = torch.full((NUM_BLOCKS, BLOCK_SIZE, 2, n_kv, head_size), float("nan"), dtype=dtype)
    expected, cache = poison.clone(), poison.clone()
    rotate_and_write(expected, slots, k, v, cos_sin, backend="torch")
    rotate_and_write(cache, slots, k, v, cos_sin, backend="triton")

    bits = BITS[dtype]
    # every written element: the reference's bits, none left poisoned
    assert torch.equal(cache.view(bits).flatten(0, 1)[slots], expected.view(bits).flatten(0, 1)[slots])
    assert not cache.flatten(0, 1)[slots].isnan().any()
    # every other element, in blocks of the tables and in blocks of none: the poison, bit for bit
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[slots] = True
    assert torch.equal(cache.view(bits).flatten(0, 1)[~written], poison.view(bits).flatten(0, 1)[~written])
    assert torch.equal(cache.view(bits)[unused_blocks], poison.view(bits)[unused_blocks])
    if rope is not None:  # the rotation happened: K differs from its input where it rotates
        assert not torch.equal(cache.flatten(0, 1)[slots, 0], k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_kernel_equals_reference(head_size, dtype, interpret, rng):
    check_kernel_against_reference(head_size, N_KV[head_size], dtype, rope_spec("full", head_size), rng)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_kernel_equals_reference_under_fastgens_rule(head_size, dtype, interpret, rng):
    """float32 tables: the kernel rounds once, as the reference does for them."""
    check_kernel_against_reference(head_size, N_KV[head_size], dtype, rope_spec("full", head_size), rng, rule="fastgen")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("theta, head_size", [(10000.0, 64), (1e6, 128)])
def test_fastgen_rule_is_fastgens_kernel_arithmetic(theta, head_size, dtype, rng):
    """The "fastgen" rule against a torch emulation of FastGen's kernel written from its CUDA source
    (tests/support/fastgen_kernel.py). Both evaluate the same fp32 operations with the same torch functions, so
    here they agree bit for bit; against the real kernel (fast-math cos/sin/pow, FMA) the GPU tests allow
    the few fp16 ulps that :func:`hcache.ops.rope_bound.rope_bound` derives. theta 1e6 (Mistral, Qwen2) puts
    FastGen's lowest fp16 frequencies among the subnormals."""
    rope = ModelSpec.from_config(
        AutoConfig.for_model(
            "llama", hidden_size=4 * head_size, num_attention_heads=4, num_key_value_heads=2, rope_theta=theta
        )
    ).rope
    positions = torch.cat((torch.arange(700), torch.randint(700, 8192, (100,), generator=rng)))
    k = (3 * torch.randn(len(positions), 2, head_size, generator=rng)).to(dtype)
    expected = fastgen_kernel.kv_rotary(k, positions, rope.rotary_dim, theta)
    cache = torch.zeros(len(positions), 1, 2, 2, head_size, dtype=dtype)
    slots = torch.arange(len(positions))
    rotate_and_write(cache, slots, k, k, rope_cos_sin(rope, positions, dtype, "fastgen"), backend="torch")
    assert torch.equal(cache[:, 0, 0], expected)
    if dtype == torch.float16:  # the issue's symptom: transformers' rounding is far outside FastGen's bound
        hf = apply_rope(k, *rope_cos_sin(rope, positions, dtype, "hf"))
        with pytest.raises(AssertionError, match="past the bound"):
            fastgen_kernel.assert_within_rope_bound(hf, expected, positions, rope.rotary_dim)


def test_fastgen_bound_covers_fma_and_fast_math_error(rng):
    """The GPU tolerance covers what the real kernel changes: the last sum fused (one fp32 rounding fewer)
    and cos/sin off by the fast-math error bound at each token's position."""
    positions = torch.randint(0, 8192, (500,), generator=rng)
    k = (3 * torch.randn(500, 2, 128, generator=rng)).half()
    expected = fastgen_kernel.kv_rotary(k, positions, 128, 10000.0)
    rope = ModelSpec.from_config(AutoConfig.for_model("llama", hidden_size=512, num_attention_heads=4)).rope
    cos, sin = rope_cos_sin(rope, positions, torch.float16, "fastgen")
    err = fast_math_angle_error(positions).double()[:, None]
    cos, sin = cos.double() + err, sin.double() - err
    fused = apply_rope(k.double(), cos, sin).half()  # float64 then one rounding: what an FMA does, and more
    fastgen_kernel.assert_within_rope_bound(fused, expected, positions, 128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "kind, head_size", [("partial", 80), ("partial", 96), ("llama3", 128), ("none", 64), ("none", 128)]
)
def test_kernel_equals_reference_partial_scaled_and_without_rope(kind, head_size, dtype, interpret, rng):
    check_kernel_against_reference(head_size, N_KV[head_size], dtype, rope_spec(kind, head_size), rng)


def test_backend_dispatch(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", cpu) == "torch" and resolve_backend("auto", cuda) == "triton"
    assert resolve_backend("torch", cuda) == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("cuda", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu) == "triton" and resolve_backend("triton", cpu) == "triton"


class _Rows:
    """Keeps each layer's captured normalised input and K/V."""

    def begin_batch(self, segments):
        self.layers = {}

    def on_layer(self, layer, hidden, kv):
        self.layers[layer] = (hidden.clone(), kv())

    def end_batch(self):
        pass


@pytest.mark.parametrize("family", ["llama", "phi3", "opt"])  # full, partial and no RoPE
def test_engine_forward_and_restores_through_the_kernel(family, monkeypatch, rng):
    """With the kernel selected (auto, under the interpreter), the forward writes the cache the torch path
    writes, and H and KV restores rebuild it bit for bit."""
    tiny = loaded(f"random:{family}")
    prompt = random_prompt(70, tiny.spec.vocab_size, rng)
    by_torch = ReferenceEngine(tiny.model, tiny.spec, num_blocks=4, block_size=32)
    logits = by_torch.step([(0, prompt)])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine, rows = ReferenceEngine(tiny.model, tiny.spec, num_blocks=8, block_size=32), _Rows()
    engine.cache.layers = [torch.full_like(c, float("nan")) for c in engine.cache.layers]
    assert torch.equal(engine.step([(0, prompt)], capture=rows), logits)
    engine.begin_restore(1, len(prompt))
    for layer, (hidden, kv) in rows.layers.items():
        if layer % 2:
            engine.restore_kv(1, layer, kv)
        else:
            engine.restore_from_hidden(1, layer, hidden)
    engine.end_restore(1, prompt)
    for layer in range(tiny.spec.num_layers):
        for got, restored, want in zip(engine.kv(0, layer), engine.kv(1, layer), by_torch.kv(0, layer)):
            assert torch.equal(got, want) and torch.equal(restored, want), f"layer {layer}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark times the kernel")
def test_bench_ops_without_a_gpu_times_only_the_reference(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "ops.json"
    assert main(["bench", "ops", "--tokens", "100", "--shapes", "llama3-8b", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["copy_peak_gbps"] is None and "no GPU" in result["note"]
    (case,) = result["cases"]
    assert case["torch_ms"] > 0 and case["kernel_ms"] is None and case["kernel_gbps"] is None


@pytest.mark.parametrize(
    "dtype, tables, head_size, half",
    [
        (torch.float32, torch.float32, 128, 64),
        (torch.bfloat16, torch.bfloat16, 80, 20),
        (torch.float16, torch.float32, 128, 64),
    ],
)
def test_kernel_compiles_for_a_gpu_without_fma(dtype, tables, head_size, half, monkeypatch):
    """The interpreter accepts code the compiler rejects: compile for sm_90 too (ptxas ships with triton).
    The reference's bits need FMA contraction off (float32 is where it would apply: 16-bit products are
    rounded before the sum); 16-byte accesses are what bandwidth needs."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hcache.ops import rope_scatter_kernel as kernel

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = kernel._jit(kernel._rope_scatter, False)
    ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
    constexprs = dict(
        HEAD_SIZE=head_size,
        HALF=half,
        ROUND_OP=kernel._jit(kernel._ROUND[tables], False),
        ROUND=kernel._jit(kernel._ROUND[dtype], False),
        BLOCK_T=4,
        BLOCK_H=8,
        BLOCK_D=128,
        BLOCK_HALF=64,
    )
    signature = {
        name: "constexpr"
        if name in constexprs
        else "*i64"
        if name == "slot_ptr"
        else ptr[tables]
        if name in ("cos_ptr", "sin_ptr")
        else ptr[dtype]
        if name.endswith("_ptr")
        else "i32"
        for name in fn.arg_names
    }
    # what the JIT assumes of 16-byte-aligned pointers and strides that are multiples of 16
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name.endswith("_ptr") or name.startswith("stride")
    }
    compiled = triton_compile(
        ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32), options=kernel.COMPILE_OPTIONS
    )
    ptx = compiled.asm["ptx"]
    assert "fma." not in ptx
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx


def test_kernel_rejects_shapes_the_reference_would(interpret):
    cache = torch.zeros(2, 16, 2, 2, 64)
    k = v = torch.zeros(5, 2, 64)
    slots = torch.arange(5)
    cos = sin = torch.zeros(5, 64)
    with pytest.raises(ValueError, match="shapes disagree"):
        rotate_and_write(cache, slots, torch.zeros(5, 4, 64), torch.zeros(5, 4, 64), None)
    with pytest.raises(ValueError, match="shapes disagree"):
        rotate_and_write(cache, slots[:4], k, v, None)
    with pytest.raises(ValueError, match="do not fit"):
        rotate_and_write(cache, slots, k, v, (cos[:4], sin[:4]))
    with pytest.raises(ValueError, match="dtype"):
        rotate_and_write(cache, slots, k, v, (cos.half(), sin.half()))


def test_copy_slots_moves_every_layers_rows_between_scattered_blocks(rng):
    caches = [torch.randn(6, 4, 2, 3, 8, generator=rng) for _ in range(2)]
    before = [c.clone() for c in caches]
    src = torch.tensor([9, 10, 11, 12, 2])  # across a block boundary, then another block
    dst = torch.tensor([20, 21, 22, 23, 16])
    copy_slots(caches, src, dst)
    for cache, old in zip(caches, before):
        flat, old_flat = cache.view(24, 2, 3, 8), old.view(24, 2, 3, 8)
        assert torch.equal(flat[dst], old_flat[src])
        untouched = torch.ones(24, dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(flat[untouched], old_flat[untouched])
