"""The paged-cache layout without vLLM: a probe refuses a write that lays blocks out unevenly, the
standardized (FlashAttention) layout is read through its strides, on tensors laid out as vLLM's CUDA build
allocates and views them, and any map is written and read where it says, through strided views or not."""

import pytest
import torch

from hcache.ops.paged_layout import LayoutError, PagedLayout
from hcache.ops.quant import QuantRows, dequantise, quantise

BLOCKS, HEADS, BLOCK, HEAD = 5, 3, 32, 64
INT8, FP8 = torch.int8, torch.float8_e4m3fn


def _rows(n: int, dtype) -> torch.Tensor:
    return torch.randn(n, 2, HEADS, HEAD, generator=torch.Generator().manual_seed(n)).to(dtype)


def test_a_probe_refuses_a_write_that_lays_blocks_out_differently():
    def uneven(rows, cache, slots):  # the second block's tokens land in reverse order
        flat = cache.view(2, -1, 2 * HEAD)
        for t, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BLOCK)
            offset = BLOCK - 1 - offset if block else offset
            for h in range(HEADS):
                flat[block, h * BLOCK + offset] = rows[t, :, h].flatten()

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
    assert len(layout.parts) == 1  # K and V at one set of strides: one view
    elements = layout.elements(blocks, offsets)
    assert torch.equal(layout.read(cache, elements), rows)
    ours = torch.zeros_like(storage)
    layout.write(ours.transpose(1, 2) if physical == "LBNHC" else ours, elements, rows)
    assert torch.equal(ours, storage)


def _cpu_backend_map() -> torch.Tensor:
    """vLLM's CPU backend's map (vec ISAs): a head's K then V in each block, K's channels strided across
    the block's tokens, V's rows plain."""
    n, kv, h, c = torch.meshgrid(*(torch.arange(k) for k in (BLOCK, 2, HEADS, HEAD)), indexing="ij")
    head = h * 2 * BLOCK * HEAD
    return torch.where(kv == 0, head + c * BLOCK + n, head + BLOCK * HEAD + n * HEAD + c)


@pytest.mark.parametrize("tokens", ["scattered", "whole blocks, then part of one"])
@pytest.mark.parametrize("kind", ["K and V apart", "no stride pattern"])
def test_a_layout_writes_and_reads_each_element_where_its_map_says(kind, tokens):
    """A map strided for K and V apart (the CPU backend's) goes through two strided views, block by block
    where tokens fill whole blocks in order (a load's); a map that is no stride pattern (AMX packs K in
    tiles; here, the CPU map's places shuffled) element by element. Either way every element lands where the
    map puts it, and reads back."""
    offsets = _cpu_backend_map()
    if kind == "no stride pattern":
        offsets = torch.randperm(offsets.numel(), generator=torch.Generator().manual_seed(2))[offsets]
    layout = PagedLayout(offsets, offsets.numel())
    assert layout.strided == (kind == "K and V apart") and (not layout.strided or len(layout.parts) == 2)
    if tokens == "scattered":
        slots = torch.randperm(BLOCKS * BLOCK, generator=torch.Generator().manual_seed(3))[:70]
    else:
        slots = torch.cat(
            [torch.arange(3 * BLOCK, 4 * BLOCK), torch.arange(BLOCK, 2 * BLOCK), torch.arange(4 * BLOCK, 4 * BLOCK + 5)]
        )
    blocks, within = slots // BLOCK, slots % BLOCK
    rows = _rows(len(slots), torch.float32)
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD)
    elements = layout.elements(blocks, within, whole=0 if tokens == "scattered" else 2)
    layout.write(cache, elements, rows)
    expected = torch.zeros(cache.numel())
    expected[(blocks * offsets.numel()).view(-1, 1, 1, 1) + offsets[within]] = rows
    assert torch.equal(cache.view(-1), expected)
    assert torch.equal(layout.read(cache, elements), rows)


@pytest.mark.parametrize("kind", ["flat (FastGen's)", "K and V apart", "no stride pattern"])
def test_every_layout_writes_a_restores_parts_as_stored_lossless_and_8_bit(kind):
    """The one paged writer, for every engine: a layer's rows as a restore has them, one part a chunk, some
    lossless and some 8-bit, land dequantised where the map puts them. FastGen's layout (the reference
    engine's) is flat: its tokens are slots, written a run of consecutive slots at a time, here across blocks
    out of order and adjacent ones; the others write the parts decoded as one."""
    if kind == "flat (FastGen's)":
        cache = torch.zeros(BLOCKS, BLOCK, 2, HEADS, HEAD)
        layout = PagedLayout.blocked(cache)
        offsets = layout.offsets
    else:
        offsets = _cpu_backend_map()
        if kind == "no stride pattern":
            offsets = torch.randperm(offsets.numel(), generator=torch.Generator().manual_seed(2))[offsets]
        cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD)
        layout = PagedLayout(offsets, offsets.numel())
    assert layout.flat == (kind == "flat (FastGen's)")
    slots = torch.cat([torch.arange(3 * BLOCK + 7, 5 * BLOCK), torch.arange(BLOCK, BLOCK + 20)])  # 2 runs
    blocks, within = slots // BLOCK, slots % BLOCK
    rows = _rows(len(slots), torch.float32)
    bounds = [0, 20, 50, 70, len(slots)]
    parts = [rows[a:b] for a, b in zip(bounds, bounds[1:])]
    parts[1], parts[3] = quantise(parts[1], INT8), quantise(parts[3], FP8)
    decoded = torch.cat([dequantise(p, torch.float32) if isinstance(p, QuantRows) else p for p in parts])
    places = layout.elements(blocks, within)
    assert (places.runs is not None) == layout.flat
    if layout.flat:
        assert [(row, n) for row, _, n in places.runs] == [(0, 2 * BLOCK - 7), (2 * BLOCK - 7, 20)]
    layout.write(cache, places, parts)
    expected = torch.zeros(cache.numel())
    expected[(blocks * offsets.numel()).view(-1, 1, 1, 1) + offsets[within]] = decoded
    assert torch.equal(cache.view(-1), expected)
    assert torch.equal(layout.read(cache, places), decoded)


def test_a_flat_layouts_places_from_a_later_token_are_its_places_cut():
    """What a layer restored from a later row writes through (``Places.tail``): the same slots and runs as
    places found for those tokens alone, cut inside a run, at a run's end and past every run."""
    layout = PagedLayout.blocked(torch.zeros(BLOCKS, BLOCK, 2, HEADS, HEAD))
    slots = torch.cat([torch.arange(3 * BLOCK + 7, 5 * BLOCK), torch.arange(BLOCK, BLOCK + 20)])
    places = layout.elements(slots // BLOCK, slots % BLOCK)
    for start in (0, 5, 2 * BLOCK - 7, 2 * BLOCK, len(slots)):
        alone = layout.elements(slots[start:] // BLOCK, slots[start:] % BLOCK)
        cut = places.tail(start)
        assert torch.equal(cut.slots, alone.slots) and cut.runs == alone.runs, start
