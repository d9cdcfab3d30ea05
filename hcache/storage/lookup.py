"""Which chunks a store holds, asked by a process that does not own the store.

A store's directories belong to the one process that opened them (:mod:`.dir_lock`), and its host pool is
that process's memory. Another process on the node may still need to know what is stored: vLLM's
scheduler, for one, decides how many of a prompt's tokens to load before its worker, which owns the store,
loads them. It looks at the chunk files and asks the Redis tiers, taking no lock and changing nothing. A
chunk still only in the owner's host pool is not seen (it is written back within moments), and a chunk
seen here may be gone or bad when the owner reads it: the owner verifies every chunk it loads, and the
asker must accept that a load can fall short.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .disk_store import chunk_path
from .redis_store import RedisChunkStore


class StoreLookup:
    """``dirs``: the local and shared store directories, ``redis``: the Redis tiers."""

    def __init__(self, dirs: Sequence[Path], redis: Sequence[RedisChunkStore]):
        self.dirs, self.redis = list(dirs), list(redis)

    def stored_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, some tier holds."""
        missing = [i for i, key in enumerate(keys) if not any(chunk_path(d, key).is_file() for d in self.dirs)]
        for store in self.redis:
            if not missing:
                break
            hits = store.contains_many([keys[i] for i in missing])
            missing = [i for i, hit in zip(missing, hits) if not hit]
        return missing[0] if missing else len(keys)

    def close(self) -> None:
        for store in self.redis:
            store.close()
