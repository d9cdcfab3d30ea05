"""A restore in progress (``engine/restore_state.py``), in the engines' own cache layout: each layer's KV
rows land from the row its restore starts at, through the one paged writer, and H's rotated rows and a slot
copy land in the same slots, across blocks that are not adjacent."""

import numpy as np
import torch

from hcache.engine.restore_state import RestoreState
from hcache.ops.paged_kv import block_positions
from hcache.ops.paged_layout import PagedLayout
from hcache.ops.quant import quantise

BLOCK, HEADS, HEAD = 16, 2, 8
BLOCKS = [6, 2, 3, 0]  # the sequence's block table: 3 follows 2, the others are apart
BASE, TOKENS = 5, 40  # the restore covers positions 5..44


def _state(cache: torch.Tensor) -> RestoreState:
    tokens = block_positions([(BLOCKS, BASE, BASE + TOKENS)], BLOCK, BLOCK)
    return RestoreState(BASE, TOKENS, [None], PagedLayout.blocked(cache), tokens)


def _slots(start: int) -> list[int]:
    return [BLOCKS[p // BLOCK] * BLOCK + p % BLOCK for p in range(BASE + start, BASE + TOKENS)]


def test_kv_rows_land_in_the_slots_of_their_positions_from_the_row_a_layer_starts_at():
    cache = torch.zeros(8, BLOCK, 2, HEADS, HEAD)
    state = _state(cache)
    rows = torch.randn(TOKENS - 9, 2, HEADS, HEAD)
    parts = [rows[:20], quantise(rows[20:], torch.int8)]  # a lossless chunk, then an 8-bit one
    state.write_kv(cache, parts, 9)
    flat = cache.view(-1, 2, HEADS, HEAD)
    assert torch.equal(flat[_slots(9)][:20], rows[:20])
    assert torch.allclose(flat[_slots(9)][20:], rows[20:], atol=0.02)
    untouched = np.setdiff1d(np.arange(len(flat)), _slots(9))
    assert not flat[untouched].any()
    assert state.places(9) is state.places(9)  # found once a start


def test_projected_rows_and_a_slot_copy_land_in_the_same_slots():
    cache = torch.zeros(8, BLOCK, 2, HEADS, HEAD)
    state = _state(cache)
    k, v = torch.randn(TOKENS - 3, HEADS, HEAD), torch.randn(TOKENS - 3, HEADS, HEAD)
    state.write_projected(0, cache, k, v, 3)  # no RoPE: K lands as it is
    flat = cache.view(-1, 2, HEADS, HEAD)
    assert torch.equal(flat[_slots(3), 0], k) and torch.equal(flat[_slots(3), 1], v)
    other = torch.zeros_like(cache)
    held = torch.arange(7 * BLOCK, 7 * BLOCK + 10)  # a held block's first rows
    other.view(-1, 2, HEADS, HEAD)[held] = torch.randn(10, 2, HEADS, HEAD)
    state.copy_from_slots([other], held)
    assert torch.equal(other.view(-1, 2, HEADS, HEAD)[_slots(0)[:10]], other.view(-1, 2, HEADS, HEAD)[held])
