"""With tensor parallelism, which rank stores which rows of a chunk, in the storage layer's terms: each rank
its own K/V heads of every chunk, and the rows every rank holds alike (``Format.H``, the hidden states)
once, chunk ``j`` by rank ``j % size``. Nothing is stored twice, and a restore reads every stored byte once:
an H layer reads the rank's chunks and the ranks gather the rest; a KV layer reads the rank's heads."""

from __future__ import annotations

from .stored_state import Format


def stores(rank: int, size: int, chunk: int, fmt: str) -> bool:
    """Whether rank ``rank`` of ``size`` stores ``fmt`` rows of chunk ``chunk``."""
    return fmt != Format.H.value or chunk % size == rank


def shared_chunks(rank: int, size: int, n: int, first: int = 0) -> range:
    """Which of ``n`` chunks, from the sequence's chunk ``first`` on, rank ``rank`` stores (and reads) the
    shared rows of, counted from ``first``."""
    return range((rank - first) % size, n, size)
