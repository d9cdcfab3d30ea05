"""Moving tensors onto memory another process maps (hcache/paged/copy_process.py): in place, their
contents and their aliases kept, a piece at a time, the old pages handed back."""

import os

import torch

from hcache.paged import copy_process
from hcache.paged.copy_process import _tensors, share


def test_shared_tensors_keep_their_contents_and_aliases_and_another_mapping_reads_and_writes_them():
    base = torch.arange(64, dtype=torch.float32)
    a, b = base.view(8, 8), base[8:16]  # one storage
    c = torch.arange(10).to(torch.bfloat16)
    storages, views = share([a, b, c])
    try:
        assert (
            len(storages) == 2
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
        )
        assert torch.equal(a.flatten(), torch.arange(64.0)) and torch.equal(b, torch.arange(8.0, 16.0))
        assert torch.equal(c, torch.arange(10).to(torch.bfloat16)) and c.dtype == torch.bfloat16
        a[1, 0] = -1
        assert b[0] == -1  # still one storage
        other = _tensors(storages, views)  # as the load process maps them
        assert [t.shape for t in other] == [a.shape, b.shape, c.shape] and other[1][0] == -1
        other[2][3] = 99
        other[0][7, 7] = -2
        assert c[3] == 99 and a[7, 7] == -2
    finally:
        for fd, _ in storages:
            os.close(fd)


def test_a_storage_moves_a_piece_at_a_time_and_hands_back_its_old_pages(monkeypatch):
    """Pieces that end inside a page: every byte copied, and the old storage's whole pages handed back as
    they are (a tensor left on it reads zeros there), so the move holds about one piece twice, not the
    cache."""
    monkeypatch.setattr(copy_process, "MOVE_BYTES", (256 << 10) + 4)
    cache = torch.randn((1 << 20) // 4 + 25)  # 1 MiB and 100 bytes: four pieces and a bit
    expected, left = cache.clone(), cache.view(-1)  # ``left`` is not moved: it keeps the old storage
    storages, _ = share([cache])
    try:
        assert torch.equal(cache, expected) and cache.untyped_storage().data_ptr() != left.untyped_storage().data_ptr()
        page = os.sysconf("SC_PAGE_SIZE") // 4
        first = -(-left.data_ptr() // 4 // page) * page - left.data_ptr() // 4  # the first element of a whole page
        assert not left[first : first + 4 * page].any()  # handed back: fresh zero pages
    finally:
        for fd, _ in storages:
            os.close(fd)
