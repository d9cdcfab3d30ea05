"""The host pool (hcache/storage/host_pool.py): one arena, page-aligned slots, refcounts, reuse."""

import mmap
import os
import re

import pytest
import torch

from hcache.storage.host_pool import PAGE, HostPool


def test_slots_are_page_aligned_extents_that_coalesce_when_freed():
    pool = HostPool(10 * PAGE + 100)
    assert pool.capacity == 10 * PAGE and pool.arena.data_ptr() % PAGE == 0
    a, b, c = pool.alloc(1), pool.alloc(3 * PAGE - 5), pool.alloc(2 * PAGE)
    assert [(s.start, s.nbytes) for s in (a, b, c)] == [(0, PAGE), (PAGE, 3 * PAGE), (4 * PAGE, 2 * PAGE)]
    assert len({a.index, b.index, c.index}) == 3 and pool.used_bytes == 6 * PAGE
    assert pool.alloc(5 * PAGE) is None  # 4 pages left
    for s in (a, b):
        pool.unref(s)
        pool.free(s)
    assert pool.free_extents == 2  # [0, 4) and [6, 10): a and b merged
    d = pool.alloc(4 * PAGE)
    assert d.start == 0 and d.index in (a.index, b.index)  # the space and a table entry are reused
    pool.unref(c)
    pool.free(c)
    pool.unref(d)
    pool.free(d)
    assert pool.free_extents == 1 and pool.used_bytes == 0 and pool.live_slots == 0
    assert pool.alloc(10 * PAGE).start == 0  # whole again


def test_a_referenced_slot_is_never_freed_and_views_are_the_arena():
    pool = HostPool(4 * PAGE)
    slot = pool.alloc(PAGE)
    pool.ref(slot)
    assert pool.unref(slot) == 1
    with pytest.raises(RuntimeError, match="referenced"):
        pool.free(slot)
    pool.view(slot).fill_(7)
    assert bytes(pool.buffer(slot)[:3]) == b"\x07\x07\x07" and int(pool.arena[slot.start]) == 7
    with pytest.raises(ValueError, match="outside"):
        pool.view(slot, PAGE - 1, 2)
    pool.unref(slot)
    pool.free(slot)
    with pytest.raises(RuntimeError):
        pool.free(slot)  # twice
    with pytest.raises(RuntimeError, match="freed"):
        pool.ref(slot)
    with pytest.raises(ValueError, match="at least one page"):
        HostPool(PAGE - 1)


def test_views_of_one_slot_never_touch_another():
    pool = HostPool(8 * PAGE)
    slots = [pool.alloc(2 * PAGE) for _ in range(4)]
    for i, s in enumerate(slots):
        pool.view(s).view(torch.int32).fill_(i)
    for i, s in enumerate(slots):
        assert torch.all(pool.view(s).view(torch.int32) == i)


def test_pools_larger_than_memory_cost_nothing_until_used_and_the_process_can_still_fork():
    """A process holding several default-sized pools (one per runtime) must still fork: the arena is not
    charged against the commit limit until its pages are touched, and a child gets a private copy."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    pools = [HostPool(memory) for _ in range(2)]
    slot = pools[0].alloc(PAGE)
    pools[0].buffer(slot)[:5] = b"hello"
    pid = os.fork()
    if pid == 0:
        pools[0].buffer(slot)[:5] = b"child"  # the child's copy only
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert bytes(pools[0].buffer(slot)[:5]) == b"hello"


def test_a_pinned_pool_is_registered_mapped_for_every_context_and_not_inherited_by_a_fork(monkeypatch):
    """cudaHostRegisterPortable | cudaHostRegisterMapped (flags 1 | 2): pinned in every CUDA context, not
    only the one current at open, and mapped for the GPU's kernels (a restore's gather reads slots in place);
    MADV_DONTFORK: a forked child neither shares nor copies-on-write the pinned pages (the kernel's "dc"
    flag on the mapping). cudart is faked, so this runs without a GPU."""
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append((ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    pool = HostPool(4 * PAGE, pin=True)
    assert calls == [(pool.arena.data_ptr(), 4 * PAGE, 1 | 2)]
    assert "dc" in _vm_flags(pool.arena.data_ptr())


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                mapping = int(head[1], 16) <= address < int(head[2], 16)
            elif mapping and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_shareable_pool_is_memory_another_mapping_reads_and_writes():
    pool = HostPool(4 * PAGE, shareable=True)
    other = torch.frombuffer(
        mmap.mmap(pool.fd, pool.capacity, flags=mmap.MAP_SHARED), dtype=torch.uint8
    )  # as the load process maps it
    slot = pool.alloc(100)
    pool.view(slot)[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert other[slot.start : slot.start + 3].tolist() == [1, 2, 3]
    other[slot.start + 5] = 7
    assert pool.view(slot)[5] == 7
    assert HostPool(PAGE).fd is None
