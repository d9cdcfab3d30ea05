"""8-bit codes and scales (:mod:`hcache.ops.quant`): each row's error within half a step of its own scale,
float8 codes read by their bits, and dequantisation into given buffers bit for bit."""

import pytest
import torch

from hcache.ops.quant import codes_as_float, dequantise, quantise

INT8, FP8 = torch.int8, torch.float8_e4m3fn


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
