"""The one interface both engines serve: the reference engine (HF transformers, any device) and the
DeepSpeed-FastGen adapter (CUDA), split by role. hcache's serving layer drives either through it, MII's
batching loop drives the serving layer through its scheduling part (``put``/``query``/``flush``/
``free_blocks``), and the restore core writes through its restore primitives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..model.spec import ModelSpec
from ..ops.quant import QuantRows
from .capture import LayerCapture


class Scheduling(Protocol):
    """FastGen's scheduling interface, which MII's batching loop drives.

    Capacity follows ``InferenceEngineV2``'s semantics, because MII schedules with them: ``free_blocks``
    holds one count per KV-cache group (MII takes the min), and ``query`` answers how many of
    ``max_request_tokens`` more tokens fit in ``max_request_blocks`` more blocks, and how many blocks they need.
    """

    @property
    def free_blocks(self) -> torch.Tensor: ...

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int) -> tuple[int, int]: ...

    def get_remaining_block_capacity(self, uid: int) -> int: ...

    def flush(self, uid: int) -> None: ...


class Forward(Protocol):
    """A ragged forward over a paged KV cache, whose layers' rows a capture hook can save."""

    def seen_tokens(self, uid: int) -> int:
        """Tokens whose K/V the sequence holds; 0 for a sequence the engine does not track."""
        ...

    def step(self, requests: list[tuple[int, list[int]]], capture: LayerCapture | None = None) -> torch.Tensor:
        """Append each request's tokens to its sequence; next-token logits ``[len(requests), vocab]``."""
        ...


class RestorePrimitives(Protocol):
    """hcache's three restore primitives, which the restore core writes through
    (:class:`~hcache.serving.restore.EngineTarget`).

    A restore extends a sequence from its current length: ``begin_restore`` reserves blocks for
    ``num_tokens`` more tokens, the primitives fill every layer's K/V at those positions, and
    ``end_restore`` makes them count as seen, so the next ``step`` prefills after them. Both engines keep
    what ``begin_restore`` computed as a :class:`~hcache.engine.restore_state.RestoreState`, whose cache
    writes their KV, H and slot-copy primitives share.
    """

    spec: ModelSpec
    device: torch.device
    block_size: int

    def begin_restore(self, uid: int, num_tokens: int) -> None: ...

    def recompute_layers(self, uid: int, tokens: list[int], num_layers: int) -> None:
        """RE: run the first ``num_layers`` layers over ``tokens``, attending to what the sequence holds."""
        ...

    def restore_from_hidden(self, uid: int, layer: int, hidden: torch.Tensor, start: int = 0) -> None:
        """H: rows ``[start, start + len(hidden))`` of the restore from saved normalised layer inputs."""
        ...

    def restore_kv(
        self, uid: int, layer: int, kv: torch.Tensor | QuantRows | Sequence[torch.Tensor | QuantRows], start: int = 0
    ) -> None:
        """KV: rows ``[start, start + T)`` of the restore from saved ``[T, 2, n_kv_heads, head_size]`` rows (K
        rotated), one tensor or consecutive parts (a chunk's rows each, so a layer is one call however many
        chunks it spans), which may be in pinned host memory: the copies run on the caller's current stream.
        A part may be :class:`~hcache.ops.quant.QuantRows` (a chunk stored in an 8-bit encoding): its codes
        are copied as stored and dequantised on the device, into the cache."""
        ...

    def restore_state(self, uid: int, layer: int, rows: torch.Tensor) -> None:
        """A recurrent layer's state at the restore's end, from the rows a chunk stores it in (an engine that
        serves a model with recurrent layers: the reference engine)."""
        ...

    def end_restore(self, uid: int, tokens: list[int]) -> None: ...


class HeldBlocks(Protocol):
    """Blocks held for no sequence: the GPU prefix cache's (:mod:`hcache.serving.gpu_prefix_cache`)."""

    def detach(self, uid: int) -> list[int]:
        """Drop a sequence like :meth:`flush`, but hand its KV blocks to the caller instead of freeing them
        (they stay used in ``free_blocks`` until :meth:`release_blocks`); [] for an unknown sequence."""
        ...

    def release_blocks(self, blocks: list[int]) -> None: ...

    def restore_from_slots(self, uid: int, slots: torch.Tensor) -> None:
        """The restore's first ``len(slots)`` rows, every layer, copied on the device from flat cache ``slots``
        ``[T]`` of held blocks (slot = block * block_size + row): one gather and scatter per layer."""
        ...


class Engine(Scheduling, Forward, RestorePrimitives, HeldBlocks, Protocol):
    """A ragged-batch engine over a paged KV cache, in every role: the reference engine and FastGen's."""

    def kv(self, uid: int, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's cached K and V ``[length, n_kv_heads, head_size]`` of one layer (default: every
        seen token), gathered from its blocks: for checks against recompute, not the serving path."""
        ...
