"""What this node's stores hold, told as vLLM's KV cache events, so that a router scores it as it scores
vLLM's own cache (``--kv-events-config``): a ``stored`` event for blocks that a load would find, a
``removed`` event when they leave, ``cleared`` once at start (the host pool of the engine before is gone).

Blocks are vLLM's, in each of its KV cache groups (:class:`Group`), named as vLLM's own events name them:
a group's blocks are of its own size, each named by the hash of the hash block it ends with (vLLM's
``BlockHashListWithBlockSize``), hashed at vLLM's hash block size with the engine's own hash function, seed
and ``cache_salt`` (the connector hands in ``hash_block``), so a router's keys match. A chunk's rows are
64 tokens; a group's block is announced on a medium when every chunk that a load of it reads holds that
group's layers there, on every rank, and removed as soon as one no longer does. A group whose layers every
chunk keeps reads the chunks the block overlaps; a sliding-window group under hcache's window rule, whose
saves keep the last window only, reads the window a load reads for a router's hit whose window the block
begins; a recurrent group, whose state is kept at checkpoints only, the chunk at the block's end, which
holds the state. So a router that takes a hit as vLLM takes its own (a prefix of every group's blocks, the
last window's blocks of a sliding group, a state's block at its end) finds no more whole chunks than a load
restores.

The media are vLLM's names: ``CPU`` for the host pool, ``STORAGE`` for the stores below it (the local disk,
a shared directory, Redis), held while any of them holds it. A chunk whose chain this side cannot place
(its parent never seen, or a first chunk under a ``cache_salt`` no request here has used) is not
announced: the events name only blocks a load would find.

The workers tell each change of where a chunk is held (:class:`~hcache.storage.residency.Residency`),
with its tokens, parent and layers; this module imports neither torch nor vLLM, as the rest of the
scheduler's side.
"""

from __future__ import annotations

import hashlib
import math
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from ..storage.chunk_key import CHUNK_TOKENS, next_key, root_key
from ..storage.residency import HOST, Kept, Residency

CPU, STORAGE = "CPU", "STORAGE"  # vLLM's MEDIUM_CPU and MEDIUM_STORAGE
SALTS_KEPT = 1024  # roots of the latest cache_salts used (one per rank each), whose chunks the events can place


def medium(tier: str) -> str:
    return CPU if tier == HOST else STORAGE


@dataclass(frozen=True)
class Group:
    """One of vLLM's KV cache groups, as its events name it: ``index`` (``group_idx``), ``block_size`` (a
    multiple of the hash block), vLLM's ``kind`` and ``window`` (``kv_cache_spec_kind``,
    ``kv_cache_spec_sliding_window``); ``kept``: which chunks keep the rows or state of its ``layers``
    (:class:`~hcache.storage.residency.Kept`; none for a group every chunk holds); ``window_block``: the
    block from whose boundary the window rule reads a window (:class:`~hcache.planning.window.WindowRule`)."""

    index: int
    block_size: int
    kind: str | None = None
    window: int | None = None
    kept: Kept = Kept.EVERY
    layers: frozenset[int] = frozenset()
    window_block: int = 1

    @classmethod
    def of(
        cls,
        index: int,
        block_size: int,
        kind: str | None,
        window: int | None,
        kept: Mapping[int, Kept],
        window_block: int,
    ) -> Group:
        """The group of the layers ``kept`` names, each with the chunks that keep it
        (:meth:`~hcache.config.ResolvedConfig.kept`; vLLM groups layers kept alike)."""
        partial = {layer: how for layer, how in kept.items() if how is not Kept.EVERY}
        how = next(iter(partial.values()), Kept.EVERY)
        return cls(index, block_size, kind, window, how, frozenset(partial), window_block)

    def holds(self, layers: frozenset[int] | None) -> bool:
        """Whether a chunk holding the rows or state of ``layers`` (None: not said) holds what a load reads
        of this group."""
        return self.kept is Kept.EVERY or (layers is not None and self.layers <= layers)

    def reads_from(self, start: int, end: int) -> int:
        """Where the chunks begin that a load reads of this group for the block ``[start, end)``. A window
        is the one a load of whole chunks reads for a router's hit whose window begins with this block (vLLM's:
        the ``ceil((window - 1) / block_size)`` blocks before its end): from ``window`` before the hit's last
        chunk end, rounded down to a window block (one position more than vLLM's window; from further back
        where the hit ends inside a chunk, which a load does not restore)."""
        if self.kept is Kept.CHECKPOINTS:
            return end - 1
        if self.kept is Kept.EVERY:
            return start
        hit_end = start + -(-(self.window - 1) // self.block_size) * self.block_size
        loaded = hit_end // CHUNK_TOKENS * CHUNK_TOKENS
        return min(start, max(0, loaded - self.window) // self.window_block * self.window_block)

    @property
    def reach(self) -> int:
        """How far before a chunk's start a load of a block ending in it may read (:meth:`reads_from`)."""
        return self.block_size + (CHUNK_TOKENS + self.window_block if self.kept is Kept.WINDOW else 0)


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
    group: Group


@dataclass(frozen=True)
class Removed:
    hashes: tuple[object, ...]
    medium: str
    group: Group


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared
HashBlock = Callable[[object | None, Sequence[int], str | None], object]  # (parent hash, tokens, salt)


@dataclass(frozen=True)
class _Blocks:
    """The blocks of one size that end in a chunk: where the first starts, their hashes, the hash before the
    first, their tokens (packed: an index of a large disk holds these for every chunk)."""

    start: int
    hashes: tuple[object, ...]
    parent: object | None
    tokens: array


@dataclass(frozen=True)
class _Unit:
    """A group's blocks ``first``..``stop`` of those of its size that end in a chunk, announced together: a
    load of each reads the same chunks, ``reads``, the chunk itself first."""

    group: int
    first: int
    stop: int
    reads: tuple[tuple, ...]


@dataclass
class _Chunk:
    """A chunk's place in vLLM's block chain, the same on every rank (each rank's own key names it)."""

    identity: tuple
    end: int  # tokens up to its end
    last: object | None  # the hash of the last hash block at or before its end
    lasts: dict[int, object | None]  # by group block size: the hash of the last such block at or before its end
    carry: array  # the tokens after the last boundary of every block size: the start of blocks later chunks end
    salt: str | None
    blocks: dict[int, _Blocks]  # by group block size, those that end in it
    back: tuple[tuple, ...]  # the chunks before it a load of its blocks may read, nearest first
    units: tuple[_Unit, ...]
    keys: dict[str, dict[str, int]] = field(default_factory=dict)  # each rank's key -> tier -> the groups held
    announced: set[tuple[str, int]] = field(default_factory=set)  # (medium, unit) announced

    def stored(self, unit: _Unit, group: Group, on: str) -> Stored:
        run, size = self.blocks[group.block_size], group.block_size
        blocks = []
        for i in range(unit.first, unit.stop):
            tokens = tuple(run.tokens[i * size : (i + 1) * size])
            blocks.append(Block(run.hashes[i], run.hashes[i - 1] if i else run.parent, tokens, self.salt))
        return Stored(tuple(blocks), on, group)


def _identity(end: int, last: object | None, carry: array, salt: str | None) -> tuple:
    """Past the first hash block the hashes hold the salt, and the carry's digest its tokens."""
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
    under which ``cache_salt`` (None: the deployment's namespace); ``groups``: vLLM's KV cache groups, by
    index, each block size a multiple of the hash block."""

    def __init__(
        self,
        hash_block: HashBlock,
        block_size: int,
        ranks: int,
        first: Callable[[str, Sequence[int]], tuple[bool, str | None]],
        groups: Sequence[Group],
    ):
        if any(g.block_size % block_size for g in groups) or [g.index for g in groups] != list(range(len(groups))):
            raise ValueError(f"KV cache groups {groups} are not indexed in order in blocks of {block_size} tokens")
        self.hash_block, self.block_size, self.ranks, self.first = hash_block, block_size, ranks, first
        self.groups = tuple(groups)
        self._sizes = sorted({g.block_size for g in groups})
        self._period = math.lcm(block_size, *self._sizes)  # a chunk carries the tokens since its last multiple
        self._reach = max(g.reach for g in groups)
        self.unplaced = 0  # chunks held whose chain is not known here: not announced
        self._chunks: dict[tuple, _Chunk] = {}
        self._keys: dict[str, tuple] = {}  # each rank's chunk key -> the chunk's identity
        self._covers: dict[tuple, set[tuple[tuple, int]]] = {}  # a chunk -> (chunk, unit) whose blocks read it
        self._events: list[Event] = [Cleared()]

    def apply(self, changes: Iterable[Residency]) -> None:
        for change in changes:
            chunk = self._place(change) if change.held else self._chunks.get(self._keys.get(change.key, ()))
            if chunk is None:
                continue
            tiers = chunk.keys.setdefault(change.key, {})
            if change.held:
                tiers[change.tier] = sum(1 << g.index for g in self.groups if g.holds(change.layers))
            else:
                tiers.pop(change.tier, None)
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
            start, last, lasts, carry, back = 0, None, dict.fromkeys(self._sizes), array("q"), ()
        else:
            start, last, lasts, carry, salt = parent.end, parent.last, dict(parent.lasts), parent.carry, parent.salt
            back = (parent.identity, *takewhile(lambda i: i[0] > start - self._reach, parent.back))
        tokens, h, base = carry + array("q", change.tokens), self.block_size, start - len(carry)
        end = start + len(change.tokens)
        hashes = {}  # the hash blocks that end in it, by their end
        for at in range(start // h * h + h, end + 1, h):
            last = hashes[at] = self.hash_block(
                last, tokens[at - h - base : at - base].tolist(), salt if last is None else None
            )
        identity = _identity(end, last, tokens[end // h * h - base :], salt)
        chunk = self._chunks.get(identity)
        if chunk is None:
            blocks = {}
            for size in self._sizes:
                ends = [at for at in hashes if at % size == 0]
                if ends:
                    run, first = tokens[ends[0] - size - base : ends[-1] - base], ends[0] - size
                    blocks[size] = _Blocks(first, tuple(hashes[at] for at in ends), lasts[size], run)
                    lasts[size] = hashes[ends[-1]]
            carry = tokens[end // self._period * self._period - base :]
            units = self._units(identity, blocks, back)
            chunk = _Chunk(identity, end, last, lasts, carry, salt, blocks, back, units)
            self._chunks[identity] = chunk
            for u, unit in enumerate(units):
                for read in unit.reads:
                    self._covers.setdefault(read, set()).add((identity, u))
        self._keys[change.key] = identity
        return chunk

    def _units(self, identity: tuple, blocks: dict[int, _Blocks], back: tuple[tuple, ...]) -> tuple[_Unit, ...]:
        """The blocks that end in a chunk, by group, in runs a load of which reads the same chunks."""
        units: list[_Unit] = []
        for g in (g for g in self.groups if g.block_size in blocks):
            run = blocks[g.block_size]
            for i in range(len(run.hashes)):
                start = run.start + i * g.block_size
                reads = g.reads_from(start, start + g.block_size)
                span = (identity, *takewhile(lambda c, reads=reads: c[0] > reads, back))
                if units and (units[-1].group, units[-1].reads) == (g.index, span):
                    units[-1] = _Unit(g.index, units[-1].first, i + 1, span)
                else:
                    units.append(_Unit(g.index, i, i + 1, span))
        return tuple(units)

    def _forget(self, chunk: _Chunk) -> None:
        del self._chunks[chunk.identity]
        for u, unit in enumerate(chunk.units):
            for read in unit.reads:
                owners = self._covers.get(read, set())
                owners.discard((chunk.identity, u))
                if not owners:
                    self._covers.pop(read, None)

    def _held(self, identity: tuple, on: str, group: int) -> bool:
        chunk = self._chunks.get(identity)
        if chunk is None:
            return False
        holding = (
            any(medium(t) == on and held >> group & 1 for t, held in tiers.items()) for tiers in chunk.keys.values()
        )
        return sum(holding) >= self.ranks

    def _update(self, changed: tuple, on: str) -> None:
        for identity, u in sorted(self._covers.get(changed, ()), key=lambda owner: (owner[0][0], owner[1])):
            owner = self._chunks[identity]
            unit = owner.units[u]
            group = self.groups[unit.group]
            whole = all(self._held(i, on, unit.group) for i in unit.reads)
            if whole and (on, u) not in owner.announced:
                owner.announced.add((on, u))
                self._events.append(owner.stored(unit, group, on))
            elif not whole and (on, u) in owner.announced:
                owner.announced.discard((on, u))
                hashes = owner.blocks[group.block_size].hashes[unit.first : unit.stop]
                self._events.append(Removed(hashes, on, group))
