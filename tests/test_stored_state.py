"""``stored_dtype``: 8-bit stored encodings of H and KV. The codes and scales (:mod:`hcache.ops.quant`), the
fused dequantise-and-scatter kernel against its torch reference bit for bit (under Triton's interpreter),
the chunk format's 8-bit tensors, and restores from compressed chunks, mixed with lossless ones, through
the serving engine; the setting's parsing and how it reaches the entry points."""
import pytest
import torch
from support.helpers import corrupt_tensor, loaded, random_prompt

from hcache.config import HCacheConfig
from hcache.errors import InvalidRequestError
from hcache.model.spec import ModelSpec
from hcache.planning.plan import Method, RestorePlan
from hcache.storage.stored_state import stored_encodings
from hcache.ops.dequant_scatter import write_dequantised, write_rows
from hcache.ops.paged_kv import block_runs, block_slots, write_kv_rows
from hcache.ops.quant import QuantRows, codes_as_float, dequantise, quantise
from hcache.serving.runtime import HCacheRuntime
from hcache.storage.chunk import Chunk, decode, encode

INT8, FP8 = torch.int8, torch.float8_e4m3fn


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- codes and scales -------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding, bound", [(INT8, 0.5 / 127), (FP8, 2.0**-4)])
def test_quantise_error_is_within_half_a_step_of_each_rows_scale(encoding, bound, rng):
    x = torch.randn(64, 3, 96, generator=rng) * torch.rand(64, 3, 1, generator=rng) * 20
    x[5, 1, 7] = 300.0  # an outlier sets its own row's scale, not its neighbours'
    rows = quantise(x, encoding)
    assert rows.codes.dtype == encoding and rows.scale.shape == (64, 3) and rows.scale.dtype == torch.float16
    back = dequantise(rows, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of absmax/127; fp8: half an ulp (3 mantissa bits) of each value, or of the subnormal floor
    limit = bound * amax if encoding == INT8 else torch.maximum(bound * x.abs(), amax / 448 * 2.0**-10)
    assert ((back - x).abs() <= limit * 1.01).all()
    assert (back[4] - x[4]).abs().max() < 0.05 * x[4].abs().max()  # the rows beside the outlier keep their precision


def test_float8_codes_read_on_a_cpu_by_their_bits_are_what_torch_converts_them_to():
    """Every float8 e4m3 code (but its NaN, never stored), subnormals and both zeros included."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    want = codes.float()
    got = codes_as_float(codes)
    assert torch.equal(got[~want.isnan()], want[~want.isnan()]) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("encoding", [INT8, FP8])
def test_dequantised_into_given_buffers_are_the_same_bits_as_into_new_ones(encoding, dtype, rng):
    """A CPU load decodes into its kept buffers (hcache/transfer/scratch.py): the same arithmetic, one
    float32 product rounded once, and the result is the buffer given."""
    x = torch.randn(64, 2, 3, 64, generator=rng) * torch.rand(64, 2, 3, 1, generator=rng) * 8
    rows = quantise(x, encoding)
    given = []
    out = dequantise(rows, dtype, lambda shape, dt: given.append(torch.full(shape, float("nan")).to(dt)) or given[-1])
    want = (rows.codes.float() * rows.scale.float().unsqueeze(-1)).to(dtype)
    assert out is given[0] and torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(dequantise(rows, dtype).view(torch.uint8), want.view(torch.uint8))


def test_zero_rows_quantise_to_zero():
    rows = quantise(torch.zeros(4, 8), INT8)
    assert torch.equal(dequantise(rows, torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16))


# ---- the fused kernel -------------------------------------------------------------------------------------
def _poisoned_cache(num_blocks, n_kv, head_size, dtype):
    return torch.full((num_blocks, 16, 2, n_kv, head_size), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("encoding", [INT8, FP8])
@pytest.mark.parametrize("head_size, n_kv", [(64, 3), (80, 1), (128, 2), (256, 1)])  # GQA-sized KV heads
def test_kernel_equals_torch_reference_bit_for_bit(head_size, n_kv, encoding, dtype, interpret, rng):
    t = 37
    kv = torch.randn(t, 2, n_kv, head_size, generator=rng) * torch.rand(t, 2, n_kv, 1, generator=rng) * 8
    kv[3, 0, 0, :4] = torch.tensor([1e-6, -1e-7, 0.0, -0.0])  # subnormal codes and signed zeros
    rows = quantise(kv, encoding)
    slots = torch.randperm(6 * 16, generator=rng)[:t]
    want, got = _poisoned_cache(6, n_kv, head_size, dtype), _poisoned_cache(6, n_kv, head_size, dtype)
    write_dequantised(want, slots, rows, backend="torch")
    write_dequantised(got, slots, rows, backend="triton")
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # NaN-poisoned: untouched slots agree too
    flat = want.view(-1, 2, n_kv, head_size)
    assert torch.equal(flat[slots], dequantise(rows, dtype))


def test_kernel_rejects_what_the_reference_would(interpret):
    cache = torch.zeros(2, 16, 2, 1, 64)
    rows = quantise(torch.randn(4, 2, 1, 64), INT8)
    with pytest.raises(ValueError, match="shapes disagree"):
        write_dequantised(cache, torch.arange(3), rows, backend="triton")
    with pytest.raises(ValueError, match="int8 or float8"):
        write_dequantised(cache, torch.arange(4), QuantRows(rows.codes.to(torch.int16), rows.scale), backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", [False, True])
def test_write_rows_mixes_lossless_and_encoded_parts_across_scattered_blocks(kernel, dtype, monkeypatch, rng):
    """A layer restored from chunks saved lossless and in both encodings, into blocks that are not adjacent,
    starting mid-block, by the CPU's in-place path and by the gathered kernel path: every row lands where
    the lossless copy would put it, dequantised as the reference does."""
    if kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    n_kv, head, blocks = 2, 64, [5, 2, 3, 9, 0, 7, 1]
    parts = [torch.randn(n, 2, n_kv, head, generator=rng).to(dtype) for n in (20, 30, 25, 11, 9)]
    encoded = [parts[0], quantise(parts[1], INT8), parts[2], quantise(parts[3], INT8), quantise(parts[4], FP8)]
    runs, slots = block_runs(blocks, 7, 95, 16), block_slots(blocks, 7, 7 + 95, 16, torch.device("cpu"))
    got, want = torch.zeros(10, 16, 2, n_kv, head, dtype=dtype), torch.zeros(10, 16, 2, n_kv, head, dtype=dtype)
    write_rows(got, runs, slots, encoded, 0)
    write_kv_rows(want, runs, [p if isinstance(p, torch.Tensor) else dequantise(p, dtype) for p in encoded], 0)
    assert torch.equal(got, want)


# ---- the chunk format -------------------------------------------------------------------------------------
def test_chunk_stores_codes_and_scales_under_checksums(rng):
    rows = quantise(torch.randn(64, 2, 3, 64, generator=rng), FP8)
    chunk = Chunk("ab" * 16, list(range(64)), "fp", {(0, "KV"): rows.codes, (0, "KV.scale"): rows.scale})
    data = encode(chunk)
    back = decode(data, chunk.key)
    assert back.tensors[(0, "KV")].dtype == FP8 and torch.equal(back.tensors[(0, "KV")].view(torch.uint8), rows.codes.view(torch.uint8))
    assert torch.equal(back.tensors[(0, "KV.scale")], rows.scale)
    assert b'"dtype":"F8_E4M3"' in data and b'"dtype":"F16"' in data
    bad = bytearray(data)
    bad[-1] ^= 0x01  # the last scale's low byte
    with pytest.raises(Exception, match="checksum mismatch in L0000.KV.scale"):
        decode(bytes(bad), chunk.key)


# ---- the setting ------------------------------------------------------------------------------------------
def test_stored_dtype_values():
    assert stored_encodings("auto") == {}
    assert stored_encodings("int8") == {"H": INT8, "KV": INT8}
    assert stored_encodings("8bit") == {"H": FP8, "KV": INT8}
    assert stored_encodings(" H=fp8 , kv=auto ") == {"H": FP8}
    for bad in ("int4", "H=fp8,H=int8", "Q=int8"):
        with pytest.raises(InvalidRequestError, match="stored_dtype"):
            HCacheConfig.of(stored_dtype=bad)


def test_the_encodings_travel_to_model_servers_and_steer_the_auto_plan(llama):
    """What hcache.mii.serve hands its model servers as JSON: the setting, and with it the auto plan's
    choice for 8-bit bytes and the formats saved."""
    from hcache.config import ResolvedConfig
    from hcache.resolve import resolve
    from hcache.planning.profile import Profile

    seconds = {"c_token": [0.01, 0.04], "c_h": [0.001, 0.004], "c_kv": [0.0, 0.0], "io_h": [0.004, 0.016], "io_kv": [0.008, 0.032]}
    settings = {"profile": Profile.new("m", llama.spec, [64, 256], seconds, {}), "stored_dtype": "H=fp8"}
    resolved = resolve(settings, llama.spec, "m")
    again = ResolvedConfig.model_validate_json(resolved.model_dump_json())
    assert again.encodings == resolved.encodings == {"H": FP8}
    assert again.policy.plan_for(None, 256) == RestorePlan.uniform(3, "H")
    assert resolve({**settings, "stored_dtype": "auto"}, llama.spec, "m").policy.plan_for(None, 256) == RestorePlan.parse("1RE+2H", 3)


def test_serve_flag_overrides_the_config_file(tmp_path):
    import argparse

    from hcache.mii.serve_command import add_parser, settings

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    (tmp_path / "c.json").write_text('{"stored_dtype": "int8", "plan": "KV"}')
    args = parser.parse_args(["serve", "--config", str(tmp_path / "c.json")])
    assert settings(args).stored_dtype == "int8"
    args = parser.parse_args(["serve", "--config", str(tmp_path / "c.json"), "--stored-dtype", "H=fp8,KV=int8"])
    assert settings(args).stored_dtype == "H=fp8,KV=int8" and settings(args).plan == "KV"


# ---- restores through the runtime -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return loaded("random:llama")


def _runtime(model, store, **settings):
    return HCacheRuntime(model, store, save="all", **settings)


@pytest.mark.parametrize("stored_dtype, plan", [("8bit", "H"), ("8bit", "KV"), ("int8", "1RE+1H+1KV"), ("fp8", "H")])
def test_restore_from_compressed_chunks_is_close_to_lossless_and_says_so(llama, tmp_path, rng, stored_dtype, plan):
    prompt = random_prompt(200, llama.spec.vocab_size, rng)
    with _runtime(llama, tmp_path / "lossless", plan=plan) as exact, _runtime(llama, tmp_path / "q", plan=plan, stored_dtype=stored_dtype) as lossy:
        exact.generate(prompt, 1)
        lossy.generate(prompt, 1)
        exact.store.flush(), lossy.store.flush()
        assert lossy.store.stores[0].used_bytes <= 0.52 * exact.store.stores[0].used_bytes
        r_exact, r_lossy = exact.generate(prompt, 1), lossy.generate(prompt, 1)
        assert r_exact.restored_tokens == r_lossy.restored_tokens == 192
        assert not r_exact.lossy and r_lossy.lossy
        assert r_lossy.bytes_read < 0.52 * r_exact.bytes_read
        uid = 10**6
        for rt in (exact, lossy):  # the restored caches, side by side
            rt.serving.open(uid)
            rt.serving.put([uid], [prompt[:193]])
        errors = []
        for layer in range(llama.spec.num_layers):
            k0, v0 = exact.engine.kv(uid, layer)
            k1, v1 = lossy.engine.kv(uid, layer)
            for a, b in ((k0, k1), (v0, v1)):
                assert not torch.equal(a, b) or plan.startswith("1RE") and layer == 0
                errors.append(((a - b).norm() / a.norm()).item())
    print(f"{stored_dtype} {plan}: relative RMS error of K and V per layer {[round(e, 4) for e in errors]}")
    # fp8 keeps 3 mantissa bits (a relative step of 1/8 at most, an RMS error near 2%); int8 per-row steps
    # are finer for KV. The projection of H sums those errors over the hidden size without raising them.
    assert max(errors) <= 0.05


def test_chunks_saved_lossless_and_compressed_restore_on_either_runtime(llama, tmp_path, rng):
    """One store, written by a lossless runtime and then, for the conversation's next turn, by a compressed
    one: a restore spans both kinds of chunk, on either runtime, and a lossless restore stays bit-exact."""
    first = random_prompt(140, llama.spec.vocab_size, rng)
    turn = first + random_prompt(130, llama.spec.vocab_size, rng)
    with _runtime(llama, tmp_path / "scratch", plan="H") as exact:
        want = exact.generate(turn, 1).output_ids
    with _runtime(llama, tmp_path, plan="H") as exact:
        exact.generate(first, 1)
    with _runtime(llama, tmp_path, plan="H", stored_dtype="fp8") as lossy:
        r = lossy.generate(turn, 1)  # restores the 2 lossless chunks, saves the next 2 compressed
        assert r.restored_tokens == 128 and not r.lossy and r.output_ids == want
    with _runtime(llama, tmp_path, plan="H") as exact:
        r = exact.generate(turn, 1)
        assert r.restored_tokens == 256 and r.lossy
        uid = 10**6
        exact.serving.open(uid)
        exact.serving.put([uid], [turn[:257]])
        k_mixed, _ = exact.engine.kv(uid, 1)
        exact.serving.flush(uid)
        exact.serving.open(uid, restore=False)
        exact.serving.put([uid], [turn[:257]])
        k_exact, _ = exact.engine.kv(uid, 1)
        assert torch.equal(k_mixed[:128], k_exact[:128])  # the lossless chunks: bit-exact
        assert not torch.equal(k_mixed[128:256], k_exact[128:256])
        assert (k_mixed - k_exact).norm() <= 0.05 * k_exact.norm()  # fp8 H: an RMS error near 2.5%


def test_state_adopted_from_the_gpu_cache_is_lossy_when_its_sequence_restored_8_bit_state(llama, tmp_path, rng):
    """The GPU prefix cache keeps a sequence's blocks as they are: rows dequantised from 8-bit chunks (and
    rows computed after them) stay lossy for every later adopter."""
    prompt = random_prompt(200, llama.spec.vocab_size, rng)
    with _runtime(llama, tmp_path, plan="KV", stored_dtype="int8", gpu_cache=True) as rt:
        rt.generate(prompt, 1)  # computed: its kept blocks are exact
        r = rt.generate(prompt, 1)
        assert r.gpu_tokens == r.restored_tokens > 0 and not r.lossy
        rt.drop_device_cache()
        r = rt.generate(prompt, 1)  # restored from the 8-bit chunks, then kept
        assert r.gpu_tokens == 0 and r.restored_tokens > 0 and r.lossy
        r = rt.generate(prompt, 1)
        assert r.gpu_tokens == r.restored_tokens > 0 and r.lossy


def test_a_corrupt_scale_falls_back_to_recompute(llama, tmp_path, rng):
    prompt = random_prompt(140, llama.spec.vocab_size, rng)
    with _runtime(llama, tmp_path, plan="KV", stored_dtype="int8") as rt:
        rt.generate(prompt, 1)
        keys = list(rt.store.keys())
        corrupt_tensor(rt.store, sorted(keys)[0], 1, "KV.scale")
        r = rt.generate(prompt, 1)
        assert "checksum mismatch" in (r.fallback or "")
        assert r.restored_tokens in (0, 64)  # the chunks before the bad one restore; it is recomputed, and saved again
        assert rt.generate(prompt, 1).restored_tokens == 128


def test_encoded_chunk_without_its_scales_is_refused(llama, tmp_path, rng):
    from hcache.restore.stored_prefix import _layout_problems
    from hcache.planning.plan import row_shapes
    from hcache.storage.chunk import ChunkLayout

    spec: ModelSpec = llama.spec
    shapes = row_shapes(spec)
    layout = ChunkLayout.plan([(0, "KV", shapes["KV"], INT8)], "fp")
    wrong, _ = _layout_problems(layout, {(0, "KV")}, set(), shapes, torch.float32)
    assert "without fitting scales" in wrong


# ---- the profile and the auto plan ------------------------------------------------------------------------
def test_auto_plan_weighs_the_encodings_bytes_and_dequantisation_cost(llama):
    from hcache.planning.profile import Profile

    spec = llama.spec
    seconds = {"c_token": [0.01, 0.04], "c_h": [0.001, 0.004], "c_kv": [0.0, 0.0], "io_h": [0.004, 0.016], "io_kv": [0.008, 0.032]}
    profile = Profile.new(llama.name, spec, [64, 256], seconds, {})
    fp8 = {"H": FP8}
    assert Method.H.bytes_per_token_layer(spec, FP8) == spec.hidden_size + 2  # codes and one float16 scale
    assert Method.KV.bytes_per_token_layer(spec, INT8) == 2 * spec.num_kv_heads * (spec.head_size + 2)
    # I/O-bound lossless: a layer recomputed; H at a quarter of the bytes is compute-bound: all H
    assert profile.plan(spec, 256) == RestorePlan.parse("1RE+2H", 3)
    assert profile.plan(spec, 256, fp8) == RestorePlan.uniform(3, "H")
    ratio = (spec.hidden_size + 2) / spec.hidden_bytes_per_token_layer
    assert profile.costs(256, {"H": ratio}).io_h == pytest.approx(0.016 * ratio)
    # RE+KV (bench restore's hybrid) and the bound weigh the encoding too: KV at a quarter of the bytes is
    # no longer worth recomputing a layer for
    int8 = {"KV": INT8}
    assert profile.plan(spec, 256, allow_h=False) == RestorePlan.parse("1RE+2KV", 3)
    assert profile.plan(spec, 256, int8, allow_h=False) == RestorePlan.uniform(3, "KV")
    assert profile.bound_seconds(spec, 256, int8) < profile.bound_seconds(spec, 256)
    # a measured dequantisation cost replaces the lossless compute cost: here, one too dear to take H
    priced = Profile.new(llama.name, spec, [64, 256], {**seconds, "c_h8": [0.05, 0.2], "c_kv8": [0.0, 0.0]}, {})
    assert priced.costs(256, {"H": ratio}).c_h == 0.2
    assert priced.plan(spec, 256, fp8).count(Method.H) < 3


def test_profile_with_and_without_8bit_costs_loads(llama, tmp_path):
    from hcache.planning.profile import Profile

    seconds = {"c_token": [0.01], "c_h": [0.001], "c_kv": [0.0], "io_h": [0.004], "io_kv": [0.008]}
    for extra in ({}, {"c_h8": [0.002], "c_kv8": [0.001]}):
        Profile.new(llama.name, llama.spec, [64], {**seconds, **extra}, {}).save(tmp_path / "p.json")
        assert Profile.load(tmp_path / "p.json", llama.spec).seconds.keys() == {**seconds, **extra}.keys()


def test_demo_refuses_a_bad_stored_dtype_before_loading_the_model(monkeypatch):
    import hcache.demo

    monkeypatch.setattr(hcache.demo, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(InvalidRequestError, match="stored_dtype"):
        hcache.demo.run_demo(stored_dtype="int4")

