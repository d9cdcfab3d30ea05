"""Where a sequence's positions are in a paged cache: one rule (:func:`~hcache.ops.paged_kv.block_slots`)
for vLLM's kernel blocks, a step's requests and FastGen's flat slots."""

import torch

from hcache.ops.paged_kv import block_slots, flat_slots


def test_block_slots_follow_the_block_table_into_kernel_blocks():
    """vLLM's 128-token blocks held as 32-token kernel blocks: position 200 of a request holding blocks
    [7, 3] is in its second block (3), at 72, so in kernel block 3 x 4 + 2, at 8."""
    blocks, offsets = block_slots([([7, 3], 126, 202)], 128, 32)
    assert (blocks[0].item(), offsets[0].item()) == (7 * 4 + 3, 30)
    assert (blocks[-2].item(), offsets[-2].item()) == (3 * 4 + 2, 8)
    assert len(blocks) == 76


def test_block_slots_of_a_steps_requests_follow_each_ones_own_table():
    """A decode step's requests (one token each, at positions of their own) and a prefill's, in one call:
    each position found in its own request's blocks, in the requests' order."""
    spans = [([5], 9, 10), ([7, 3], 130, 131), ([2, 4], 120, 136), ([6], 0, 0)]
    blocks, offsets = block_slots(spans, 128, 32)
    one_by_one = [block_slots([span], 128, 32) for span in spans]
    assert torch.equal(blocks, torch.cat([b for b, _ in one_by_one])) and torch.equal(
        offsets, torch.cat([o for _, o in one_by_one])
    )
    assert [(b, o) for b, o in zip(blocks[:2].tolist(), offsets[:2].tolist())] == [(5 * 4, 9), (3 * 4, 2)]
    assert (blocks[2].item(), offsets[2].item(), blocks[-1].item(), offsets[-1].item()) == (2 * 4 + 3, 24, 4 * 4, 7)
    assert len(blocks) == 1 + 1 + 16


def test_flat_slots_are_the_blocks_slots_in_one_block_size():
    """FastGen's and the reference engine's slots, block * block_size + offset, from the same rule: rows
    14..20 of a sequence holding blocks [4, 9] of 16 tokens run from block 4's row 14 into block 9."""
    slots = flat_slots([4, 9], 14, 20, 16, "cpu")
    assert slots.tolist() == [4 * 16 + 14, 4 * 16 + 15, 9 * 16, 9 * 16 + 1, 9 * 16 + 2, 9 * 16 + 3]
    assert slots.dtype == torch.int64
