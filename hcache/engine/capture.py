"""The contract between an engine's forward pass and whoever saves its per-layer state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from .ragged import Segment


class LayerCapture(Protocol):
    """Receives, once per layer per batch, the whole batch's normalised layer input and its K/V.

    ``hidden`` is ``[T, D]``, a view of a buffer the engine reuses: copy what you keep before returning.
    ``kv()`` returns ``[T, 2, n_kv_heads, head_size]``: K (rotated, as in the cache) and V, in a tensor of its
    own (no one else writes it; it may be a view of one). It reads them back from the cache or copies them
    from what the cache write was given, so a capture that saves only hidden states never pays for that.
    A recurrent (Mamba) layer has no K/V: :meth:`on_state` gets its state at each chunk end the batch reaches.
    """

    def begin_batch(self, segments: list[Segment]) -> None: ...

    def on_layer(self, layer: int, hidden: torch.Tensor, kv: Callable[[], torch.Tensor]) -> None: ...

    def on_state(self, layer: int, uid: int, chunk: int, rows: torch.Tensor) -> None:
        """Recurrent layer ``layer``'s state after chunk ``chunk`` of sequence ``uid``, as a chunk stores it
        (:func:`~hcache.storage.stored_state.pack_state`; a tensor of its own)."""
        ...

    def end_batch(self) -> None: ...
