"""Where a chunk is held, as it changes: the host pool or one of the stores below it. What a process that
does not own the tiers follows to tell others what this node can load (vLLM's KV events,
:mod:`hcache.vllm.events`), and what its index of loadable chunks is kept by. Free of torch: the scheduler's
side of vLLM's connector reads these values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from .chunk_store import Loss

HOST = "host"  # the host pool's tier; a store's is its ``kind`` (:class:`~.stored_state.Source`)


class Kept(str, Enum):
    """Which of a sequence's chunks keep a layer's rows (:meth:`~hcache.config.ResolvedConfig.kept`): every
    chunk; the last window of each save (a sliding-window layer under the window rule,
    :mod:`hcache.planning.window`); a recurrent layer's state at checkpoints only
    (:mod:`hcache.planning.checkpoints`). What a chunk held says of such a layer is then in its ``layers``."""

    EVERY = "every"
    WINDOW = "window"
    CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class Residency:
    """``key`` entered (``held``) or left ``tier``. An entry carries the chunk's ``tokens`` and ``parent``
    (where it sits in its chain) and the ``layers`` whose rows or state it holds (None: not said; a layer
    kept in part, :class:`Kept`, then counts as missing); a departure says why (``None``: the pool made room,
    the stores keep it)."""

    key: str
    tier: str
    held: bool
    tokens: tuple[int, ...] = ()
    parent: str = ""
    why: Loss | None = None
    layers: frozenset[int] | None = None

    @classmethod
    def entered(cls, tier: str, image) -> Residency:
        """A chunk image (:class:`~.chunk.ChunkImage`, named) held in ``tier`` now."""
        return cls(image.key, tier, True, tuple(image.tokens), image.parent, layers=image.layout.layers)


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
