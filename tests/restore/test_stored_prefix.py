"""A stored prefix's chunk layouts (:mod:`hcache.restore.stored_prefix`): an 8-bit format without its scales
is refused."""

import torch
from support.helpers import loaded

from hcache.planning.plan import row_shapes
from hcache.restore.stored_prefix import _layout_problems
from hcache.storage.chunk import ChunkLayout


def test_encoded_chunk_without_its_scales_is_refused():
    shapes = row_shapes(loaded("random:llama").spec)
    layout = ChunkLayout.plan([(0, "KV", shapes["KV"], torch.int8)], "fp")
    wrong, _ = _layout_problems(layout, {(0, "KV")}, set(), shapes, torch.float32)
    assert "without fitting scales" in wrong
