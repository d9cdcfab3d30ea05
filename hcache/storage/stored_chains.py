"""The chains a store holds, read from its chunks' headers: what a restarted node tells it can load
(:meth:`~hcache.storage.host_tier.HostTier.follow`)."""

from __future__ import annotations

from .chunk import ChunkInvalid, header_tokens
from .chunk_store import ChunkStore
from .residency import Residency


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
            parent = header[1].get("parent", "")
            chunks[key] = Residency(key, store.kind, True, tuple(tokens), parent, layers=header[0].layers)
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
