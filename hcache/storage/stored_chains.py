"""The chains the stores hold, read from their chunks' headers, and their changes as the stores tell them: what
a node tells it can load (:meth:`~hcache.storage.host_tier.HostTier.follow`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from .chunk import ChunkInvalid, ChunkLayout, header_tokens
from .chunk_store import ChunkStore, Sight
from .residency import Residency


def stored_chunk(tier: str, key: str, header: tuple[ChunkLayout, dict]) -> Residency | None:
    """Chunk ``key`` held in ``tier``, placed in its chain by its ``header`` (which layers it holds too); None
    where its token ids cannot be read (a read of it would find it bad) or none were recorded (it cannot be
    placed)."""
    layout, meta = header
    try:
        tokens = header_tokens(meta, key)
    except ChunkInvalid:
        return None
    if tokens is None:
        return None
    return Residency(key, tier, True, tuple(tokens), meta.get("parent", ""), layers=layout.layers)


def stored_chunks(store: ChunkStore) -> list[Residency]:
    """What ``store`` holds now, parents before the chunks that continue them, read from their headers (one
    read a chunk). A chunk whose header or token ids cannot be read is left out: a read of it would find it
    bad, and one with no token ids cannot be placed in a chain."""
    chunks: dict[str, Residency] = {}
    for key in store.keys():
        header = store.header(key)
        held = stored_chunk(store.kind, key, header) if header is not None else None
        if held is not None:
            chunks[key] = held
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


def follow_stores(
    stores: Sequence[ChunkStore], tell: Callable[[Residency], None], told: Callable[[Residency], None]
) -> set[str]:
    """Follow ``stores``: ``tell`` at once the chains of each that only this node changes (a restart finds
    them), and ``told`` each change that a store others change sees, from its watch's thread (a chunk whose
    header cannot place it is left out). The kinds of the first: their later changes are this node's to tell."""

    def stored(kind: str, key: str, header: tuple[ChunkLayout, dict]) -> None:
        held = stored_chunk(kind, key, header)
        if held is not None:
            told(held)

    own = set()
    for store in stores:
        kind = store.kind
        sight = store.watch(
            partial(stored, kind), lambda key, why, kind=kind: told(Residency(key, kind, False, why=why))
        )
        if sight is Sight.OWN:
            own.add(kind)
            for change in stored_chunks(store):
                tell(change)
    return own
