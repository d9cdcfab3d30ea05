"""What stored state is: its formats, encodings and sources as value types, the tensors a chunk holds, and the
codec between a layer's rows and those tensors.

A chunk holds, per layer, the rows of each format saved: ``H`` (hidden states, one ``[hidden]`` vector a
token) and ``KV`` (``[2, kv_heads, head]`` a token), each in the model's dtype or in an 8-bit encoding
(codes, plus a float16 scale tensor ``"<format>.scale"``, :mod:`hcache.ops.quant`). The saving side encodes
with :func:`encode_rows`, the restoring side reads with :func:`stored_rows` and :func:`decode_rows`: one module
holds both directions, so they cannot drift apart. A chunk's own tensors say how it was encoded, so chunks
of every encoding restore on any runtime.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import NamedTuple

import torch

from ..ops.quant import ENCODINGS, SCALE_DTYPE, QuantRows, dequantise, quantise
from .chunk_key import CHUNK_TOKENS


class Format(str, Enum):
    """A stored format: what a layer's rows are. A ``str`` that prints as its value (as 3.11's ``StrEnum``),
    so it names a chunk's tensors as it is."""

    H = "H"
    KV = "KV"

    __str__ = str.__str__
    __format__ = str.__format__


# With tensor parallelism, which rank stores which rows of a chunk: each rank its own K/V heads of every chunk,
# and the rows every rank holds alike (``Format.H``, the hidden states) once, chunk ``j`` by rank ``j % size``.
# Nothing is stored twice, and a restore reads every stored byte once: an H layer reads the rank's chunks and
# the ranks gather the rest; a KV layer reads the rank's heads.
def stores(rank: int, size: int, chunk: int, fmt: str) -> bool:
    """Whether rank ``rank`` of ``size`` stores ``fmt`` rows of chunk ``chunk``."""
    return fmt != Format.H.value or chunk % size == rank


def shared_chunks(rank: int, size: int, n: int, first: int = 0) -> range:
    """Which of ``n`` chunks, from the sequence's chunk ``first`` on, rank ``rank`` stores (and reads) the
    shared rows of, counted from ``first``."""
    return range((rank - first) % size, n, size)


class Encoding(str, Enum):
    """An 8-bit stored encoding (:mod:`hcache.ops.quant`); a format not encoded is stored in the model's dtype."""

    INT8 = "int8"
    FP8 = "fp8"

    @property
    def dtype(self) -> torch.dtype:
        return ENCODINGS[self.value]


class Source(str, Enum):
    """Where a chunk came into host memory from: the host pool itself (saved there, or read by an earlier
    restore), or a store below it (its ``kind``)."""

    HOST = "host"
    DISK = "disk"
    SHARED_DISK = "shared_disk"
    REDIS = "redis"


# A recurrent layer's state after a chunk's last token (a Mamba layer's convolution and SSM state), flattened
# into the chunk's rows as float32: stored whole, never encoded, under the chunk's checksums like its rows.
STATE = "S"
STATE_DTYPE = torch.float32


def state_row_shape(numel: int) -> tuple[int]:
    """The row shape that holds a state of ``numel`` values in a chunk's rows (zero-padded at the end)."""
    return (-(-numel // CHUNK_TOKENS),)


def pack_state(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """A state's tensors as the ``[CHUNK_TOKENS, w]`` rows a chunk stores (:func:`state_row_shape`)."""
    flat = torch.cat([p.reshape(-1).to(STATE_DTYPE) for p in parts])
    (width,) = state_row_shape(flat.numel())
    return torch.nn.functional.pad(flat, (0, CHUNK_TOKENS * width - flat.numel())).view(CHUNK_TOKENS, width)


def unpack_state(rows: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """:func:`pack_state`'s inverse: the state's tensors of ``shapes``, views of ``rows``."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = rows.reshape(-1)[: sum(sizes)]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


Encodings = Mapping[str, torch.dtype]  # format -> 8-bit code dtype, for the formats stored encoded


class TensorSpec(NamedTuple):
    """One tensor of a chunk: ``[64, *shape]`` rows of ``fmt`` for ``layer``, in ``dtype``."""

    layer: int
    fmt: str
    shape: tuple[int, ...]
    dtype: torch.dtype


_BEST_8BIT = {Format.H: Encoding.FP8.value, Format.KV: Encoding.INT8.value}  # measured: docs/benchmarks.md, quality


def parse_stored_dtype(stored_dtype: str) -> dict[Format, Encoding]:
    """The formats that ``stored_dtype`` stores in an 8-bit encoding. Raises ValueError for anything but
    ``auto``, ``int8``, ``fp8``, ``8bit`` or ``H=<one of those>,KV=<one of those>``."""
    text = stored_dtype.strip().lower()
    if "=" not in text:
        names = dict(_BEST_8BIT) if text == "8bit" else dict.fromkeys(Format, text)
    else:
        names = {}
        for item in text.split(","):
            name, _, value = (part.strip() for part in item.partition("="))
            fmt = next((f for f in Format if f.value.lower() == name), None)
            if fmt is None or fmt in names:
                raise ValueError(f"{stored_dtype!r}: expected H=...,KV=... with each format once")
            names[fmt] = _BEST_8BIT[fmt] if value == "8bit" else value
    bad = sorted(set(names.values()) - {e.value for e in Encoding} - {"auto"})
    if bad:
        raise ValueError(
            f"unknown stored dtype {bad[0]!r}: expected auto, int8, fp8, 8bit, or per format as H=fp8,KV=int8"
        )
    return {fmt: Encoding(name) for fmt, name in names.items() if name != "auto"}


def code_dtypes(encodings: Mapping[Format, Encoding]) -> dict[str, torch.dtype]:
    """``encodings`` as the code dtype of each encoded format, the form the codec and the costs take."""
    return {fmt.value: encoding.dtype for fmt, encoding in encodings.items()}


def stored_encodings(stored_dtype: str) -> dict[str, torch.dtype]:
    """The code dtype of each format ``stored_dtype`` encodes (:func:`parse_stored_dtype`)."""
    return code_dtypes(parse_stored_dtype(stored_dtype))


def scale_format(fmt: str) -> str:
    """The tensor that holds the scales of ``fmt``'s 8-bit codes (``"KV"`` -> ``"KV.scale"``)."""
    return f"{fmt}.scale"


def stored_names(fmt: str, encodings: Encodings) -> frozenset[str]:
    """The tensors a chunk holds of format ``fmt``: its rows, and their scales where it is stored encoded."""
    return frozenset({fmt, scale_format(fmt)} if fmt in encodings else {fmt})


def base_format(name: str) -> str:
    """The format a stored tensor belongs to (``"KV.scale"`` -> ``"KV"``)."""
    return name.split(".", 1)[0]


def is_encoded(dtype: torch.dtype) -> bool:
    """Whether a stored tensor of ``dtype`` holds 8-bit codes (and has a scale tensor beside it)."""
    return dtype in ENCODINGS.values()


def scale_shape(row_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The per-token shape of the scales of rows of ``row_shape``: one per vector along the last dim."""
    return tuple(row_shape[:-1])


def stored_tensors(
    shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, formats: Sequence[frozenset[str]], encodings: Encodings
) -> list[TensorSpec]:
    """The tensors a chunk holds: per layer, each of its ``formats``, a token's rows of ``shapes[format]``
    (the layer above knows the model: :func:`hcache.planning.plan.row_shapes`), in ``dtype``, or, for those
    in ``encodings``, as 8-bit codes and their float16 scales."""
    tensors = []
    for layer, fs in enumerate(formats):
        for fmt in sorted(fs):
            encoding = encodings.get(fmt)
            if encoding is None:
                tensors.append(TensorSpec(layer, fmt, shapes[fmt], dtype))
            else:
                tensors += [
                    TensorSpec(layer, fmt, shapes[fmt], encoding),
                    TensorSpec(layer, scale_format(fmt), scale_shape(shapes[fmt]), SCALE_DTYPE),
                ]
    return tensors


def encode_rows(rows: dict[str, torch.Tensor], encodings: Encodings) -> dict[str, torch.Tensor]:
    """A layer's rows by format as the tensors stored: the encoded formats quantised on the rows' device,
    as codes and scales."""
    out = dict(rows)
    for fmt, encoding in encodings.items():
        if fmt in out:
            encoded = quantise(out[fmt], encoding)
            out[fmt], out[scale_format(fmt)] = encoded.codes, encoded.scale
    return out


def stored_rows(image, layer: int, fmt: str) -> torch.Tensor | QuantRows:
    """A chunk's (:class:`~hcache.storage.chunk.ChunkImage`) rows of one layer and format, in place: a
    tensor, or 8-bit codes with their scales."""
    rows = image.tensor(layer, fmt)
    return QuantRows(rows, image.tensor(layer, scale_format(fmt))) if is_encoded(rows.dtype) else rows


def decode_rows(rows: torch.Tensor | QuantRows, dtype: torch.dtype, empty: Callable | None = None) -> torch.Tensor:
    """Stored rows in the model's ``dtype``: 8-bit codes dequantised (into a tensor from ``empty(shape,
    dtype)``, if given), lossless rows as they are."""
    return dequantise(rows, dtype, empty) if isinstance(rows, QuantRows) else rows
