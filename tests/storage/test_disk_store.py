"""The disk store: placement over directories, O_DIRECT and its fallback, start-up rebuild, quota, LRU,
TTL, pins, and write faults."""

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from support.damage import rewrite_header
from support.storage_chunks import ROOT, Chunk, check_served, chunk, chunk_bytes, read_back

from hcache.errors import StorageError
from hcache.storage import direct_io
from hcache.storage.chunk import encode
from hcache.storage.chunk_file import OtherVersionStored
from hcache.storage.chunk_key import LAYOUT_VERSION, next_key
from hcache.storage.chunk_store import Loss
from hcache.storage.disk_store import DiskChunkStore, StoreFull


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _dirs(tmp_path, n=2):
    return [tmp_path / f"ssd{i}" for i in range(n)]


def _while_read(store, key, fn):
    """Run ``fn`` while ``key`` is being read (pinned), then abandon the read."""
    store.read_into(key, lambda size: fn())


def test_chunks_are_spread_round_robin_and_survive_a_restart(tmp_path):
    dirs = _dirs(tmp_path, 3)
    store = DiskChunkStore(dirs)
    chunks = [chunk(i) for i in range(6)]
    for i in range(6):
        store.put(*chunk_bytes(i))
    per_dir = [len(list((d / "chunks").glob("*/*.safetensors"))) for d in dirs]
    assert per_dir == [2, 2, 2]
    reopened = DiskChunkStore(dirs)
    assert reopened.keys() == sorted(c.key for c in chunks)
    assert reopened.used_bytes == store.used_bytes == sum(len(chunk_bytes(i)[1]) for i in range(6))
    for c in chunks:
        check_served(reopened, c.key, c)


def test_whole_chunk_reads_and_writes_match_with_and_without_o_direct(tmp_path):
    key, data = chunk_bytes(0, width=300)  # a length that is not a multiple of the block
    for direct in (True, False):
        store = DiskChunkStore(tmp_path / str(direct), direct_io=direct)
        store.put(key, data)  # from an unaligned buffer: through an aligned copy
        assert read_back(store, key) == data
        store.put(key, memoryview(bytearray(data)), len(data))  # a replacement, from a buffer with spare room
        assert read_back(store, key) == data and store.keys() == [key]
        assert store.path(key).stat().st_mode & 0o777 == 0o600
    assert DiskChunkStore(tmp_path / "True").direct == [direct_io.supports_direct(tmp_path)]


def test_buffered_fallback_where_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    store = DiskChunkStore(tmp_path)
    assert store.direct == [False]
    c = chunk(1)
    store.put(*chunk_bytes(1))
    check_served(store, c.key, c)


def test_start_up_drops_temporary_torn_and_foreign_files(tmp_path):
    store = DiskChunkStore(tmp_path)
    good, torn, flipped = chunk(0), chunk(1), chunk(2)
    for i in range(3):
        store.put(*chunk_bytes(i))
    p = store.path(torn.key)
    p.write_bytes(p.read_bytes()[:-100])  # a file cut short (e.g. copied in by hand)
    p = store.path(flipped.key)
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    tmp = store.path(good.key).with_name(f".{good.key}.dead.tmp")
    tmp.write_bytes(b"half a chunk")
    store.close()  # the next opener is the only one: a temporary file left is a write that never finished
    assert DiskChunkStore(tmp_path).keys() == sorted([good.key, flipped.key])  # header check: length ok
    assert not tmp.exists()
    full = DiskChunkStore(tmp_path, verify="full")
    assert full.keys() == [good.key] and full.dropped_at_start == 1
    check_served(full, good.key, good)


def test_lru_eviction_order_respects_quota_and_pins(tmp_path, caplog):
    size = len(chunk_bytes(0)[1])
    clock = Clock()
    store = DiskChunkStore(_dirs(tmp_path), quota_bytes=3 * size, clock=clock)
    keys = [chunk(i).key for i in range(5)]
    for i in range(3):
        clock.now += 1
        store.put(*chunk_bytes(i))
    clock.now += 1
    read_back(store, keys[0])  # 0 is now the most recently used: 1 goes first
    store.put(*chunk_bytes(3))
    assert set(store.keys()) == {keys[0], keys[2], keys[3]} and store.evictions == 1
    assert not store.path(keys[1], 0).exists() and not store.path(keys[1], 1).exists()

    def during_the_read_of_2():  # 2 is pinned, then made the least recently used
        for k in (keys[0], keys[3]):
            clock.now += 1
            read_back(store, k)
        store.put(*chunk_bytes(4))  # 2 is skipped: 0 goes
        assert set(store.keys()) == {keys[2], keys[3], keys[4]}

    _while_read(store, keys[2], during_the_read_of_2)
    check_served(store, keys[2], chunk(2))
    assert store.used_bytes <= 3 * size
    # The order survives a restart (rebuilt from file times): the oldest file goes first. Closing sets the
    # times of the uses noted (a thread of the store's sets them), which would otherwise race the utime.
    store.close()
    os.utime(store.path(keys[3]), (1, 1))
    with caplog.at_level("WARNING", logger="hcache.storage.disk_store"):
        reopened = DiskChunkStore(_dirs(tmp_path), quota_bytes=2 * size)
    assert set(reopened.keys()) == {keys[2], keys[4]}
    # A quota below what the directories hold evicts at once, and says what it evicted (issue 34, part 5).
    assert (
        f"holds more than its quota of {2 * size} bytes: evicting its 1 least recently used chunks ({size} bytes)"
        in caplog.text
    )


def _linked(c: Chunk, parent: Chunk | None) -> Chunk:
    """``c`` as the chunk after ``parent`` in a chain (the first of one without)."""
    key = next_key(parent.key if parent else ROOT, c.tokens)
    return Chunk(key, c.tokens, c.fingerprint, c.tensors, parent.key if parent else "")


def _conversations(store, clock: Clock, order: list[int]) -> list[list[Chunk]]:
    """Six conversations of three chunks, the first shared (a system prompt), saved at once; then replayed
    (looked up whole, as a restore does) five seconds apart in ``order``: the last the most recent."""
    system = _linked(chunk(0), None)
    convs = []
    for i in range(6):
        first = _linked(chunk(10 + i), system)
        convs.append([system, first, _linked(chunk(20 + i), first)])
    for c in [system] + [c for conv in convs for c in conv[1:]]:
        store.put(c.key, encode(c), parent=c.parent)
    for i in order:
        clock.now += 5
        assert store.contains_many([c.key for c in convs[i]]) == [True] * 3
    return convs


@pytest.mark.parametrize("restart", ["closed", "crashed"])
@pytest.mark.parametrize("later", [0.0, 86400.0], ids=["within-its-first-minute", "a-day-later"])
def test_a_reopen_under_a_quota_keeps_the_shared_first_chunk_and_the_hottest_chains(tmp_path, later, restart):
    """Issue 42: the order is rebuilt from file times, which every use sets (at most once a second, on the
    store's own thread), and a chunk goes only after the chunks after it in its chain."""
    clock = Clock()
    store = DiskChunkStore(tmp_path, clock=clock)
    convs = _conversations(store, clock, order=[0, 2, 3, 5, 4, 1])  # half a minute: 1 then 4 the most recent
    newest = store.path(convs[1][2].key)
    if restart == "closed":
        store.close()
    else:  # left without closing: the file times the stamper set by now are all a restart finds
        deadline = time.monotonic() + 10
        while newest.stat().st_mtime != clock.now and time.monotonic() < deadline:
            time.sleep(0.01)
    clock.now += later
    size = len(encode(convs[0][0]))
    reopened = DiskChunkStore(tmp_path, quota_bytes=5 * size, clock=clock)
    assert set(reopened.keys()) == {convs[0][0].key} | {c.key for i in (1, 4) for c in convs[i][1:]}
    replays = [sum(reopened.contains_many([c.key for c in conv])) for conv in convs]
    assert replays == [1, 3, 1, 1, 3, 1]  # the two hottest whole, every other one its shared start
    assert reopened.gone(convs[0][2].key) == Loss.EVICTED and reopened.gone("ab" * 16) is None


@pytest.mark.parametrize("links", ["cycle", "pairs", "self", "missing"])
def test_headers_rewritten_into_cycles_cannot_pin_the_store(tmp_path, links):
    """Issue 67: chunk headers on disk whose parents form cycles (damaged or hostile) held every chunk of
    them against the quota, so the disk stayed over it and every later save was refused. On open the store
    is back under its quota, and saves go on. ``missing``: every header names a chunk the store lacks, which
    is saved later naming one of them: trusting both links would close a cycle."""
    chunks = [_linked(chunk(i), None) for i in range(8)]
    missing = chunk(20)
    store = DiskChunkStore(tmp_path)
    for c in chunks:
        store.put(c.key, encode(c))
    store.close()
    keys = [c.key for c in chunks]
    parents = {
        "cycle": keys[1:] + keys[:1],  # each names the next, the last the first
        "pairs": [keys[i ^ 1] for i in range(8)],  # two by two, each names the other
        "self": keys,
        "missing": [missing.key] * 8,
    }[links]
    for key, parent in zip(keys, parents):
        rewrite_header(store.path(key), lambda header, parent=parent: header["__metadata__"].update(parent=parent))
    size = store.path(keys[0]).stat().st_size
    reopened = DiskChunkStore(tmp_path, quota_bytes=2 * size)
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("chunks/*/*.safetensors"))
    assert reopened.used_bytes == on_disk <= 2 * size and len(reopened.keys()) == 2
    if links == "missing":
        reopened.put(missing.key, encode(missing), parent=reopened.keys()[0])
    for i in range(8, 12):
        reopened.put(*chunk_bytes(i))
        check_served(reopened, chunk(i).key, chunk(i))
    assert reopened.used_bytes <= 2 * size and reopened.write_errors == 0


def test_a_quota_held_by_pinned_chunks_refuses_with_enospc(tmp_path):
    size = len(chunk_bytes(0)[1])
    store = DiskChunkStore(tmp_path, quota_bytes=size + 10)
    store.put(*chunk_bytes(0))

    def refused():
        with pytest.raises(StoreFull) as info:
            store.put(*chunk_bytes(1))
        assert info.value.errno == errno.ENOSPC

    _while_read(store, chunk(0).key, refused)
    store.put(*chunk_bytes(1))
    assert store.keys() == [chunk(1).key]
    with pytest.raises(StorageError, match="exceeds the store's whole quota"):
        DiskChunkStore(tmp_path / "tiny", quota_bytes=100).put(*chunk_bytes(0))


def test_ttl_expires_unused_chunks(tmp_path):
    clock = Clock()
    store = DiskChunkStore(tmp_path, ttl_s=60, clock=clock)
    store.put(*chunk_bytes(0))
    store.put(*chunk_bytes(1))
    clock.now += 50
    assert store.contains(chunk(0).key)  # a use renews it
    clock.now += 20
    assert read_back(store, chunk(1).key) is None and not store.path(chunk(1).key, 0).exists()
    assert store.contains(chunk(0).key)
    clock.now += 61
    store.put(*chunk_bytes(2))  # a put sweeps expired chunks too
    assert store.keys() == [chunk(2).key]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_fault_publishes_nothing_and_leaves_no_temporary(tmp_path, monkeypatch, code):
    store = DiskChunkStore(tmp_path, quota_bytes=10 << 20)
    store.put(*chunk_bytes(0))
    real_write = direct_io._write_all

    def failing(fd, view):
        real_write(fd, view[: len(view) // 2])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(direct_io, "_write_all", failing)
    with pytest.raises(OSError) as info:
        store.put(*chunk_bytes(1))
    assert info.value.errno == code
    assert store.keys() == [chunk(0).key] and store.write_errors == 1
    assert store.used_bytes == len(chunk_bytes(0)[1])
    assert not list(tmp_path.rglob("*.tmp")) and not store.path(chunk(1).key, 0).exists()
    monkeypatch.undo()
    store.put(*chunk_bytes(1))
    check_served(store, chunk(1).key, chunk(1))


def test_a_chunk_published_by_another_store_object_is_found(tmp_path):
    a, b = DiskChunkStore(_dirs(tmp_path)), DiskChunkStore(_dirs(tmp_path))
    for i in range(2):
        a.put(*chunk_bytes(i))
    for i in range(2):
        check_served(b, chunk(i).key, chunk(i))


def test_a_chunk_another_store_object_replaced_at_another_length_is_read_whole(tmp_path):
    """Issue 67: a file whose length changed since it was indexed, with a header that describes it, is read
    at its new length for its reader to verify, as any read is: another store object's replacement (the
    chunk saved again with more formats) is served, not forgotten as evicted; damage fails verification."""
    a, b = DiskChunkStore(tmp_path), DiskChunkStore(tmp_path)
    short, full = chunk(0, layers=1), chunk(0, layers=3)  # the same key, tokens and first layer
    a.put(short.key, encode(short))
    assert b.contains(short.key)  # indexed at the short chunk's length
    a.put(full.key, encode(full))
    check_served(b, full.key, full)
    assert b.used_bytes == len(encode(full)) and b.gone(full.key) is None


def test_a_chunk_file_of_another_layout_version_is_never_replaced_by_a_save(tmp_path):
    """Issue 67: another hcache's file under a key this store saves (met at start-up, left alone) is not
    overwritten: the put is refused and the file stays as it was."""
    key, data = chunk_bytes(0)
    store = DiskChunkStore(tmp_path)
    store.put(key, data)
    store.close()
    old, new = f'"layout_version":"{LAYOUT_VERSION}"'.encode(), f'"layout_version":"{LAYOUT_VERSION + 1}"'.encode()
    theirs = data.replace(old, new)
    store.path(key).write_bytes(theirs)
    reopened = DiskChunkStore(tmp_path)
    assert reopened.other_version_at_start == 1 and reopened.keys() == []
    with pytest.raises(OtherVersionStored, match="left alone"):
        reopened.put(key, data)
    assert store.path(key).read_bytes() == theirs and reopened.keys() == [] and reopened.used_bytes == 0


def test_manifest_records_labels_and_bad_options_are_clear_errors(tmp_path):
    DiskChunkStore(tmp_path / "s", labels={"fingerprint": "fp1", "dtype": "float32"})
    DiskChunkStore(tmp_path / "s", labels={"fingerprint": "fp2", "dtype": "bfloat16"})
    manifest = json.loads((tmp_path / "s" / "hcache-store.json").read_text())
    assert manifest["layout_version"] == LAYOUT_VERSION
    assert [p["fingerprint"] for p in manifest["producers"]] == ["fp1", "fp2"]
    with pytest.raises(StorageError, match="at least one directory"):
        DiskChunkStore([])
    with pytest.raises(StorageError, match="listed twice"):
        DiskChunkStore([tmp_path / "x", tmp_path / "x"])
    with pytest.raises(StorageError, match="quota_bytes must be positive"):
        DiskChunkStore(tmp_path / "q", quota_bytes=0)
    with pytest.raises(StorageError, match="ttl_s"):
        DiskChunkStore(tmp_path / "q", ttl_s=-1)
    with pytest.raises(StorageError, match="verify"):
        DiskChunkStore(tmp_path / "q", verify="sometimes")


def _open_elsewhere(path) -> subprocess.CompletedProcess:
    code = "import sys; from hcache.storage.disk_store import DiskChunkStore; DiskChunkStore(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)


def test_a_store_closed_as_the_interpreter_exits_records_its_last_uses(tmp_path):
    """A store closed at exit (an engine's shutdown hook), when the stamper's thread takes no more work:
    the close sets the times itself, without a traceback."""
    key, data = chunk_bytes(0)
    (tmp_path / "payload").write_bytes(data)
    code = (
        "import atexit, sys; from pathlib import Path; from hcache.storage.disk_store import DiskChunkStore; "
        "now = [1000.0]; s = DiskChunkStore(sys.argv[1], clock=lambda: now[0]); s.put(sys.argv[2], Path(sys.argv[3]).read_bytes()); "
        "now[0] = 5000.0; s.contains_many([sys.argv[2]]); atexit.register(s.close)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "d"), key, str(tmp_path / "payload")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert DiskChunkStore(tmp_path / "d").path(key).stat().st_mtime == 5000.0


def test_a_shared_directory_serves_chunks_other_processes_publish(tmp_path):
    """Shared mode (one filesystem, several nodes): any number of shared openers, no private one; a chunk
    another process published is found by its path; start-up keeps a young temporary file (another node's
    write in flight) and deletes an abandoned one."""
    store = DiskChunkStore(tmp_path, shared=True)
    key, data = chunk_bytes(0)
    (tmp_path / "payload").write_bytes(data)
    code = (
        "import sys; from pathlib import Path; from hcache.storage.disk_store import DiskChunkStore; "
        "s = DiskChunkStore(sys.argv[1], shared=True); s.put(sys.argv[2], Path(sys.argv[3]).read_bytes())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), key, str(tmp_path / "payload")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == 0, other.stderr
    assert store.contains(key)
    check_served(store, key, chunk(0))
    refused = _open_elsewhere(tmp_path)
    assert refused.returncode != 0 and "open it as shared in every one" in refused.stderr
    with pytest.raises(StorageError, match="open here as shared"):
        DiskChunkStore(tmp_path)
    young, old = (store.path(key).with_name(f".{key}.{n}.tmp") for n in ("young", "old"))
    for tmp in (young, old):
        tmp.write_bytes(b"partial")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    store.close()
    DiskChunkStore(tmp_path, shared=True).close()
    assert young.exists() and not old.exists()


def test_a_second_process_on_a_store_directory_is_refused_until_the_first_closes(tmp_path):
    store = DiskChunkStore(tmp_path)
    again = DiskChunkStore(tmp_path)  # another store object of this process shares the directory
    refused = _open_elsewhere(tmp_path)
    assert refused.returncode != 0 and f"in use by another process (pid {os.getpid()})" in refused.stderr
    store.close()
    assert _open_elsewhere(tmp_path).returncode != 0  # ``again`` still holds it
    again.close()
    assert _open_elsewhere(tmp_path).returncode == 0


def test_check_refuses_what_opening_would_and_opens_nothing(tmp_path):
    """The check a server runs before starting the processes that open its store (issue 25)."""
    store = DiskChunkStore(tmp_path / "held")
    DiskChunkStore.check(tmp_path / "held")  # this process holds it: its engines may open it too
    store.close()
    code = "import sys; from hcache.storage.disk_store import DiskChunkStore; DiskChunkStore.check(sys.argv[1:])"
    elsewhere = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "held")], capture_output=True, text=True, timeout=120
    )
    assert elsewhere.returncode == 0, elsewhere.stderr  # closed: another process may open it
    shared = DiskChunkStore(tmp_path / "held", shared=True)
    with pytest.raises(StorageError, match="open here as shared"):
        DiskChunkStore.check(tmp_path / "held")
    DiskChunkStore.check(tmp_path / "held", shared=True)
    shared.close()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "hcache-store.json").write_text(json.dumps({"layout_version": LAYOUT_VERSION - 1}))
    with pytest.raises(StorageError, match=f"has layout version {LAYOUT_VERSION - 1}"):
        DiskChunkStore.check([tmp_path / "new", tmp_path / "old"])
    DiskChunkStore.check(tmp_path / "new")
    assert not (tmp_path / "new" / "hcache-store.json").exists() and not DiskChunkStore(tmp_path / "new").keys()


def test_a_second_store_object_keeps_the_first_ones_write_in_flight(tmp_path, monkeypatch):
    """The lock is per process, so a second store object's start-up must not sweep the first one's
    temporary files (issue 25)."""
    first = DiskChunkStore(tmp_path)
    writing, go, failed = threading.Event(), threading.Event(), []
    real_write = direct_io._write_all
    monkeypatch.setattr(direct_io, "_write_all", lambda fd, view: (writing.set(), go.wait(10), real_write(fd, view)))

    def put():
        try:
            first.put(*chunk_bytes(0))
        except OSError as exc:
            failed.append(exc)

    thread = threading.Thread(target=put)
    thread.start()
    assert writing.wait(10)
    second = DiskChunkStore(tmp_path)
    go.set()
    thread.join(10)
    assert failed == [] and list(tmp_path.rglob("*.tmp")) == []
    check_served(first, chunk(0).key, chunk(0))
    check_served(second, chunk(0).key, chunk(0))


def test_a_forked_child_does_not_inherit_its_parents_store(tmp_path):
    store = DiskChunkStore(tmp_path / "parent")
    store.put(*chunk_bytes(0))
    key, data = chunk_bytes(1)  # made here: torch's thread pool does not survive a fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own store works, its parent's is refused
        try:
            mine = DiskChunkStore(tmp_path / "child")
            mine.put(key, data)
            ok = read_back(mine, key) == data
            try:
                DiskChunkStore(tmp_path / "parent")
                ok = False
            except StorageError:
                pass
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == b"ok"
    check_served(store, chunk(0).key, chunk(0))  # the parent's lock and data are untouched


def test_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = DiskChunkStore(tmp_path / "s")
        store.put(*chunk_bytes(0))
    finally:
        os.umask(old)
    root = tmp_path / "s"
    for d in (root, root / "chunks", store.path(chunk(0).key).parent):
        assert d.stat().st_mode & 0o777 == 0o700, d
    for f in (root / "hcache-store.json", store.path(chunk(0).key), root / "hcache-store.lock"):
        assert f.stat().st_mode & 0o777 == 0o600, f


def test_chunks_of_a_newer_layout_version_in_a_shared_store_are_never_deleted(tmp_path):
    """A rolling upgrade shares a store: a newer hcache's chunks (another layout version, under keys of its
    own) are left alone by this one at start-up (header or full verification) and while it serves: counted,
    never indexed, evicted or deleted."""
    from support.helpers import loaded, random_prompt

    from hcache.serving.runtime import HCacheRuntime
    from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key

    llama, store = loaded("random:llama"), tmp_path / "store"
    prompt = random_prompt(3 * CHUNK_TOKENS + 10, llama.spec.vocab_size, torch.Generator().manual_seed(0))
    with HCacheRuntime(llama, store, plan="KV") as runtime:
        reference = runtime.generate(prompt, 4, stop_token_ids=set()).output_ids
        keys = chunk_keys(prompt, root_key(runtime.serving.fingerprint))
    [ours] = store.glob(f"chunks/*/{keys[1]}.safetensors")
    theirs = "f" * len(keys[1])  # the newer hcache's key for the same tokens
    image = ours.read_bytes()
    for old, new in (
        (f'"layout_version":"{LAYOUT_VERSION}"', f'"layout_version":"{LAYOUT_VERSION + 1}"'),
        (keys[1], theirs),
    ):
        assert len(old) == len(new) and image.count(old.encode()) == 1
        image = image.replace(old.encode(), new.encode())
    newer = store / "chunks" / theirs[:2] / f"{theirs}.safetensors"
    newer.parent.mkdir(exist_ok=True)
    newer.write_bytes(image)
    for verify in ("header", "full"):
        reopened = DiskChunkStore(store, verify=verify)
        assert (reopened.other_version_at_start, reopened.dropped_at_start, len(reopened.keys())) == (1, 0, 3)
        reopened.close()
    with HCacheRuntime(llama, store, plan="KV", store={"quota_bytes": 4 * ours.stat().st_size}) as runtime:
        r = runtime.generate(prompt, 4, stop_token_ids=set())
    assert r.output_ids == reference and r.restored_tokens == 3 * CHUNK_TOKENS
    assert newer.read_bytes() == image  # under a quota it does not count against either
