"""The chunk, the unit of storage: 64 tokens' saved state for any subset of layers and formats.

A chunk is one safetensors image, the same bytes in a host-pool slot and in its file, so the disk moves
it with one request and the pool serves its tensors in place. Tensors are named ``L{layer:04d}.{format}``
and laid out layer-major, so one layer of a chunk is one contiguous range. The header's metadata carries
the key, its parent's key (the chunk before it in its chain, which a store keeps while it keeps this one),
the token ids, the fingerprint of the state's producer and an xxh3-64 checksum per tensor; it is
padded with spaces (which safetensors allows) to a size fixed when the chunk is laid out, so a chunk's
rows can be written before its tokens and checksums are known, and every tensor starts 64-byte aligned.
The metadata is the header's last entry, so the headers of chunks laid out alike begin with the same
bytes, and a reader parses that part once per layout (:func:`_layout`). The storage layer treats formats
and fingerprints as opaque.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
import xxhash

from .chunk_key import CHUNK_TOKENS, LAYOUT_VERSION
from .stored_state import Source, TensorSpec

_ALIGN = 64
# safetensors' names. The 8-bit ones hold compressed state's codes; what they encode (their scales are
# tensors of their own, under the same checksums) is for the layer above to know.
_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER = 1 << 24
_METADATA = b'"__metadata__":'


class ChunkInvalid(Exception):
    """A stored chunk that must not be served: corrupt, truncated, or not the state asked for. ``discard``:
    it is proven bad, and its store may delete it."""

    discard = True


class ChunkOtherVersion(ChunkInvalid):
    """A chunk of another layout version: another hcache's (a newer one's, in a rolling upgrade sharing a
    store), which that hcache reads. It is not served here and never deleted here."""

    discard = False


@dataclass
class Chunk:
    """A chunk's contents as separate tensors: what tests and tools build and inspect."""

    key: str
    tokens: list[int]
    fingerprint: str
    tensors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (layer, format) -> rows
    parent: str = ""  # the key of the chunk before it in its chain ("": none known)


@dataclass(frozen=True)
class TensorEntry:
    offset: int  # from the start of the image
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int = field(init=False)  # a restore asks for it per layer of every chunk
    strides: tuple[int, ...] = field(init=False)  # of the tensor's view, in elements

    def __post_init__(self) -> None:
        strides, n = [], 1
        for d in reversed(self.shape):
            strides.append(n)
            n *= d
        object.__setattr__(self, "nbytes", n * self.dtype.itemsize)
        object.__setattr__(self, "strides", tuple(reversed(strides)))


def _name(layer: int, fmt: str) -> str:
    return f"L{layer:04d}.{fmt}"


def _checksum(name: str, data) -> str:
    """xxh3-64 of a tensor's name and its bytes (any buffer: a numpy slice costs less to make than a view)."""
    h = xxhash.xxh3_64(name.encode())
    h.update(data)
    return h.hexdigest()


class ChunkLayout:
    """Where each tensor of a chunk lives in its image, and how long the image is."""

    def __init__(self, entries: dict[tuple[int, str], TensorEntry], data_start: int):
        self.entries, self.data_start = entries, data_start
        self.nbytes = data_start + sum(e.nbytes for e in entries.values())
        self.names = {k: _name(*k) for k in entries}
        self.name_set = frozenset(self.names.values())
        self.layers = frozenset(layer for layer, _ in entries)  # whose rows or state it holds, for KV cache events
        # What a restore checks of a chunk's tensors, so it checks each distinct layout once.
        self.signature = frozenset((k, e.shape, e.dtype) for k, e in entries.items())

    @classmethod
    def plan(cls, tensors: list[TensorSpec], fingerprint: str) -> "ChunkLayout":
        """The layout of a chunk of ``(layer, format, row shape, dtype)`` tensors, with room in the header
        for any token ids and checksums."""
        offset, entries = 0, {}
        for layer, fmt, row_shape, dtype in sorted(tensors, key=lambda t: (t[0], t[1])):
            if dtype not in _NAMES:
                raise ValueError(f"dtype {dtype} cannot be stored")
            entries[(layer, fmt)] = entry = TensorEntry(offset, (CHUNK_TOKENS, *row_shape), dtype)
            offset += entry.nbytes
        sums = {_name(*k): "f" * 16 for k in entries}
        longest = _header(entries, 0, "f" * 32, "f" * 32, [-(1 << 63)] * CHUNK_TOKENS, fingerprint, sums)
        data_start = -(-(8 + len(longest)) // _ALIGN) * _ALIGN
        return cls({k: TensorEntry(data_start + e.offset, e.shape, e.dtype) for k, e in entries.items()}, data_start)


def _header(
    entries: dict, data_start: int, key: str, parent: str, tokens: list[int], fingerprint: str, sums: dict[str, str]
) -> bytes:
    header = {
        _name(*k): {
            "dtype": _NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [e.offset - data_start, e.offset - data_start + e.nbytes],
        }
        for k, e in entries.items()
    }
    header["__metadata__"] = {
        "layout_version": str(LAYOUT_VERSION),
        "key": key,
        "parent": parent,
        "tokens": json.dumps(tokens),
        "fingerprint": fingerprint,
        "xxh3": json.dumps(sums),
    }
    return json.dumps(header, separators=(",", ":")).encode()


class ChunkImage:
    """A chunk's image in host memory (``data``: a uint8 tensor, a host-pool slot's view): its tensors are
    views of it. ``key``/``tokens``/``parent`` are set when the chunk is published (saved) or parsed
    (loaded), ``sums`` (its tensors' checksums) when it is sealed or parsed; ``slot`` is the host-pool slot
    that holds it, if one does."""

    def __init__(
        self,
        data: torch.Tensor,
        layout: ChunkLayout,
        fingerprint: str,
        key: str = "",
        tokens: list[int] | None = None,
        slot: object = None,
    ):
        if len(data) < layout.nbytes:
            raise ValueError(f"a chunk image of {layout.nbytes} bytes does not fit in {len(data)}")
        self.data, self.layout, self.fingerprint = data, layout, fingerprint
        self.key, self.tokens, self.slot = key, tokens, slot
        self.parent = ""
        self.sums: dict[str, str] | None = None
        self.source = Source.HOST.value  # where it came into host memory from: saved here, or a store's kind
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # ``data`` read as each dtype, the base of its views
        self._spans: dict[tuple[tuple[int, ...], str], list[tuple[int, int, torch.Tensor]]] = {}

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def names(self) -> frozenset[str]:
        return self.layout.name_set

    def has(self, layer: int, fmt: str) -> bool:
        return (layer, fmt) in self.layout.entries

    def tensor(self, layer: int, fmt: str) -> torch.Tensor:
        """The ``[64, *row]`` rows of one layer and format, in place (a view made once: the saver asks for
        it every decode step; made in one call: a restore asks for every layer of every chunk it reads)."""
        view = self._views.get((layer, fmt))
        if view is None:
            e = self.layout.entries[(layer, fmt)]
            base = self._typed.get(e.dtype)
            if base is None:
                size = e.dtype.itemsize
                base = self._typed[e.dtype] = self.data[: len(self.data) // size * size].view(e.dtype)
            start = base.storage_offset() + e.offset // e.dtype.itemsize  # offsets are 64-byte aligned
            view = self._views[(layer, fmt)] = base.as_strided(e.shape, e.strides, start)
        return view

    def spans(self, layers: tuple[int, ...], fmt: str) -> list[tuple[int, int, torch.Tensor]]:
        """The rows of format ``fmt`` of ``layers`` in as few views as the layout allows: ``(i, j, view)``,
        ``view`` ``[j - i, 64, *row]`` holding those of ``layers[i:j]``, alike and evenly spaced in the image
        (a layer-major image spaces every layer's tensors alike where the layers store the same). Layers the
        chunk does not hold are left out. Made once for each ``layers``: a saver asks every decode step."""
        spans = self._spans.get((layers, fmt))
        if spans is None:
            spans, entries, i = [], self.layout.entries, 0
            while i < len(layers):
                first = entries.get((layers[i], fmt))
                if first is None:
                    i += 1
                    continue
                j, step = i + 1, first.nbytes
                while (
                    j < len(layers)
                    and (e := entries.get((layers[j], fmt))) is not None
                    and (e.shape, e.dtype) == (first.shape, first.dtype)
                ):
                    gap = e.offset - entries[(layers[j - 1], fmt)].offset
                    if gap <= 0 or (j > i + 1 and gap != step):
                        break
                    step, j = gap, j + 1
                view = self.tensor(
                    layers[i], fmt
                )  # offsets are 64-byte aligned: ``step`` is a whole number of elements
                spans.append(
                    (
                        i,
                        j,
                        view.as_strided(
                            (j - i, *first.shape), (step // first.dtype.itemsize, *first.strides), view.storage_offset()
                        ),
                    )
                )
                i = j
            self._spans[(layers, fmt)] = spans
        return spans

    def seal(self, key: str | None = None, tokens: list[int] | None = None, parent: str = "") -> None:
        """Write the header (checksums of the rows as they are now), naming the chunk first if ``key`` is
        given: its image is then a complete file."""
        if key is not None:
            self.key, self.tokens, self.parent = key, list(tokens), parent
        data = self.data.numpy()
        self.sums = sums = {
            name: _checksum(name, data[e.offset : e.offset + e.nbytes]) for name, e in self._named_entries()
        }
        header = _header(
            self.layout.entries, self.layout.data_start, self.key, self.parent, self.tokens, self.fingerprint, sums
        )
        room = self.layout.data_start - 8
        if len(header) > room:
            raise ValueError(f"chunk header of {len(header)} bytes exceeds its {room} reserved")
        # The header length covers the padding (spaces, valid JSON), so tensors start where the layout put them.
        head = room.to_bytes(8, "little") + header + b" " * (room - len(header))
        self.data[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))

    def check(self, tokens: list[int], fingerprint: str) -> None:
        """Refuse a chunk that is not the state of ``tokens`` under ``fingerprint``."""
        if self.fingerprint != fingerprint:
            raise ChunkInvalid(f"chunk {self.key}: saved by another model (fingerprint {self.fingerprint!r})")
        if self.tokens != list(tokens):
            raise ChunkInvalid(f"chunk {self.key}: token ids differ from the request's")

    def stored_in(self, layout: ChunkLayout, meta: dict) -> bool:
        """Whether a stored chunk with this header (:func:`read_header`) holds every tensor of this sealed
        or parsed image, at the same shape, dtype and checksum; laid out alike, at the same offsets too.
        A copy whose header disagrees (damaged, or of other rows) is not this chunk."""
        try:
            sums = dict(json.loads(meta.get("xxh3", "{}")))
        except (TypeError, ValueError):
            return False
        if layout.name_set == self.names and layout.entries != self.layout.entries:
            return False
        return all(
            (other := layout.entries.get(k)) is not None
            and (other.shape, other.dtype) == (e.shape, e.dtype)
            and sums.get(self.layout.names[k]) == self.sums.get(self.layout.names[k])
            for k, e in self.layout.entries.items()
        )

    def _named_entries(self):
        return ((self.layout.names[k], e) for k, e in self.layout.entries.items())

    @classmethod
    def parse(cls, data: torch.Tensor, key: str, length: int, verify: bool = True, slot: object = None) -> "ChunkImage":
        """The chunk whose file image is ``data[:length]``, checked: header, key, layout version, length,
        and with ``verify`` every tensor's checksum. Raises :class:`ChunkInvalid`."""
        header_len = int.from_bytes(bytes(data[: min(8, length)].numpy()), "little") if length >= 8 else -1
        if not 0 <= header_len <= min(_MAX_HEADER, length - 8):
            raise ChunkInvalid(f"chunk {key}: unreadable header (bad header length)")
        layout, meta = _parse_header(bytes(data[: 8 + header_len].numpy()), key)
        if layout.nbytes != length:
            raise ChunkInvalid(f"chunk {key}: {length} bytes stored, its header describes {layout.nbytes}")
        tokens = header_tokens(meta, key)
        try:
            sums = dict(json.loads(meta.get("xxh3", "{}")))
        except (TypeError, ValueError) as exc:
            raise ChunkInvalid(f"chunk {key}: unreadable metadata ({exc})") from exc
        image = cls(data, layout, meta.get("fingerprint", ""), key, tokens, slot)
        image.parent, image.sums = meta.get("parent", ""), sums
        if verify:
            raw = data.numpy()
            for name, e in image._named_entries():
                if sums.get(name) != _checksum(name, raw[e.offset : e.offset + e.nbytes]):
                    raise ChunkInvalid(f"chunk {key}: checksum mismatch in {name}")
        return image


def _parse_header(head: bytes, key: str) -> tuple[ChunkLayout, dict]:
    """The layout and metadata of a chunk image's first bytes, checked for consistency, so that a damaged
    header is reported as :class:`ChunkInvalid` rather than failing later as a tensor view.

    The header is read as its tensors' part (``{...`` up to the metadata, parsed once per layout) and
    the metadata (``{"__metadata__": ...}``), each of which must parse alone; a header that parses so is
    the same JSON object as the whole, and one whose metadata is not last is refused."""
    try:
        header_len = int.from_bytes(head[:8], "little")
        if len(head) < 8 or header_len > _MAX_HEADER or 8 + header_len > len(head):
            raise ValueError("bad header length")
        body = head[8 : 8 + header_len]
        at = body.find(_METADATA)
        if at == 1:  # the first key: a chunk of no tensors
            tensors = b"{"
        elif at > 1 and body[at - 1 : at] == b",":
            tensors = body[: at - 1]
        else:
            raise ValueError("no metadata")
        rest = json.loads(b"{" + body[at:])
        meta = rest.pop("__metadata__")
        if rest:
            raise ValueError("tensors after the metadata")
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("metadata is not a map of strings")
        version = meta.get("layout_version", "")
        if version != str(LAYOUT_VERSION):  # before the tensors: another version may lay them out otherwise
            if not version.isdigit():
                raise ValueError(f"layout version {version!r}")  # no version at all: corrupt
            raise ChunkOtherVersion(f"chunk {key}: layout version {version!r}; this hcache reads {LAYOUT_VERSION}")
        if (8 + header_len) % _ALIGN:  # a view is taken in whole elements from an aligned start
            raise ValueError(f"tensors not {_ALIGN}-byte aligned")
        layout = _layout(tensors, 8 + header_len)
    except ChunkOtherVersion:
        raise
    except Exception as exc:  # any other parse failure is corruption
        raise ChunkInvalid(f"chunk {key}: unreadable header ({exc})") from exc
    if meta.get("key") != key:
        raise ChunkInvalid(f"chunk {key}: header names key {meta.get('key')!r}")
    return layout, meta


@functools.lru_cache(maxsize=256)
def _layout(tensors: bytes, data_start: int) -> ChunkLayout:
    """The layout that a header's tensors' part (its JSON object without the closing brace) describes;
    layouts are shared and never changed, so each is parsed once."""
    header = json.loads(tensors + b"}")
    if "__metadata__" in header:
        raise ValueError("metadata is not last")
    entries, end = {}, 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        layer, fmt = name[1:].split(".", 1)
        begin, stop = entry["data_offsets"]
        e = TensorEntry(data_start + begin, tuple(entry["shape"]), _DTYPES[entry["dtype"]])
        if begin != end or stop - begin != e.nbytes:
            raise ValueError(f"tensor {name} has inconsistent offsets")
        entries[(int(layer), fmt)] = e
        end = stop
    return ChunkLayout(entries, data_start)


def encode(chunk: Chunk) -> bytes:
    """A chunk's file image (tools and tests; the saver builds images in place)."""
    specs = [(layer, fmt, tuple(t.shape[1:]), t.dtype) for (layer, fmt), t in chunk.tensors.items()]
    layout = ChunkLayout.plan(specs, chunk.fingerprint)
    image = ChunkImage(torch.zeros(layout.nbytes, dtype=torch.uint8), layout, chunk.fingerprint)
    for (layer, fmt), t in chunk.tensors.items():
        image.tensor(layer, fmt).copy_(t)
    image.seal(chunk.key, chunk.tokens, chunk.parent)
    return bytes(image.data.numpy())


def decode(data: bytes, key: str) -> Chunk:
    """A chunk file's contents, verified (tools and tests)."""
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    image = ChunkImage.parse(buffer, key, len(data))
    tensors = {k: image.tensor(*k).clone() for k in image.layout.entries}
    return Chunk(key, image.tokens, image.fingerprint, tensors, image.parent)


def header_tokens(meta: dict, key: str) -> list[int] | None:
    """A header's token ids (None: none recorded). Raises :class:`ChunkInvalid` for any but a list of ints."""
    try:
        tokens = json.loads(meta.get("tokens", "null"))
    except (TypeError, ValueError) as exc:
        raise ChunkInvalid(f"chunk {key}: unreadable metadata ({exc})") from exc
    if tokens is not None and not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
        raise ChunkInvalid(f"chunk {key}: its token ids are not a list of integers")
    return tokens


def read_header(file: BinaryIO, key: str, length: int) -> tuple[ChunkLayout, dict]:
    """A stored chunk's layout and metadata, from its header alone; checks the header and the length."""
    head = file.read(8)
    header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 <= header_len <= _MAX_HEADER:
        raise ChunkInvalid(f"chunk {key}: unreadable header (bad header length)")
    layout, meta = _parse_header(head + file.read(header_len), key)
    if layout.nbytes != length:
        raise ChunkInvalid(f"chunk {key}: {length} bytes stored, its header describes {layout.nbytes}")
    return layout, meta
