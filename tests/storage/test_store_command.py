"""``hcache store inspect / verify / evict`` on a store of real chunks: one corrupt, one of a newer layout
version, one of another model in an 8-bit encoding; and on a live store held by another process."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.storage_chunks import FINGERPRINT, chunk, chunk_bytes

from hcache.cli import main
from hcache.errors import StorageError
from hcache.storage.chunk import Chunk, encode
from hcache.storage.chunk_key import CHUNK_TOKENS, LAYOUT_VERSION, next_key, root_key
from hcache.storage.disk_store import DiskChunkStore

OTHER_MODEL = "other-model"


def _file(store_dir: Path, key: str) -> Path:
    return store_dir / "chunks" / key[:2] / f"{key}.safetensors"


def _files(store_dir: Path) -> dict[str, tuple[float, bytes]]:
    """Every file under the store directory, with its time and contents."""
    return {
        str(p.relative_to(store_dir)): (p.stat().st_mtime, p.read_bytes())
        for p in sorted(store_dir.rglob("*"))
        if p.is_file()
    }


def _other_model_chunk() -> Chunk:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 1000, (CHUNK_TOKENS,), generator=g).tolist()
    codes = torch.randint(-128, 127, (CHUNK_TOKENS, 2, 2, 4), generator=g, dtype=torch.int8)
    scales = torch.rand(CHUNK_TOKENS, 2, 2, generator=g).half()
    return Chunk(
        next_key(root_key(OTHER_MODEL), tokens), tokens, OTHER_MODEL, {(0, "KV"): codes, (0, "KV.scale"): scales}
    )


@pytest.fixture
def store(tmp_path):
    """A store of chunks 0-3 (test-model, float32 H; chunk 1 corrupt in a tensor), chunk 4 rewritten to a
    newer layout version, and one chunk of another model (int8 KV). Returns (dir, {name: key})."""
    d = tmp_path / "store"
    s = DiskChunkStore(d, fsync=False, direct_io=False)
    keys = {}
    for i in range(5):
        keys[i], data = chunk_bytes(i)
        s.put(keys[i], data)
    other = _other_model_chunk()
    s.put(other.key, encode(other))
    keys["other"] = other.key
    s.close()
    corrupt = _file(d, keys[1])
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor
    corrupt.write_bytes(bytes(data))
    newer = _file(d, keys[4])
    old, new = f'"layout_version":"{LAYOUT_VERSION}"'.encode(), f'"layout_version":"{LAYOUT_VERSION + 1}"'.encode()
    image = newer.read_bytes()
    assert image.count(old) == 1
    newer.write_bytes(image.replace(old, new))
    return d, keys


def test_inspect_counts_chunks_bytes_formats_models_and_ages(store, capsys):
    d, keys = store
    now = time.time()
    os.utime(_file(d, keys[0]), (now - 1000, now - 1000))
    assert main(["store", "inspect", str(d), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["chunks"] == 6 and r["bytes"] == sum(_file(d, k).stat().st_size for k in keys.values())
    assert (r["readable"], r["other_version"], r["bad_header"]) == (5, 1, 0)
    assert r["formats"] == {"H": {"float32": 4}, "KV": {"int8": 1}}
    assert r["models"] == {FINGERPRINT: 4, OTHER_MODEL: 1}
    assert r["namespaces"] is None and "not recorded" in r["namespaces_note"]
    assert 999 < r["oldest_age_s"] < 1100 and r["newest_age_s"] < 100
    assert main(["store", "inspect", str(d)]) == 0
    text = capsys.readouterr().out
    assert "6 chunks" in text and f"model {FINGERPRINT}: 4 chunks" in text and "format KV: int8 in 1 chunks" in text


def test_verify_lists_the_bad_chunk_and_repair_removes_only_it(store, capsys):
    d, keys = store
    before = _files(d)
    assert main(["store", "verify", str(d)]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("bad: ")]
    assert len(bad) == 1 and keys[1] in bad[0] and "checksum mismatch" in bad[0]
    assert f"other version (left alone): {_file(d, keys[4])}" in out
    assert "6 chunks" in out and "4 good, 1 bad, 1 of another layout version" in out
    assert _files(d) == before  # without --repair, read-only

    assert main(["store", "verify", str(d), "--repair"]) == 1
    assert "removed 1 bad" in capsys.readouterr().out
    assert not _file(d, keys[1]).exists()
    assert {k: v for k, v in before.items() if keys[1] not in k} == _files(d)  # nothing else changed
    assert main(["store", "verify", str(d)]) == 0
    assert "4 good, 0 bad, 1 of another layout version" in capsys.readouterr().out


def test_evict_by_age_and_by_model(store, capsys):
    d, keys = store
    now = time.time()
    for k in (keys[0], keys[4]):  # an old chunk of ours and an old one of another version
        os.utime(_file(d, k), (now - 1000, now - 1000))
    size0 = _file(d, keys[0]).stat().st_size
    assert main(["store", "evict", str(d), "--older-than", "500"]) == 0
    assert f"evicted 1 chunks, {size0} bytes" in capsys.readouterr().out
    assert not _file(d, keys[0]).exists() and _file(d, keys[4]).exists()

    size = _file(d, keys["other"]).stat().st_size
    assert main(["store", "evict", str(d), "--model", OTHER_MODEL]) == 0
    assert f"evicted 1 chunks, {size} bytes" in capsys.readouterr().out
    assert not _file(d, keys["other"]).exists()
    assert all(_file(d, keys[i]).exists() for i in (1, 2, 3, 4))


def test_evict_by_namespace_walks_the_key_chains(tmp_path, capsys):
    d = tmp_path / "store"
    s = DiskChunkStore(d, fsync=False, direct_io=False)
    chained = []
    for namespace in ("tenant-a", None):
        parent = root_key(FINGERPRINT, namespace)
        for i in range(3):  # a 3-chunk history saved under the namespace
            c = chunk(10 * (namespace is None) + i)
            c.key = parent = next_key(parent, c.tokens)
            s.put(c.key, encode(c))
            chained.append((namespace, c.key))
    s.close()
    assert main(["store", "evict", str(d), "--namespace", "tenant-a"]) == 0
    assert "evicted 3 chunks" in capsys.readouterr().out
    assert [_file(d, k).exists() for _, k in chained] == [False] * 3 + [True] * 3


def test_bad_arguments_exit_2_with_one_line_and_touch_nothing(store, tmp_path, capsys):
    d, _ = store
    before = _files(d)
    with pytest.raises(SystemExit) as exc:
        main(["store", "verify"])  # no DIR
    assert exc.value.code == 2
    capsys.readouterr()
    assert main(["store", "evict", str(d)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "hcache store: error: store evict needs a filter: --older-than SECONDS, --namespace NS or --model FINGERPRINT"
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    for argv in (
        ["inspect", str(plain)],
        ["verify", str(plain), "--repair"],
        ["evict", str(plain), "--older-than", "0"],
    ):
        assert main(["store", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not a store directory" in err
    assert list(plain.iterdir()) == [] and _files(d) == before


HOLDER = """
import json, sys
from support.storage_chunks import read_back
from hcache.storage.chunk import decode
from hcache.storage.disk_store import DiskChunkStore
store = DiskChunkStore(sys.argv[1], fsync=False, direct_io=False)
print(json.dumps(store.keys()), flush=True)
keys = json.loads(sys.stdin.readline())
out = {}
for key in keys:
    data = read_back(store, key)
    if data is not None:
        decode(data, key)  # every checksum
    out[key] = data is not None
print(json.dumps([out, store.keys()]), flush=True)
"""


def test_verify_and_evict_on_a_live_store(store, capsys):
    """A server holds the store: verify --repair and evict run beside it without its lock; it then reads
    every remaining chunk whole, and a read of a removed one is a miss (no exception), which drops it from
    its index."""
    d, keys = store
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(d)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        indexed = json.loads(holder.stdout.readline())
        assert set(indexed) == {keys[i] for i in (0, 1, 2, 3)} | {keys["other"]}  # header-checked at start-up: 1 passes
        with pytest.raises(StorageError, match="in use by another process"):
            DiskChunkStore.check(d)
        lock = (d / "hcache-store.lock").read_bytes()
        manifest = (d / "hcache-store.json").read_bytes()
        assert main(["store", "verify", str(d), "--repair"]) == 1
        assert main(["store", "evict", str(d), "--model", OTHER_MODEL]) == 0
        assert "evicted 1 chunks" in capsys.readouterr().out
        with pytest.raises(StorageError, match="in use by another process"):
            DiskChunkStore.check(d)  # the server still holds it
        assert (d / "hcache-store.lock").read_bytes() == lock and (d / "hcache-store.json").read_bytes() == manifest
        out, _ = holder.communicate(json.dumps(indexed) + "\n", timeout=120)
        read, after = json.loads(out)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert holder.returncode == 0
    assert read == {keys[0]: True, keys[1]: False, keys[2]: True, keys[3]: True, keys["other"]: False}
    assert set(after) == {keys[0], keys[2], keys[3]}  # the misses dropped the removed chunks from its index
    assert _file(d, keys[4]).exists()  # the newer version's chunk, untouched
