"""The chunk, the unit of storage: 64 tokens' saved state for any subset of layers and formats.

On disk a chunk is one safetensors file. Tensors are named ``L{layer:04d}.{format}`` so the file is
layer-major (each layer's 64 rows are contiguous) for restore, which reads a layer of many chunks at a
time. The header's metadata carries the token ids, the fingerprint of the state's producer, and an
xxh3-64 checksum per tensor, so a restore that reads only some layers still verifies all it reads. The storage layer treats formats and fingerprints as opaque.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import BinaryIO

import safetensors.torch
import torch
import xxhash

from .chunk_key import LAYOUT_VERSION


class ChunkInvalid(Exception):
    """A stored chunk that must not be served: corrupt, truncated, or not the state asked for."""


@dataclass
class Chunk:
    key: str
    tokens: list[int]
    fingerprint: str
    tensors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (layer, format) -> rows


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _name(layer: int, fmt: str) -> str:
    return f"L{layer:04d}.{fmt}"


def _checksum(name: str, data) -> str:
    h = xxhash.xxh3_64(name.encode())
    h.update(data)
    return h.hexdigest()


def encode(chunk: Chunk) -> bytes:
    named = {_name(layer, fmt): t.detach().cpu().contiguous() for (layer, fmt), t in chunk.tensors.items()}
    sums = {name: _checksum(name, t.view(torch.uint8).numpy()) for name, t in named.items()}
    meta = {
        "layout_version": str(LAYOUT_VERSION),
        "key": chunk.key,
        "tokens": json.dumps(chunk.tokens),
        "fingerprint": chunk.fingerprint,
        "xxh3": json.dumps(sums),
    }
    return safetensors.torch.save(named, metadata=meta)


@dataclass
class ChunkReader:
    """An open stored chunk whose header is verified; tensors are read (and checksummed) on demand, so a
    restore reads only the layers and formats its plan uses."""

    file: BinaryIO
    key: str
    entries: dict[tuple[int, str], dict]
    checksums: dict[str, str]
    data_start: int
    bytes_read: int

    @classmethod
    def open(cls, file: BinaryIO, key: str, tokens: list[int], fingerprint: str) -> "ChunkReader":
        entries, meta, data_start = _read_header(file, key)
        if meta.get("fingerprint") != fingerprint:
            raise ChunkInvalid(f"chunk {key}: saved by another model (fingerprint {meta.get('fingerprint')!r})")
        try:
            stored_tokens = json.loads(meta.get("tokens", "null"))
        except ValueError:
            stored_tokens = None
        if stored_tokens != list(tokens):
            raise ChunkInvalid(f"chunk {key}: token ids differ from the request's")
        return cls(file, key, entries, _checksums(meta, key), data_start, data_start)

    def formats(self, layer: int) -> set[str]:
        return {fmt for (lay, fmt) in self.entries if lay == layer}

    def read(self, layer: int, fmt: str) -> torch.Tensor:
        entry = self.entries[(layer, fmt)]
        return self.read_into(layer, fmt, torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]]))

    def read_into(self, layer: int, fmt: str, out: torch.Tensor) -> torch.Tensor:
        """Read and verify one tensor straight into ``out`` (a contiguous CPU tensor of its shape and
        dtype), so a restore fills its layer buffer without an intermediate copy. On failure ``out``
        holds garbage."""
        entry = self.entries[(layer, fmt)]
        if list(out.shape) != list(entry["shape"]) or out.dtype != _DTYPES[entry["dtype"]]:
            raise ChunkInvalid(
                f"chunk {self.key}: {entry['name']} is {list(entry['shape'])} {entry['dtype']}, "
                f"expected {list(out.shape)} {out.dtype}"
            )
        begin, end = entry["data_offsets"]
        data = out.view(torch.uint8).reshape(-1).numpy()
        self.file.seek(self.data_start + begin)
        if self.file.readinto(data) != end - begin:
            raise ChunkInvalid(f"chunk {self.key}: truncated at {entry['name']}")
        self.bytes_read += end - begin
        if self.checksums.get(entry["name"]) != _checksum(entry["name"], data):
            raise ChunkInvalid(f"chunk {self.key}: checksum mismatch in {entry['name']}")
        return out


def _read_header(file: BinaryIO, key: str) -> tuple[dict[tuple[int, str], dict], dict, int]:
    """The tensor entries, metadata and data offset of a chunk file, checked for consistency, so that a
    damaged header is reported as :class:`ChunkInvalid` rather than failing later as a tensor view."""
    try:
        head = file.read(8)
        header_len = int.from_bytes(head, "little")
        if len(head) != 8 or header_len > 1 << 24:
            raise ValueError("bad header length")
        header = json.loads(file.read(header_len))
        meta = header.pop("__metadata__", None) or {}
        entries, end = {}, 0
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            layer, fmt = name[1:].split(".", 1)
            begin, stop = entry["data_offsets"]
            size = _DTYPES[entry["dtype"]].itemsize
            for dim in entry["shape"]:
                size *= dim
            if begin != end or stop - begin != size:
                raise ValueError(f"tensor {name} has inconsistent offsets")
            entries[(int(layer), fmt)] = dict(entry, name=name)
            end = stop
    except Exception as exc:  # any parse failure is corruption
        raise ChunkInvalid(f"chunk {key}: unreadable header ({exc})") from exc
    if meta.get("layout_version") != str(LAYOUT_VERSION):
        raise ChunkInvalid(f"chunk {key}: layout version {meta.get('layout_version')!r}, expected {LAYOUT_VERSION}")
    if meta.get("key") != key:
        raise ChunkInvalid(f"chunk {key}: header names key {meta.get('key')!r}")
    return entries, meta, 8 + header_len


def _checksums(meta: dict, key: str) -> dict[str, str]:
    try:
        return dict(json.loads(meta.get("xxh3", "{}")))
    except (TypeError, ValueError) as exc:
        raise ChunkInvalid(f"chunk {key}: unreadable checksums ({exc})") from exc


def verify_stored(file: BinaryIO, key: str, full: bool) -> str:
    """Check a stored chunk without knowing its request: header, key, layout version and length, and with
    ``full`` every tensor's checksum. Returns the producer's fingerprint; raises :class:`ChunkInvalid`."""
    entries, meta, data_start = _read_header(file, key)
    data_end = data_start + max((e["data_offsets"][1] for e in entries.values()), default=0)
    length = file.seek(0, 2)
    if length != data_end:
        raise ChunkInvalid(f"chunk {key}: {length} bytes on disk, its header describes {data_end}")
    if full:
        reader = ChunkReader(file, key, entries, _checksums(meta, key), data_start, data_start)
        for layer, fmt in entries:
            reader.read(layer, fmt)
    return meta.get("fingerprint", "")
