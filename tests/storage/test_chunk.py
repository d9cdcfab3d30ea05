import json
import os

import pytest
import safetensors.torch
import torch
from support.storage_chunks import read_back

from hcache.errors import StorageError
from hcache.ops.quant import quantise
from hcache.storage.chunk import Chunk, ChunkImage, ChunkInvalid, ChunkLayout, decode, encode
from hcache.storage.chunk_key import CHUNK_TOKENS, LAYOUT_VERSION, chunk_keys, root_key
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


def test_chunk_image_is_a_safetensors_file_laid_out_layer_major_and_aligned(rng):
    chunk = _chunk(rng)
    data = encode(chunk)
    assert set(safetensors.torch.load(data)) == {"L0000.H", "L0001.H", "L0001.KV"}  # any safetensors reader opens it
    image = ChunkImage.parse(torch.frombuffer(bytearray(data), dtype=torch.uint8), chunk.key, len(data))
    offsets = [image.layout.entries[k].offset for k in [(0, "H"), (1, "H"), (1, "KV")]]
    assert offsets == sorted(offsets) and all(o % 64 == 0 for o in offsets)  # layer 0 before layer 1
    assert image.tokens == chunk.tokens and image.fingerprint == "fp" and image.has(1, "KV") and not image.has(0, "KV")
    for name, t in chunk.tensors.items():
        assert torch.equal(image.tensor(*name), t)


def test_a_chunk_laid_out_before_its_tokens_are_known_seals_in_place(rng):
    """The saver fills rows first and names the chunk when it is complete: the header room is reserved."""
    chunk = _chunk(rng)
    layout = ChunkLayout.plan([(l, f, tuple(t.shape[1:]), t.dtype) for (l, f), t in chunk.tensors.items()], "fp")
    image = ChunkImage(torch.zeros(layout.nbytes, dtype=torch.uint8), layout, "fp")
    for name, t in chunk.tensors.items():
        image.tensor(*name).copy_(t)
    image.seal(chunk.key, [2**62] * CHUNK_TOKENS)  # the longest token ids still fit
    image.seal(chunk.key, chunk.tokens)
    assert bytes(image.data.numpy()) == encode(chunk)


@pytest.mark.parametrize(
    "fingerprint, tokens, message", [("other", None, "another model"), ("fp", [1] * 64, "token ids")]
)
def test_chunk_for_other_state_is_rejected(rng, fingerprint, tokens, message):
    chunk = _chunk(rng)
    data = encode(chunk)
    image = ChunkImage.parse(torch.frombuffer(bytearray(data), dtype=torch.uint8), chunk.key, len(data))
    with pytest.raises(ChunkInvalid, match=message):
        image.check(tokens or chunk.tokens, fingerprint)
    with pytest.raises(ChunkInvalid, match="key"):
        decode(data, "cd" * 16)


def test_flipped_byte_and_truncation_are_detected(rng):
    chunk = _chunk(rng)
    data = bytearray(encode(chunk))
    data[-5] ^= 0xFF  # inside the last tensor's bytes
    with pytest.raises(ChunkInvalid, match="checksum mismatch in L0001.KV"):
        decode(bytes(data), chunk.key)
    with pytest.raises(ChunkInvalid, match="describes"):
        decode(encode(chunk)[:-10], chunk.key)
    for garbage in (b"\x00" * 4, b"\xff" * 4096, b""):
        with pytest.raises(ChunkInvalid, match="unreadable"):
            decode(garbage, chunk.key)


def _with_header(data: bytes, header: bytes) -> bytes:
    """``data`` with its header replaced by ``header`` (padded with spaces to the same length)."""
    room = int.from_bytes(data[:8], "little")
    assert len(header) <= room
    return data[:8] + header + b" " * (room - len(header)) + data[8 + room :]


@pytest.mark.parametrize("pad", [1, 2, 4, 32])
def test_a_header_whose_tensors_are_not_aligned_is_refused(rng, pad):
    """A header lengthened by ``pad`` bytes, the file with it, still describes the file and its checksums
    still hold, but its tensors no longer start 64-byte aligned: their views, taken in whole elements,
    would read other bytes than the checksums covered (issue 67)."""
    chunk = _chunk(rng)
    data = encode(chunk)
    room = int.from_bytes(data[:8], "little")
    shifted = (room + pad).to_bytes(8, "little") + data[8 : 8 + room] + b" " * pad + data[8 + room :]
    with pytest.raises(ChunkInvalid, match="aligned"):
        decode(shifted, chunk.key)


def test_a_header_is_read_whole_though_its_tensors_part_is_parsed_once_per_layout(rng):
    """Chunks laid out alike share their header's tensors part, which is parsed once; what differs
    (metadata, a damaged entry, a key after the metadata) is still read and checked in every chunk."""
    chunk = _chunk(rng)
    data = encode(chunk)
    assert decode(data, chunk.key).tokens == chunk.tokens  # its layout is now known
    room = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + room])
    meta = header.pop("__metadata__")

    def dump(h: dict) -> bytes:
        return json.dumps(h, separators=(",", ":")).encode()

    other = dict(meta, tokens=json.dumps([7] * CHUNK_TOKENS))
    assert decode(_with_header(data, dump({**header, "__metadata__": other})), chunk.key).tokens == [7] * CHUNK_TOKENS
    moved = json.loads(json.dumps(header))
    moved["L0001.KV"]["data_offsets"][1] += 4
    bad = [
        dump({**moved, "__metadata__": meta}),  # an entry's offsets damaged
        dump({"__metadata__": meta, **header}),  # metadata first (safetensors' own writer puts it there)
        dump({**header, "L0000.H": {**header["L0000.H"], "__metadata__": meta}, "__metadata__": meta}),  # nested
        dump({**header, "__metadata__": meta})[:-1]
        + b',"L0002.H":'
        + dump(header["L0000.H"])
        + b"}",  # a tensor after it
        dump({**header, "__metadata__": {**meta, "tokens": 5}}),  # metadata values not strings
    ]
    for h in bad:
        with pytest.raises(ChunkInvalid, match="unreadable"):
            decode(_with_header(data, h), chunk.key)
    empty = Chunk(chunk.key, chunk.tokens, "fp")  # no tensors at all: a chunk still
    assert decode(encode(empty), chunk.key).tensors == {}


def test_store_publishes_atomically_and_discards(tmp_path):
    store = DiskChunkStore(tmp_path)
    store.put("ab" * 16, b"payload" * 1000)
    assert store.contains("ab" * 16) and store.keys() == ["ab" * 16]
    assert read_back(store, "ab" * 16) == b"payload" * 1000
    assert not [p for p in tmp_path.rglob("*.tmp")]
    store.discard("ab" * 16)
    assert read_back(store, "ab" * 16) is None and not store.contains("ab" * 16)


def test_unwritable_or_foreign_store_is_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(StorageError, match="not a writable directory"):
        DiskChunkStore(not_a_dir / "store")
    DiskChunkStore(tmp_path / "s")
    (tmp_path / "s" / "hcache-store.json").write_text('{"layout_version": 99}')
    with pytest.raises(StorageError, match="layout version 99"):
        DiskChunkStore(tmp_path / "s")
    (tmp_path / "s" / "hcache-store.json").write_text(json.dumps({"layout_version": LAYOUT_VERSION, "producers": "me"}))
    with pytest.raises(StorageError, match="producers in hcache-store.json are not a list"):
        DiskChunkStore(tmp_path / "s", labels={"fingerprint": "f"})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_directory_is_rejected(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(StorageError):
            DiskChunkStore(tmp_path / "store")
    finally:
        tmp_path.chmod(0o700)


def test_chunk_stores_codes_and_scales_under_checksums(rng):
    """An 8-bit format's codes and its float16 scales are tensors of the chunk like any other."""
    fp8 = torch.float8_e4m3fn
    rows = quantise(torch.randn(64, 2, 3, 64, generator=rng), fp8)
    chunk = Chunk("ab" * 16, list(range(64)), "fp", {(0, "KV"): rows.codes, (0, "KV.scale"): rows.scale})
    data = encode(chunk)
    back = decode(data, chunk.key)
    assert back.tensors[(0, "KV")].dtype == fp8 and torch.equal(
        back.tensors[(0, "KV")].view(torch.uint8), rows.codes.view(torch.uint8)
    )
    assert torch.equal(back.tensors[(0, "KV.scale")], rows.scale)
    assert b'"dtype":"F8_E4M3"' in data and b'"dtype":"F16"' in data
    bad = bytearray(data)
    bad[-1] ^= 0x01  # the last scale's low byte
    with pytest.raises(Exception, match="checksum mismatch in L0000.KV.scale"):
        decode(bytes(bad), chunk.key)
