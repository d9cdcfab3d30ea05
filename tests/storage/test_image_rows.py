"""One tensor of many chunk images in one call (hcache/storage/image_rows.py): the same rows, in order, as
reading image by image, lossless or 8-bit; and images it cannot gather so are said to be."""

import torch

from hcache.ops.quant import QuantRows
from hcache.storage.chunk import ChunkImage, ChunkLayout
from hcache.storage.chunk_key import CHUNK_TOKENS
from hcache.storage.host_pool import PAGE, HostPool
from hcache.storage.image_rows import ImageRows
from hcache.storage.stored_state import stored_rows

TENSORS = [(0, "H", (8,), torch.bfloat16), (1, "KV", (2, 2, 4), torch.int8), (1, "KV.scale", (2, 2), torch.float16)]


def _images(pool: HostPool, layout: ChunkLayout, rng: torch.Generator, n: int) -> list[ChunkImage]:
    """``n`` images of random rows in slots of ``pool``, with a page left between some of them, so their
    starts are not evenly spaced."""
    images = []
    for i in range(n):
        if i % 2:
            pool.alloc(PAGE)
        slot = pool.alloc(layout.nbytes)
        image = ChunkImage(pool.view(slot, 0, layout.nbytes), layout, "fp", slot=slot)
        for layer, fmt, _, dtype in TENSORS:
            rows = image.tensor(layer, fmt)
            rows.copy_(
                torch.randint(-100, 100, rows.shape, generator=rng)
                if dtype == torch.int8
                else torch.randn(rows.shape, generator=rng)
            )
        images.append(image)
    return images


def _empty(shape, dtype):
    return torch.full(shape, 7, dtype=dtype)  # not zeros: every element must be written


def test_a_tensor_of_a_run_of_images_is_their_rows_in_order_lossless_or_8bit(rng):
    layout = ChunkLayout.plan(TENSORS, "fp")
    pool = HostPool(16 * (layout.nbytes + 2 * PAGE))
    images = _images(pool, layout, rng, 5)
    starts = [image.data.storage_offset() for image in images]
    assert len({b - a for a, b in zip(starts, starts[1:])}) > 1  # not evenly spaced
    rows = ImageRows.of(images)
    assert rows is not None
    for chunks in (range(0, 5), range(1, 4), range(3, 4)):
        h = rows.stored_rows(0, "H", chunks, _empty)
        assert h.shape == (len(chunks) * CHUNK_TOKENS, 8) and h.dtype == torch.bfloat16
        assert torch.equal(h, torch.cat([stored_rows(images[j], 0, "H") for j in chunks]))
        kv = rows.stored_rows(1, "KV", chunks, _empty)
        each = [stored_rows(images[j], 1, "KV") for j in chunks]
        assert isinstance(kv, QuantRows) and all(isinstance(e, QuantRows) for e in each)
        assert torch.equal(kv.codes, torch.cat([e.codes for e in each])) and torch.equal(
            kv.scale, torch.cat([e.scale for e in each])
        )


def test_images_apart_or_laid_out_otherwise_are_not_gathered(rng):
    layout = ChunkLayout.plan(TENSORS, "fp")
    pool = HostPool(8 * (layout.nbytes + 2 * PAGE))
    images = _images(pool, layout, rng, 2)
    assert ImageRows.of(images) is not None and ImageRows.of([]) is None
    apart = ChunkImage(torch.zeros(layout.nbytes, dtype=torch.uint8), layout, "fp")  # not in the pool's arena
    assert ImageRows.of([*images, apart]) is None
    other = ChunkLayout.plan([(0, "H", (8,), torch.bfloat16)], "fp")
    slot = pool.alloc(other.nbytes)
    assert ImageRows.of([*images, ChunkImage(pool.view(slot, 0, other.nbytes), other, "fp", slot=slot)]) is None
