"""A prefix cache on the engine's device: the KV of finished sequences, kept in their blocks of the engine's
own KV cache and keyed by the chunk key chain, so a returning prefix is copied on the device instead of
restored (HCache §6.4; SGLang's radix cache and vLLM's prefix caching do the same).

- **Keep.** When a sequence finishes, the cache takes over its KV blocks instead of copying them: each of
  its full chunks not cached yet becomes an entry, under its chunk key, over the blocks its rows lie in,
  and so does its trailing partial chunk, under its parent's key, matched token by token. Blocks no entry
  needs go back to the engine. Entries count the blocks they share (a block of 128 rows holds two chunks),
  and a block is freed when its last entry goes. Kept blocks are never written again: only their owner
  could write them, and it has finished. An entry kept from a sequence that restored 8-bit state is
  lossy (its rows are, or were computed from, dequantised state), and so is every adoption of it.
- **Adopt.** A new sequence whose tokens continue a cached chain adopts the leading cached chunks (from the
  row it holds, so also in the middle of a chunk), then the cached partial chunk as far as its tokens
  match. It copies them on the device (a few TB/s on a GPU) rather than sharing the blocks, because the
  adopter writes after them and neither engine's allocator counts references. Adoption is a restore
  (``begin_restore``, one gather and scatter per layer, ``end_restore``): what is missing after it is
  restored from the store or prefilled. A key names every token before it, under the model's fingerprint
  and the namespace, so adopted state is exactly the state that prefix computes.
- **Evict.** By the :mod:`~hcache.storage.eviction` policy. ``"lru"``: least recently used first; adopting
  or keeping a chain touches its deepest entry first, so a prefix outlives its continuations. ``"cost"``:
  the chain end (an entry no cached entry continues) of least value per row and idle second, the value
  being what recomputing its rows would cost at their depth (its owner's ``value``). Only chain ends,
  unlike Pensieve, which evicts a conversation's leading tokens first: an adoption stops at the first
  missing chunk, so a prefix evicted before its continuations would strand them. Eviction runs when the engine needs blocks for running work (the
  serving engine reports cached blocks as free, and makes room before each put). An entry being adopted
  is pinned and never evicted; running sequences own their own blocks, so eviction never touches them.
  Evicting costs no state: the chunk is in the store too.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..engine.interface import Engine
from ..ops.paged_kv import flat_slots
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain
from ..storage.eviction import check_policy, victim
from ..transfer.saver import PartialChunk


@dataclass
class _Entry:
    key: str
    tokens: list[int]  # 64 for a full chunk, fewer for a partial one
    blocks: list[int]
    offset: int  # the entry's first row in its first block
    parent: str | None  # the key of the entry it continues (None: the chain's first)
    value: float  # what keeping it saves (cost-aware eviction)
    partial: PartialChunk | None = (
        None  # a partial chunk's saver state (ChunkSaver.close), resumed by its first adopter
    )
    pins: int = 0
    lossy: bool = False  # kept from a sequence that restored state stored in 8 bits
    last_used: float = 0.0


@dataclass
class Adoption:
    """What a sequence adopts: ``(entry, first row, end row)`` pieces of cached chunks, in order, pinned
    until :meth:`GpuPrefixCache.unpin`."""

    pieces: list[tuple[_Entry, int, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(hi - lo for _, lo, hi in self.pieces)

    @property
    def lossy(self) -> bool:
        return any(entry.lossy for entry, _, _ in self.pieces)

    @property
    def partial(self) -> tuple[PartialChunk, int] | None:
        """The saver state of the partial chunk adopted last, and its rows, if it has one still."""
        entry, _, hi = self.pieces[-1] if self.pieces else (None, 0, 0)
        return (entry.partial, hi) if entry is not None and entry.partial is not None else None


def partial_key(parent: str) -> str:
    """The key of the partial chunk that follows the chunk keyed ``parent`` (or the chain's root)."""
    return f"{parent}+partial"


class GpuPrefixCache:
    """Chunks of finished sequences held in ``engine``'s spare KV blocks. ``drop_partial`` gives back a
    partial chunk's saver state when its entry goes. ``eviction``: the policy; ``value(start, tokens)``:
    what keeping the rows of ``tokens`` tokens from position ``start`` saves, for ``"cost"``. Counters:
    ``hit_tokens`` and ``miss_tokens`` of the tokens looked up, ``evictions`` of entries."""

    def __init__(
        self,
        engine: Engine,
        drop_partial: Callable[[PartialChunk], None] = lambda partial: None,
        *,
        eviction: str = "lru",
        value: Callable[[int, int], float] = lambda start, tokens: float(tokens),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine, self._drop_partial = engine, drop_partial
        self.eviction, self._value, self._clock = check_policy(eviction), value, clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._refs: Counter[int] = Counter()  # block -> entries holding it
        self._children: Counter[str] = Counter()  # key -> cached entries that continue it
        self.hit_tokens = self.miss_tokens = self.evictions = 0

    @property
    def blocks(self) -> int:
        return len(self._refs)

    @property
    def evictable_blocks(self) -> int:
        """Blocks that evicting every unpinned entry would free."""
        pinned = {b for e in self._entries.values() if e.pins for b in e.blocks}
        return len(self._refs.keys() - pinned)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    # ---- keep -----------------------------------------------------------------------------------------
    def keep(
        self, blocks: list[int], chain: KeyChain, seen: int, partial: PartialChunk | None = None, lossy: bool = False
    ) -> None:
        """Take over a finished sequence's KV ``blocks`` (:meth:`Engine.detach`), which hold the first ``seen``
        tokens of ``chain``, all of them computed or restored: its chunks not cached yet become entries, and
        the blocks they do not need go back to the engine. ``partial``: the saver state of its trailing
        partial chunk, owned by the cache from now on; ``lossy``: the sequence restored 8-bit state."""
        full = min(len(chain.chunks), seen // CHUNK_TOKENS)
        pieces = [(key, i * CHUNK_TOKENS, tokens) for i, (key, tokens) in enumerate(chain.chunks[:full])]
        if chain.tail and full == len(chain.chunks) and seen == full * CHUNK_TOKENS + len(chain.tail):
            pieces.append((partial_key(chain.key), seen - len(chain.tail), chain.tail))  # it holds exactly the chain
        size, kept, parent = self.engine.block_size, [], None
        try:
            for key, start, tokens in pieces:
                entry = self._entries.get(key)
                if entry is None or entry.tokens[: len(tokens)] != tokens or len(entry.tokens) < len(tokens):
                    if entry is not None:  # a partial chunk that another continuation of the same parent replaces
                        if entry.pins:
                            break
                        self._evict(key)
                    first, end = start // size, -(-(start + len(tokens)) // size)
                    entry = self._entries[key] = _Entry(
                        key,
                        list(tokens),
                        blocks[first:end],
                        start - first * size,
                        parent,
                        self._value(start, len(tokens)),
                        lossy=lossy,
                    )
                    self._refs.update(entry.blocks)
                    if parent is not None:
                        self._children[parent] += 1
                kept.append(entry)
                parent = key
                if key == partial_key(chain.key) and entry.partial is None:
                    entry.partial, partial = partial, None
        finally:
            self.engine.release_blocks([b for b in blocks if b not in self._refs])
            self._touch(kept)
            if partial is not None:
                self._drop_partial(partial)

    # ---- adopt ----------------------------------------------------------------------------------------
    def match(self, tokens: list[int], keys: list[str], parent: str, held: int, limit: int) -> Adoption:
        """What a sequence can adopt of ``tokens`` (from a chunk boundary; ``keys`` their full chunks' keys,
        ``parent`` the key before them), given that it holds the first ``held`` and wants at most the first
        ``limit``. The entries are pinned."""
        adoption, pos = Adoption(), 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or pos >= limit:
                break
            adoption.pieces.append((entry, 0, min(CHUNK_TOKENS, limit - pos)))
            pos, parent = pos + CHUNK_TOKENS, key
        entry = self._entries.get(partial_key(parent)) if pos < limit else None
        if entry is not None:
            same = next((i for i, (a, b) in enumerate(zip(entry.tokens, tokens[pos:limit])) if a != b), None)
            rows = min(len(entry.tokens), limit - pos) if same is None else same
            if rows:
                adoption.pieces.append((entry, 0, rows))
        adoption.pieces = [(e, max(lo, held - i * CHUNK_TOKENS), hi) for i, (e, lo, hi) in enumerate(adoption.pieces)]
        adoption.pieces = [(e, lo, hi) for e, lo, hi in adoption.pieces if hi > lo]
        for entry, _, _ in adoption.pieces:
            entry.pins += 1
        found = adoption.tokens
        self.hit_tokens += found
        self.miss_tokens += max(limit - held, 0) - found
        return adoption

    def truncate(self, adoption: Adoption, tokens: int) -> None:
        """Adopt only the first ``tokens`` (tensor-parallel ranks agree on the least); the rest is unpinned."""
        kept, left = [], tokens
        for entry, lo, hi in adoption.pieces:
            if left > 0:
                kept.append((entry, lo, lo + min(hi - lo, left)))
            else:
                entry.pins -= 1
            left -= hi - lo
        self.hit_tokens -= adoption.tokens - min(tokens, adoption.tokens)
        self.miss_tokens += adoption.tokens - min(tokens, adoption.tokens)
        adoption.pieces = kept

    @torch.no_grad()
    def adopt(self, uid: int, adoption: Adoption, tokens: list[int]) -> None:
        """Copy the pieces into sequence ``uid``, after what it holds; ``tokens`` are theirs."""
        engine = self.engine
        engine.begin_restore(uid, len(tokens))
        # the slots on the host, then one transfer: no per-chunk copies or kernels on the device
        slots = [
            flat_slots(e.blocks, e.offset + lo, e.offset + hi, engine.block_size, "cpu")
            for e, lo, hi in adoption.pieces
        ]
        engine.restore_from_slots(uid, torch.cat(slots).to(engine.device))
        engine.end_restore(uid, tokens)
        self._touch([entry for entry, _, _ in adoption.pieces])

    def take_partial(self, adoption: Adoption) -> tuple[PartialChunk, int] | None:
        """The saver state of the partial chunk ``adoption`` ends in, for the adopter to resume (once)."""
        found = adoption.partial
        if found is not None:
            adoption.pieces[-1][0].partial = None
        return found

    def unpin(self, adoption: Adoption) -> None:
        for entry, _, _ in adoption.pieces:
            entry.pins -= 1
        adoption.pieces = []

    # ---- evict ----------------------------------------------------------------------------------------
    def make_room(self, blocks: int) -> bool:
        """Evict unpinned entries, by the policy, until the engine has ``blocks`` free; whether it has."""
        while _free(self.engine) < blocks:
            key = self._victim()
            if key is None:
                return False
            self._evict(key)
        return True

    def _victim(self) -> str | None:
        """The unpinned entry the policy gives up first: under ``"cost"`` a chain end if one is unpinned (the
        rest only when adoptions pin every end), its size in rows (every row holds as many bytes)."""
        idle = [e for e in self._entries.values() if not e.pins]
        if self.eviction == "cost":
            idle = [e for e in idle if not self._children[e.key]] or idle
        return victim(self.eviction, ((e.key, e.value, len(e.tokens), e.last_used) for e in idle), self._clock())

    def clear(self) -> None:
        """Evict every unpinned entry."""
        for key in [k for k, e in self._entries.items() if not e.pins]:
            self._evict(key)

    def _evict(self, key: str) -> None:
        entry = self._entries.pop(key)
        if entry.parent is not None:
            self._children[entry.parent] -= 1
            if not self._children[entry.parent]:
                del self._children[entry.parent]
        self._refs.subtract(entry.blocks)
        freed = [b for b in entry.blocks if self._refs[b] <= 0]
        for block in freed:
            del self._refs[block]
        self.engine.release_blocks(freed)
        self.evictions += 1
        if entry.partial is not None:
            self._drop_partial(entry.partial)

    def _touch(self, entries: list[_Entry]) -> None:
        """Mark a chain's entries (shallow first) used now, its deepest least recently."""
        now = self._clock()
        for entry in reversed(entries):
            if self._entries.get(entry.key) is entry:
                self._entries.move_to_end(entry.key)
                entry.last_used = now


def _free(engine: Engine) -> int:
    return int(min(torch.as_tensor(engine.free_blocks).tolist()))
