"""The ways a chunk file is damaged on disk (issue 42): each leaves a file that must fail verification, and
the header rewrites keep the header's length, so that a check of the header alone may still pass. A
``resized`` rewrite (issue 67) writes the header 64 bytes shorter and the file with it, its tensors still
aligned: a whole file that its header describes, whose length is no longer the one the store indexed."""

import json
from collections.abc import Callable
from pathlib import Path

KINDS = [
    "truncate",
    "append",
    "flip_data",
    "flip_header",
    "xxh3_garbage",
    "dropped_checksum",
    "swapped_offsets",
    "other_key",
]
HEADER_PARSES = ["flip_data", "xxh3_garbage", "dropped_checksum", "swapped_offsets"]  # pass a check of the header alone
REWRITES = [
    "xxh3_garbage",
    "dropped_checksum",
    "swapped_offsets",
    "other_shape",
    "other_dtype",
    "other_fingerprint",
    "other_tokens",
]
RESIZED = [f"{kind}, resized" for kind in REWRITES]


def rewrite_header(path: Path, change: Callable[[dict], None], shift: int = 0) -> None:
    """Rewrite the header of the chunk file at ``path`` by ``change`` (given the header's JSON object, its
    metadata a map of strings), ``shift`` bytes longer (a multiple of 64), padded as a chunk's is."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + size]))
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    room = size + shift
    assert shift % 64 == 0 and len(text) <= room
    path.write_bytes(room.to_bytes(8, "little") + text + b" " * (room - len(text)) + data[8 + size :])


def damage(path: Path, kind: str, other: Path) -> None:
    """Damage the chunk file at ``path`` by ``kind``; ``other``: another chunk's file of the same layout."""
    kind, resized = kind.removesuffix(", resized"), kind.endswith(", resized")
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + size]))
    tensors = [name for name in header if name != "__metadata__"]
    if kind == "truncate":
        path.write_bytes(data[:-100])
    elif kind == "append":
        path.write_bytes(data + bytes(100))
    elif kind == "flip_data":
        data[8 + size + header[tensors[0]]["data_offsets"][0] + 5] ^= 0xFF
        path.write_bytes(data)
    elif kind == "flip_header":
        data[9] ^= 0x01  # the header's first name opens with '#', not '"': it no longer parses
        path.write_bytes(data)
    elif kind == "other_key":
        path.write_bytes(other.read_bytes())
    else:
        rewrite_header(path, lambda header: _rewrite(header, kind, tensors), -64 if resized else 0)


def _rewrite(header: dict, kind: str, tensors: list[str]) -> None:
    meta = header["__metadata__"]
    sums = json.loads(meta["xxh3"])
    first = header[tensors[0]]
    if kind == "xxh3_garbage":
        sums[tensors[0]] = "0" * 16 if sums[tensors[0]] != "0" * 16 else "1" * 16
    elif kind == "dropped_checksum":
        del sums[tensors[0]]
    elif kind == "swapped_offsets":
        a, b = [name for name in tensors if header[name]["shape"] == first["shape"]][:2]
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    elif kind == "other_shape":  # the same bytes, as rows of another shape
        assert first["shape"][-1] % 2 == 0
        first["shape"] = [*first["shape"][:-1], first["shape"][-1] // 2, 2]
    elif kind == "other_dtype":  # the same bytes, as numbers of another type
        first["dtype"], widen = {"F32": ("F16", 2), "F16": ("BF16", 1), "BF16": ("F16", 1)}[first["dtype"]]
        first["shape"] = [*first["shape"][:-1], widen * first["shape"][-1]]
    elif kind == "other_fingerprint":
        meta["fingerprint"] = "another-model"
    elif kind == "other_tokens":
        meta["tokens"] = json.dumps([t + 1 for t in json.loads(meta["tokens"])])
    else:
        raise ValueError(kind)
    meta["xxh3"] = json.dumps(sums)
