"""Crash safety and concurrency of the store.

The crash test forks a writer (several threads, as sessions, saving through the host tier, whose
write-back threads write the disk) and SIGKILLs it at random moments, many times. After each kill the
store must open, every chunk it lists must verify and be the one written, and every chunk the writer
reported written back must still be there.
"""

import os
import random
import signal
import threading
import time

import pytest
import torch
from support.storage_chunks import check_image, check_served, chunk, chunk_bytes, publish

from hcache.storage.chunk import ChunkInvalid
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.host_tier import HostPoolFull, HostTier
from hcache.storage.host_pool import HostPool

KILLS = 25
SESSIONS = 4
POOL = 120  # chunk ids a writer may save in one round


def _writer(dirs, start: int, report_fd: int) -> None:
    """The child: never returns (os._exit), whatever happens."""
    try:
        torch.set_num_threads(1)  # the parent's OpenMP pool did not survive the fork
        size = len(chunk_bytes(0, width=512)[1])
        tier = HostTier([DiskChunkStore(dirs)], HostPool(3 * SESSIONS * size))
        lock = threading.Lock()

        def session(s: int) -> None:
            for i in range(start + s, start + POOL, SESSIONS):  # new chunks each round: each is written
                publish(tier, chunk(i, width=512))
                tier.flush()  # written back
                with lock:
                    os.write(report_fd, f"{i}\n".encode())

        threads = [threading.Thread(target=session, args=(s,)) for s in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os._exit(0)


@pytest.mark.slow  # forks and kills a writer round after round: 26 s, the quick check's longest
def test_store_survives_sigkill_at_random_moments(tmp_path):
    dirs = [tmp_path / "ssd0", tmp_path / "ssd1"]
    key_of = {chunk(i, width=512).key: i for i in range(KILLS * POOL)}  # ~260 KiB chunks: kills land mid-write
    rng = random.Random()
    complete: set[int] = set()
    for round_ in range(KILLS):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _writer(dirs, round_ * POOL, write_fd)
        os.close(write_fd)
        time.sleep(rng.uniform(0.02, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(read_fd) as pipe:
            reported = pipe.read().split("\n")
        complete |= {int(line) for line in reported[:-1]}  # the last line may be cut mid-write

        store = DiskChunkStore(dirs, verify="full")
        assert store.dropped_at_start == 0  # nothing torn was ever published
        assert not [p for d in dirs for p in d.rglob("*.tmp")]
        listed = set(store.keys())
        assert {chunk(i, width=512).key for i in complete} <= listed
        for key in listed:
            check_served(store, key, chunk(key_of[key], width=512))
        store.close()  # the next writer is another process: it may open the directories only now
    assert len(complete) >= POOL // 2  # the writers made real progress between kills


def test_many_sessions_saving_and_restoring_at_once(tmp_path):
    """Savers and restores race over a host tier too small for the working set, in front of a disk quota that
    forces eviction. Every chunk served must be the one saved; the quotas must hold; nothing may deadlock."""
    size = max(len(chunk_bytes(i)[1]) for i in range(40))
    disk = DiskChunkStore([tmp_path / "a", tmp_path / "b"], quota_bytes=10 * size, fsync=False)
    tier = HostTier([disk], HostPool(6 * (size + 4096)), readers=2)
    errors, served, over_quota = [], [0], []
    stop = threading.Event()

    def saver(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            c = chunk(rng.randrange(40))
            if not tier.contains(c.key):
                try:
                    publish(tier, c)
                except AssertionError:  # no room: the saver would skip this chunk
                    pass
            if disk.used_bytes > disk.quota_bytes or tier.pool.used_bytes > tier.pool.capacity:
                over_quota.append(disk.used_bytes)

    def restore(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(40)
            try:
                image = tier.fetch(chunk(i).key).result()
            except HostPoolFull:  # every slot held by the others: this load ends here, as a restore's prefix would
                continue
            except (ChunkInvalid, OSError) as exc:
                errors.append(exc)
                continue
            if image is None:  # absent or evicted: fine; wrong bytes are not
                continue
            try:
                check_image(image, chunk(i))
                served[0] += 1
            except AssertionError as exc:
                errors.append(exc)
            finally:
                tier.release(image)

    threads = [threading.Thread(target=saver, args=(s,)) for s in range(4)]
    threads += [threading.Thread(target=restore, args=(100 + s,)) for s in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "deadlock"
    tier.close()
    assert not errors and not over_quota
    assert served[0] > 50 and disk.evictions > 0 and tier.evictions > 0 and tier.bytes_loaded > 0
    on_disk = {p.name.split(".")[0] for p in tmp_path.rglob("*.safetensors")}
    assert on_disk == set(disk.keys())  # the index and the directories agree
    reopened = DiskChunkStore([tmp_path / "a", tmp_path / "b"], quota_bytes=10 * size, verify="full")
    assert reopened.dropped_at_start == 0 and set(reopened.keys()) == set(disk.keys())


def test_forked_children_load_their_own_stores_while_the_parent_loads_its(tmp_path):
    """No buffer is shared across a fork: children loading chunks into their own pools, while the parent
    loads the same keys into its pool, see no false checksum failure and delete nothing."""
    chunks = [chunk(i, width=512) for i in range(6)]
    expected = {c.key: {name: t.numpy().tobytes() for name, t in c.tensors.items()} for c in chunks}
    size = len(chunk_bytes(0, width=512)[1]) + 4096
    for d in ("parent", "child0", "child1", "child2"):
        disk = DiskChunkStore(tmp_path / d)
        for c in chunks:
            disk.put(c.key, chunk_bytes(chunks.index(c), width=512)[1])
        disk.close()

    def load_all(tier) -> bool:
        """Every chunk from disk into the pool, byte for byte (no torch kernels: they do not survive a fork)."""
        tier.drop_resident()
        for c in chunks:
            image = tier.fetch(c.key).result()
            same = all(image.tensor(*name).numpy().tobytes() == data for name, data in expected[c.key].items())
            tier.release(image)
            if not same:
                return False
        return True

    parent = HostTier([DiskChunkStore(tmp_path / "parent")], HostPool(3 * size), readers=2)
    assert load_all(parent)
    children = []
    for i in range(3):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                tier = HostTier([DiskChunkStore(tmp_path / f"child{i}")], HostPool(3 * size), readers=0)
                ok = all(load_all(tier) for _ in range(5)) and len(tier.stores[0].keys()) == len(chunks)
                os.write(write_fd, b"ok" if ok else b"no")
            finally:
                os._exit(0)
        os.close(write_fd)
        children.append((pid, read_fd))
    assert all(load_all(parent) for _ in range(5))
    for pid, read_fd in children:
        os.waitpid(pid, 0)
        assert os.read(read_fd, 2) == b"ok"
        os.close(read_fd)
    for d in ("parent", "child0", "child1", "child2"):
        assert len(list((tmp_path / d / "chunks").glob("*/*.safetensors"))) == len(chunks), d
    parent.close()
