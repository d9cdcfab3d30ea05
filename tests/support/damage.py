"""The ways a chunk file is damaged on disk (issue 42): each leaves a file that must fail verification, and
the header rewrites keep the header's length, so that a check of the header alone may still pass."""

import json
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


def damage(path: Path, kind: str, other: Path) -> None:
    """Damage the chunk file at ``path`` by ``kind``; ``other``: another chunk's file of the same layout."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + size]))
    meta = header["__metadata__"]
    sums = json.loads(meta["xxh3"])
    tensors = [name for name in header if name != "__metadata__"]
    if kind == "truncate":
        data = data[:-100]
    elif kind == "append":
        data += bytes(100)
    elif kind == "flip_data":
        data[8 + size + header[tensors[0]]["data_offsets"][0] + 5] ^= 0xFF
    elif kind == "flip_header":
        data[9] ^= 0x01  # the header's first name opens with '#', not '"': it no longer parses
    elif kind == "other_key":
        data = bytearray(other.read_bytes())
    else:
        if kind == "xxh3_garbage":
            sums[tensors[0]] = "0" * 16 if sums[tensors[0]] != "0" * 16 else "1" * 16
        elif kind == "dropped_checksum":
            del sums[tensors[0]]
        elif kind == "swapped_offsets":
            a, b = [name for name in tensors if header[name]["shape"] == header[tensors[0]]["shape"]][:2]
            header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
        else:
            raise ValueError(kind)
        meta["xxh3"] = json.dumps(sums)
        text = json.dumps(header, separators=(",", ":")).encode()
        assert len(text) <= size
        data[8 : 8 + size] = text + b" " * (size - len(text))
    path.write_bytes(bytes(data))
