"""Crash safety and concurrency of the store.

The crash test forks a writer (several threads, as sessions) and SIGKILLs it at random moments, many
times. After each kill the store must open, every chunk it lists must verify and be the one written, and
every chunk the writer reported complete (after ``put`` returned) must still be there.
"""
import os
import random
import signal
import threading
import time

from storage_chunks import check_file, check_served, chunk, chunk_bytes

from hcache.storage.chunk import ChunkInvalid
from hcache.storage.disk_store import DiskChunkStore
from hcache.storage.dram_tier import DramTier

KILLS = 25
SESSIONS = 4
POOL = 120  # chunk ids the writer cycles through, so later rounds also overwrite published chunks


def _writer(dirs, data: dict[int, tuple[str, bytes]], start: int, report_fd: int) -> None:
    """The child: never returns (os._exit), whatever happens."""
    try:
        store = DiskChunkStore(dirs)
        lock = threading.Lock()

        def session(s: int) -> None:
            for n in range(start + s, start + 10_000, SESSIONS):
                i = n % POOL
                store.put(*data[i])
                with lock:
                    os.write(report_fd, f"{i}\n".encode())

        threads = [threading.Thread(target=session, args=(s,)) for s in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os._exit(0)


def test_store_survives_sigkill_at_random_moments(tmp_path):
    dirs = [tmp_path / "ssd0", tmp_path / "ssd1"]
    data = {i: chunk_bytes(i, width=512) for i in range(POOL)}  # ~260 KiB chunks: kills land mid-write
    key_of = {key: i for i, (key, _) in data.items()}
    rng = random.Random()
    complete: set[int] = set()
    for round_ in range(KILLS):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _writer(dirs, data, round_ * 37, write_fd)
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
        assert {data[i][0] for i in complete} <= listed
        for key in listed:
            check_served(store, key, chunk(key_of[key], width=512))
    assert len(complete) >= POOL // 2  # the writer made real progress between kills


def test_many_sessions_saving_and_restoring_at_once(tmp_path):
    """Writers and readers race over a store with a quota that forces eviction and a DRAM tier. Every
    chunk served must verify; the quota must hold throughout; nothing may deadlock."""
    data = {i: chunk_bytes(i) for i in range(40)}
    size = max(len(b) for _, b in data.values())
    disk = DiskChunkStore([tmp_path / "a", tmp_path / "b"], quota_bytes=10 * size, fsync=False)
    store = DramTier(disk, capacity_bytes=3 * size)
    errors, served, over_quota = [], [0], []
    stop = threading.Event()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                store.put(*data[rng.randrange(40)])
            except OSError:  # every chunk pinned by readers: the saver would skip this one
                pass
            if disk.used_bytes > disk.quota_bytes:
                over_quota.append(disk.used_bytes)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(40)
            f = store.open(data[i][0])
            if f is None:  # absent or evicted is fine; wrong bytes are not
                continue
            with f:
                try:
                    check_file(f, data[i][0], chunk(i))
                    served[0] += 1
                except (ChunkInvalid, AssertionError) as exc:
                    errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    threads += [threading.Thread(target=reader, args=(100 + s,)) for s in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors and not over_quota
    assert served[0] > 50 and disk.evictions > 0
    on_disk = {p.name.split(".")[0] for p in tmp_path.rglob("*.safetensors")}
    assert on_disk == set(disk.keys())  # the index and the directories agree
    reopened = DiskChunkStore([tmp_path / "a", tmp_path / "b"], quota_bytes=10 * size, verify="full")
    assert reopened.dropped_at_start == 0 and set(reopened.keys()) == set(disk.keys())
