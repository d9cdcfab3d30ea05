"""The fused dequantise-and-scatter kernel (:mod:`hcache.ops.dequant_scatter`) against its torch reference
bit for bit, under Triton's interpreter, and a layer's lossless and 8-bit parts written across scattered
blocks by the CPU path and the kernel path alike."""

import pytest
import torch

from hcache.ops.dequant_scatter import write_dequantised, write_rows
from hcache.ops.paged_kv import flat_slots, slot_runs, write_kv_rows
from hcache.ops.quant import QuantRows, dequantise, quantise

INT8, FP8 = torch.int8, torch.float8_e4m3fn


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
    slots = flat_slots(blocks, 7, 7 + 95, 16, torch.device("cpu"))
    runs = slot_runs(slots.numpy())
    got, want = torch.zeros(10, 16, 2, n_kv, head, dtype=dtype), torch.zeros(10, 16, 2, n_kv, head, dtype=dtype)
    write_rows(got, runs, slots, encoded, 0)
    write_kv_rows(want, runs, [p if isinstance(p, torch.Tensor) else dequantise(p, dtype) for p in encoded], 0)
    assert torch.equal(got, want)
