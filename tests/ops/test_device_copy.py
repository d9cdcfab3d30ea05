"""A GPU's view of the pinned host pool (hcache/ops/device_copy.py ``host_alias``): none where there is no GPU
or the memory is not pinned; on a GPU, the pool's own bytes, which one gather reads for many chunks."""

import pytest
import torch

from hcache.ops.device_copy import host_alias
from hcache.storage.chunk import ChunkImage, ChunkLayout
from hcache.storage.host_pool import PAGE, HostPool
from hcache.storage.image_rows import ImageRows
from hcache.storage.stored_state import stored_rows

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="a host alias is a GPU's view of pinned memory")


def test_off_a_gpu_or_unpinned_there_is_no_alias():
    assert host_alias(torch.zeros(PAGE, dtype=torch.uint8), torch.device("cpu")) is None
    if torch.cuda.is_available():
        assert host_alias(torch.zeros(PAGE, dtype=torch.uint8), torch.device("cuda")) is None  # pageable


@CUDA
def test_a_pinned_pools_alias_reads_its_bytes_and_gathers_a_layer_of_many_chunks_in_one_call(rng):
    device = torch.device("cuda")
    layout = ChunkLayout.plan([(0, "KV", (2, 4, 16), torch.float16), (1, "H", (64,), torch.bfloat16)], "fp")
    pool = HostPool(40 * (layout.nbytes + PAGE), pin=True)
    images = []
    for _ in range(32):
        slot = pool.alloc(layout.nbytes)
        image = ChunkImage(pool.view(slot, 0, layout.nbytes), layout, "fp", slot=slot)
        for layer, fmt in ((0, "KV"), (1, "H")):
            rows = image.tensor(layer, fmt)
            rows.copy_(torch.randn(rows.shape, generator=rng))
        images.append(image)
    alias = host_alias(pool.arena, device)
    assert alias is not None and alias.device == device
    assert torch.equal(alias[: 4 * PAGE].cpu(), pool.arena[: 4 * PAGE])
    rows = ImageRows.of(images, device)
    assert rows is not None and rows.base.device == device
    empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    for layer, fmt in ((0, "KV"), (1, "H")):
        got = rows.stored_rows(layer, fmt, range(3, 29), empty)
        assert torch.equal(got.cpu(), torch.cat([stored_rows(images[j], layer, fmt) for j in range(3, 29)]))
