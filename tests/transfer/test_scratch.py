"""The CPU's staging buffers (hcache/transfer/scratch.py): a job's tensors apart from one another, a slot's
buffer reused only ``slots`` jobs later (or after a rewind), grown where a job needs more, its views made once."""

import torch

from hcache.transfer.scratch import Scratch


def _job(scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    scratch.next_job()
    return scratch.empty((5, 3), torch.float32), scratch.empty((7,), torch.bfloat16)


def test_a_jobs_tensors_do_not_overlap_and_a_slot_comes_back_after_every_other():
    scratch = Scratch(2)
    a, b = _job(scratch)
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.all(a == 1.0) and torch.all(b == 2.0), "one job's tensors overlap"
    c, _ = _job(scratch)
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr(), "the next job took the slot still in use"
    kept, _ = _job(scratch)  # the first slot again, grown to the first job's size by now
    _job(scratch)
    again, _ = _job(scratch)
    assert again is kept, "the first slot's view is made anew, or its buffer not reused"
    _job(scratch)
    scratch.rewind()  # a pipeline's end: the next job starts at the first slot
    assert _job(scratch)[0] is kept


def test_a_slot_grows_and_what_its_job_took_before_stays_intact():
    scratch = Scratch(1)
    scratch.next_job()
    small = scratch.empty((4,), torch.float32)
    small.fill_(3.0)
    big = scratch.empty((1 << 16,), torch.float32)  # more than the slot holds: a new buffer
    big.fill_(4.0)
    assert torch.all(small == 3.0) and big.data_ptr() % 64 == 0
    scratch.next_job()
    assert scratch.empty((4,), torch.float32).untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
