"""What this node's stores hold, told as vLLM's KV cache events, so that a router scores it as it scores
vLLM's own cache (``--kv-events-config``): a ``stored`` event for blocks that a load would find, a
``removed`` event when they leave, ``cleared`` once at start (the host pool of the engine before is gone).

Blocks are vLLM's: hashed at vLLM's hash block size with the engine's own hash function, seed and
``cache_salt`` (the connector hands in ``hash_block``), so a router's keys match. A chunk's rows are
64 tokens; a block is announced on a medium when every chunk it overlaps is held there by every rank. The
media are vLLM's names: ``CPU`` for the host pool, ``STORAGE`` for the stores below it (the local disk,
a shared directory, Redis), held while any of them holds it. A chunk whose chain this side cannot place
(its parent never seen, or a first chunk under a ``cache_salt`` no request here has used) is not
announced: the events name only blocks a load would find.

The workers tell each change of where a chunk is held (:class:`~hcache.storage.residency.Residency`),
with its tokens and parent; this module imports neither torch nor vLLM, as the rest of the scheduler's
side.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..storage.chunk_key import next_key, root_key
from ..storage.residency import HOST, Residency

CPU, STORAGE = "CPU", "STORAGE"  # vLLM's MEDIUM_CPU and MEDIUM_STORAGE
SALTS_KEPT = 1024  # roots of the latest cache_salts used (one per rank each), whose chunks the events can place


def medium(tier: str) -> str:
    return CPU if tier == HOST else STORAGE


@dataclass(frozen=True)
class Block:
    hash: object
    parent: object | None  # the block hash before it (None: the first block)
    tokens: tuple[int, ...]
    salt: str | None  # the request's cache_salt, which vLLM hashes into the first block only


@dataclass(frozen=True)
class Stored:
    blocks: tuple[Block, ...]
    medium: str


@dataclass(frozen=True)
class Removed:
    hashes: tuple[object, ...]
    medium: str


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared
HashBlock = Callable[[object | None, Sequence[int], str | None], object]  # (parent hash, tokens, salt)


@dataclass
class _Chunk:
    """A chunk's place in vLLM's block chain, the same on every rank (each rank's own key names it). Token
    ids are kept packed: an index of a large disk holds one of these a chunk."""

    identity: tuple
    end: int  # tokens up to its end
    last: object | None  # the hash of the last full block at or before its end
    carry: array  # the tokens after that block: the start of a block a later chunk ends
    salt: str | None
    hashes: tuple[object, ...]  # the blocks that end in it
    first_parent: object | None  # the hash of the block before the first of them
    tokens: array  # theirs
    span: tuple[tuple, ...]  # the chunks its blocks overlap, itself first
    parent: tuple | None  # the chunk before it
    keys: dict[str, set[str]] = field(default_factory=dict)  # each rank's key, and the tiers holding it
    announced: set[str] = field(default_factory=set)  # media its blocks are announced on

    def blocks(self, size: int) -> tuple[Block, ...]:
        parents = (self.first_parent, *self.hashes[:-1])
        return tuple(
            Block(h, p, tuple(self.tokens[i * size : (i + 1) * size]), self.salt)
            for i, (h, p) in enumerate(zip(self.hashes, parents))
        )


def _identity(end: int, last: object | None, carry: array, salt: str | None) -> tuple:
    """Past the first block the hashes hold the salt, and the carry's digest its tokens."""
    return (end, last, hashlib.blake2b(carry.tobytes(), digest_size=16).digest(), salt if last is None else None)


class Roots:
    """Where this node's chains start, for :class:`BlockEvents`' ``first``: each rank's ``fingerprints`` under
    the deployment's ``namespace`` (a request with no ``cache_salt``: announced with none), and under the
    latest ``cache_salt`` values requests gave (:meth:`salted`; ``kept`` roots, one per rank for each salt;
    announced with it, as vLLM hashes it into a request's first block). A chunk under an older salt, or one
    no request here used, is not placed. The one rule of the vLLM connector's scheduler and of ``hcache serve``'s
    publisher (:mod:`hcache.vllm.publisher`), where requests are noted on the serving loop's thread and
    placed on the publisher's: a lock keeps the two apart."""

    def __init__(self, fingerprints: Sequence[str], namespace: str | None, kept: int = SALTS_KEPT):
        self._fingerprints, self._kept = tuple(fingerprints), kept
        self._roots = {root_key(fp, namespace): None for fp in self._fingerprints}
        self._salted: OrderedDict[str, str] = OrderedDict()  # the latest cache_salts' roots
        self._lock = threading.Lock()

    def salted(self, salt: str) -> None:
        """A request keyed under its own ``cache_salt``: the chains rooted in it can be placed."""
        roots = [root_key(fp, salt) for fp in self._fingerprints]
        with self._lock:
            for root in roots:
                self._salted[root] = salt
                self._salted.move_to_end(root)
            while len(self._salted) > self._kept:
                self._salted.popitem(last=False)

    def __call__(self, key: str, tokens: Sequence[int]) -> tuple[bool, str | None]:
        """Whether ``key`` is a first chunk of ``tokens`` under a root known here, and that root's cache_salt."""
        with self._lock:
            roots = [*self._roots.items(), *reversed(self._salted.items())]
        return next(((True, salt) for root, salt in roots if next_key(root, tokens) == key), (False, None))


class BlockEvents:
    """``hash_block``: vLLM's block hash; ``block_size``: vLLM's hash block; ``ranks``: the workers, each
    keying its own chunks; ``first``: for a first chunk's key and tokens, whether it is rooted here and
    under which ``cache_salt`` (None: the deployment's namespace)."""

    def __init__(
        self,
        hash_block: HashBlock,
        block_size: int,
        ranks: int,
        first: Callable[[str, Sequence[int]], tuple[bool, str | None]],
    ):
        self.hash_block, self.block_size, self.ranks, self.first = hash_block, block_size, ranks, first
        self.unplaced = 0  # chunks held whose chain is not known here: not announced
        self._chunks: dict[tuple, _Chunk] = {}
        self._keys: dict[str, tuple] = {}  # each rank's chunk key -> the chunk's identity
        self._covers: dict[tuple, set[tuple]] = {}  # a chunk -> the chunks whose blocks overlap it
        self._events: list[Event] = [Cleared()]

    def apply(self, changes: Iterable[Residency]) -> None:
        for change in changes:
            chunk = self._place(change) if change.held else self._chunks.get(self._keys.get(change.key, ()))
            if chunk is None:
                continue
            tiers = chunk.keys.setdefault(change.key, set())
            (tiers.add if change.held else tiers.discard)(change.tier)
            if not tiers:
                del chunk.keys[change.key], self._keys[change.key]
            self._update(chunk.identity, medium(change.tier))
            if not chunk.keys and not chunk.announced:
                self._forget(chunk)

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _place(self, change: Residency) -> _Chunk | None:
        """The chunk ``change`` names, placed in its chain (None where it cannot be)."""
        known = self._chunks.get(self._keys.get(change.key, ()))
        if known is not None:
            return known
        parent = self._chunks.get(self._keys.get(change.parent, ())) if change.parent else None
        if change.parent and parent is None:
            self.unplaced += 1
            return None
        if parent is None:
            rooted, salt = self.first(change.key, change.tokens)
            if not rooted:
                self.unplaced += 1
                return None
            end, last, carry = 0, None, array("q")
        else:
            end, last, carry, salt = parent.end, parent.last, parent.carry, parent.salt
        tokens, size, first_parent = carry + array("q", change.tokens), self.block_size, last
        hashes = []
        for at in range(0, len(tokens) - size + 1, size):
            last = self.hash_block(last, tokens[at : at + size].tolist(), salt if last is None else None)
            hashes.append(last)
        owned = len(hashes) * size
        end += len(change.tokens)
        identity = _identity(end, last, tokens[owned:], salt)
        chunk = self._chunks.get(identity)
        if chunk is None:  # the chunks its blocks overlap: back to where the first of them starts
            start, span, at = end - len(tokens), [identity], parent
            while at is not None and at.end > start:
                span.append(at.identity)
                at = self._chunks.get(at.parent) if at.parent is not None else None
            chunk = _Chunk(
                identity,
                end,
                last,
                tokens[owned:],
                salt,
                tuple(hashes),
                first_parent,
                tokens[:owned],
                tuple(span),
                parent and parent.identity,
            )
            self._chunks[identity] = chunk
            for overlapped in span:
                self._covers.setdefault(overlapped, set()).add(identity)
        self._keys[change.key] = identity
        return chunk

    def _forget(self, chunk: _Chunk) -> None:
        del self._chunks[chunk.identity]
        for overlapped in chunk.span:
            owners = self._covers.get(overlapped, set())
            owners.discard(chunk.identity)
            if not owners:
                self._covers.pop(overlapped, None)

    def _held(self, identity: tuple, on: str) -> bool:
        chunk = self._chunks.get(identity)
        holding = 0 if chunk is None else sum(any(medium(t) == on for t in tiers) for tiers in chunk.keys.values())
        return holding >= self.ranks

    def _update(self, changed: tuple, on: str) -> None:
        for identity in self._covers.get(changed, ()):
            owner = self._chunks[identity]
            if not owner.hashes:
                continue
            whole = all(self._held(i, on) for i in owner.span)
            if whole and on not in owner.announced:
                owner.announced.add(on)
                self._events.append(Stored(owner.blocks(self.block_size), on))
            elif not whole and on in owner.announced:
                owner.announced.discard(on)
                self._events.append(Removed(owner.hashes, on))
