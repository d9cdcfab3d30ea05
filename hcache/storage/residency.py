"""Where a chunk is held, as it changes: the host pool or one of the stores below it. What a process that
does not own the tiers follows to tell others what this node can load (vLLM's KV events,
:mod:`hcache.vllm.events`), and what its index of loadable chunks is kept by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .chunk import ChunkInvalid, header_tokens
from .chunk_store import ChunkStore, Loss

HOST = "host"  # the host pool's tier; a store's is its ``kind`` (:class:`~.stored_state.Source`)


@dataclass(frozen=True)
class Residency:
    """``key`` entered (``held``) or left ``tier``. An entry carries the chunk's ``tokens`` and ``parent``
    (where it sits in its chain); a departure says why (``None``: the pool made room, the stores keep it)."""

    key: str
    tier: str
    held: bool
    tokens: tuple[int, ...] = ()
    parent: str = ""
    why: Loss | None = None


class Followers:
    """Those told of a host tier's changes; calling it tells each."""

    def __init__(self) -> None:
        self._tells: list[Callable[[Residency], None]] = []

    def add(self, tell: Callable[[Residency], None]) -> None:
        self._tells.append(tell)

    def __call__(self, change: Residency) -> None:
        for tell in self._tells:
            tell(change)


def pool_changes(changed: Callable[[str, Loss | None], None]) -> Callable[[Residency], None]:
    """``changed(key, None)`` for a chunk entering the pool, ``changed(key, FAILED_VERIFICATION)`` for one
    discarded as bad: what an index of loadable chunks follows (a chunk the pool made room of is still
    in the stores)."""

    def noted(change: Residency) -> None:
        if change.tier == HOST and (change.held or change.why is Loss.FAILED_VERIFICATION):
            changed(change.key, change.why)

    return noted


def stored_chunks(store: ChunkStore) -> list[Residency]:
    """What ``store`` holds now, parents before the chunks that continue them, read from their headers (one
    read a chunk). A chunk whose header or token ids cannot be read is left out: a read of it would find it
    bad, and one with no token ids cannot be placed in a chain."""
    chunks: dict[str, Residency] = {}
    for key in store.keys():
        header = store.header(key)
        try:
            tokens = header_tokens(header[1], key) if header is not None else None
        except ChunkInvalid:
            continue
        if tokens is not None:
            chunks[key] = Residency(key, store.kind, True, tuple(tokens), header[1].get("parent", ""))
    depth: dict[str, int] = {}

    def depth_of(key: str) -> int:
        chain = []
        while key in chunks and key not in depth and key not in chain:
            chain.append(key)
            key = chunks[key].parent
        below = depth.get(key, -1)
        for k in reversed(chain):
            below = depth[k] = below + 1
        return below

    return sorted(chunks.values(), key=lambda c: depth_of(c.key))
