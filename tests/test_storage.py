import io
import os

import pytest
import torch

from hcache.errors import StorageError
from hcache.storage.chunk import Chunk, ChunkInvalid, ChunkReader, encode
from hcache.storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from hcache.storage.disk_store import DiskChunkStore


def test_keys_chain_over_the_whole_prefix():
    root = root_key("model-a")
    tokens = list(range(200))
    keys = chunk_keys(tokens, root)
    assert len(keys) == 3  # the partial chunk of 8 tokens has no key
    assert chunk_keys(tokens[:128], root) == keys[:2]  # a shared prefix shares its chunks
    changed = chunk_keys([999] + tokens[1:], root)
    assert all(a != b for a, b in zip(keys, changed))  # an early change changes every later key
    assert chunk_keys(tokens, root_key("model-a", "tenant-1"))[0] != keys[0]
    assert chunk_keys(tokens, root_key("model-b"))[0] != keys[0]


def _chunk(rng: torch.Generator) -> Chunk:
    tensors = {
        (0, "H"): torch.randn(CHUNK_TOKENS, 8, generator=rng),
        (1, "KV"): torch.randn(CHUNK_TOKENS, 2, 2, 4, generator=rng),
        (1, "H"): torch.randn(CHUNK_TOKENS, 8, generator=rng),
    }
    return Chunk("ab" * 16, list(range(CHUNK_TOKENS)), "fp", tensors)


def _open(data: bytes, chunk: Chunk, **override) -> ChunkReader:
    args = dict(key=chunk.key, tokens=chunk.tokens, fingerprint=chunk.fingerprint) | override
    return ChunkReader.open(io.BytesIO(data), **args)


def test_chunk_roundtrip_is_layer_major_and_reads_only_what_is_asked(rng):
    chunk = _chunk(rng)
    data = encode(chunk)
    reader = _open(data, chunk)
    assert reader.formats(1) == {"H", "KV"}
    offsets = [reader.entries[k]["data_offsets"][0] for k in [(0, "H"), (1, "H"), (1, "KV")]]
    assert offsets == sorted(offsets)  # layer 0 before layer 1
    torch.testing.assert_close(reader.read(1, "KV"), chunk.tensors[(1, "KV")], rtol=0, atol=0)
    assert reader.bytes_read - reader.data_start == chunk.tensors[(1, "KV")].numel() * 4


def test_read_into_fills_the_callers_buffer_and_refuses_another_shape_or_dtype(rng):
    chunk = _chunk(rng)
    reader = _open(encode(chunk), chunk)
    buffer = torch.full((2 * CHUNK_TOKENS, 8), float("nan"))
    reader.read_into(1, "H", buffer[CHUNK_TOKENS:])
    assert torch.equal(buffer[CHUNK_TOKENS:], chunk.tensors[(1, "H")]) and buffer[:CHUNK_TOKENS].isnan().all()
    for wrong in (torch.empty(CHUNK_TOKENS, 4), torch.empty(CHUNK_TOKENS, 8, dtype=torch.float16)):
        with pytest.raises(ChunkInvalid, match="expected"):
            reader.read_into(0, "H", wrong)


@pytest.mark.parametrize(
    "override, message",
    [({"fingerprint": "other"}, "another model"), ({"tokens": [1] * 64}, "token ids"), ({"key": "cd" * 16}, "key")],
)
def test_chunk_for_other_state_is_rejected(rng, override, message):
    chunk = _chunk(rng)
    with pytest.raises(ChunkInvalid, match=message):
        _open(encode(chunk), chunk, **override)


def test_flipped_byte_and_truncation_are_detected(rng):
    chunk = _chunk(rng)
    data = bytearray(encode(chunk))
    data[-5] ^= 0xFF  # inside the last tensor's bytes
    reader = _open(bytes(data), chunk)
    last = max(reader.entries, key=lambda k: reader.entries[k]["data_offsets"][1])
    with pytest.raises(ChunkInvalid, match="checksum"):
        reader.read(*last)
    with pytest.raises(ChunkInvalid, match="truncated"):
        _open(encode(chunk)[:-10], chunk).read(*last)
    with pytest.raises(ChunkInvalid, match="unreadable"):
        _open(b"\x00" * 4, chunk)


def test_store_publishes_atomically_and_discards(tmp_path):
    store = DiskChunkStore(tmp_path)
    store.put("ab" * 16, b"payload" * 1000)
    assert store.contains("ab" * 16) and store.keys() == ["ab" * 16]
    with store.open("ab" * 16) as f:
        assert f.read() == b"payload" * 1000
    assert not [p for p in tmp_path.rglob("*.tmp")]
    store.discard("ab" * 16)
    assert store.open("ab" * 16) is None and not store.contains("ab" * 16)


def test_unwritable_or_foreign_store_is_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(StorageError, match="not a writable directory"):
        DiskChunkStore(not_a_dir / "store")
    DiskChunkStore(tmp_path / "s")
    (tmp_path / "s" / "hcache-store.json").write_text('{"layout_version": 99}')
    with pytest.raises(StorageError, match="layout version 99"):
        DiskChunkStore(tmp_path / "s")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_directory_is_rejected(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(StorageError):
            DiskChunkStore(tmp_path / "store")
    finally:
        tmp_path.chmod(0o700)
