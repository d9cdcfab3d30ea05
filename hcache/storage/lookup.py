"""Which chunks a store holds, asked by a process that does not own the store.

A store's directories belong to the one process that opened them (:mod:`.dir_lock`), and its host pool is
that process's memory. Another process on the node may still need to know what is stored: vLLM's
scheduler, for one, decides how many of a prompt's tokens to load before its worker, which owns the store,
loads them (it asks here only past what the worker has reported holding). It looks at the chunk files and
asks the Redis tiers, taking no lock and changing nothing, and stops at the first chunk no tier holds. A
chunk seen here may be gone or bad when the owner reads it: the owner verifies every chunk it loads, and
the asker must accept that a load can fall short.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .store_dir import chunk_path

if TYPE_CHECKING:  # its owner builds the tiers; the asker need not import torch for the chunk format
    from .redis_store import RedisChunkStore


class StoreLookup:
    """``dirs``: the local and shared store directories, ``redis``: the Redis tiers."""

    def __init__(self, dirs: Sequence[Path], redis: Sequence[RedisChunkStore]):
        self.dirs, self.redis = list(dirs), list(redis)

    def stored_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, some tier holds: a file look-up per chunk until one is not
        in a directory, then one batched question to each Redis tier for the rest."""
        n = 0
        while n < len(keys):
            if any(chunk_path(d, keys[n]).is_file() for d in self.dirs):
                n += 1
                continue
            rest = list(keys[n:])
            held = [False] * len(rest)
            for store in self.redis:
                held = [h or hit for h, hit in zip(held, store.contains_many(rest))]
            run = next((i for i, hit in enumerate(held) if not hit), len(rest))
            if not run:
                return n
            n += run
        return n

    @property
    def available(self) -> bool:
        """Whether every Redis tier answered its last question."""
        return all(store.available for store in self.redis)

    def close(self) -> None:
        for store in self.redis:
            store.close()
