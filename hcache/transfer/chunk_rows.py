"""A save's chunks in the making, and the copies that land a batch's rows in them.

A segment of a batch reaches one or more chunks of its sequence: each reach is a piece (:func:`split`), and
each format's rows of a run of layers go to every piece's chunk in one batched copy (:func:`copy_rows`): at a
decode step, where each sequence computes a row, a copy per sequence and layer would cost more in calls than
in bytes. A staged chunk (on a GPU) is filled on the rows' device and crosses to its slot once, whole
(:func:`unstage`).
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..storage.chunk import ChunkImage
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain


@dataclass
class Chunk:
    """A chunk in the making: its slot's image, and how far its rows have come."""

    index: int  # in the sequence
    image: ChunkImage | None  # None: not saved (the pool had no room, or its first rows were restored)
    expected: int = 0  # the row the next computed rows of this chunk must start at
    filled: int = 0  # rows that have landed
    staged: ChunkImage | None = None  # staging only: the image on the device, copied to ``image`` when full
    vouchers: list[torch.Tensor] = field(default_factory=list)  # must all hold for it to publish (``vouch``)
    states: set[int] = field(default_factory=set)  # layers whose state at its end is in (``ChunkSaver.keep_state``)


@dataclass
class SavedSequence:
    """A sequence being saved: its key chain, and its chunks not yet published."""

    uid: int
    chain: KeyChain
    chunks: dict[int, Chunk] = field(default_factory=dict)  # by the chunk's index in the sequence
    in_flight: list[Future] = field(default_factory=list)  # stage 2 of batches not yet landed (GPU)
    broken: bool = False  # a forward pass failed mid-batch: its rows are incomplete, publish nothing more


@dataclass
class Piece:
    """One segment's rows in one chunk: ``n`` rows from batch row ``row`` to chunk row ``offset``."""

    seq: SavedSequence
    chunk: Chunk
    offset: int
    row: int
    n: int


def split(pos: int, row: int, length: int):
    """``(chunk index, offset in the chunk, batch row, rows)`` of each chunk a segment reaches."""
    while length:
        index, offset = divmod(pos, CHUNK_TOKENS)
        n = min(length, CHUNK_TOKENS - offset)
        yield index, offset, row, n
        pos, row, length = pos + n, row + n, length - n


def copy_rows(
    pieces: list[Piece], layers: tuple[int, ...], fmt: str, src: torch.Tensor, *, stage: bool, fingerprint: str
) -> None:
    """The rows of ``layers`` (``src[k]``: ``layers[k]``'s) into each piece's chunk: with ``stage``, its staged
    image on the rows' device (made on the first rows), else its slot; a piece's rows of layers evenly spaced in
    its chunk in one copy, and every piece's in one call."""
    dst, rows = [], []
    for p, piece in zip(pieces, _pieces(pieces, src)):
        chunk = p.chunk
        if chunk.image is None:
            continue
        spans = chunk.image.spans(layers, fmt)
        if spans and stage:
            spans = _staged(chunk, src.device, fingerprint).spans(layers, fmt)
        for i, j, view in spans:
            dst.append(view[:, p.offset : p.offset + p.n])
            rows.append(piece if (i, j) == (0, len(layers)) else piece[i:j])
    if dst:
        torch._foreach_copy_(dst, rows, non_blocking=True)  # one call for the batch's pieces


def copy_state(chunk: Chunk, layer: int, fmt: str, rows: torch.Tensor, *, stage: bool, fingerprint: str) -> None:
    """A layer's state at the chunk's end (its whole tensor of ``fmt``) into the chunk, as :func:`copy_rows`
    copies rows: into its staged image on the rows' device, with ``stage``, else its slot."""
    image = _staged(chunk, rows.device, fingerprint) if stage else chunk.image
    image.tensor(layer, fmt).copy_(rows, non_blocking=True)
    chunk.states.add(layer)


def _staged(chunk: Chunk, device: torch.device, fingerprint: str) -> ChunkImage:
    """The chunk's staged image on ``device``, made on its first rows (one per chunk, from the caching allocator)."""
    if chunk.staged is None:
        data = torch.empty(chunk.image.layout.nbytes, dtype=torch.uint8, device=device)
        chunk.staged = ChunkImage(data, chunk.image.layout, fingerprint)
    return chunk.staged


def _pieces(pieces: list[Piece], src: torch.Tensor) -> list[torch.Tensor]:
    """Each piece's rows of ``src`` (``[layers, T, *row]``), cut in one call rather than a slice each."""
    cuts = sorted({0, src.shape[1]} | {p.row for p in pieces} | {p.row + p.n for p in pieces})
    parts = dict(zip(cuts, src.split([b - a for a, b in itertools.pairwise(cuts)], dim=1)))  # pieces never overlap
    return [parts[p.row] for p in pieces]


def unstage(chunks: list[Chunk]) -> None:
    """Copy full staged chunks to their host slots, each in one copy of its tensors' bytes."""
    if not chunks:
        return
    spans = [slice(c.image.layout.data_start, c.image.layout.nbytes) for c in chunks]
    torch._foreach_copy_(
        [c.image.data[b] for c, b in zip(chunks, spans)],
        [c.staged.data[b] for c, b in zip(chunks, spans)],
        non_blocking=True,
    )
    for c in chunks:
        c.staged = None
