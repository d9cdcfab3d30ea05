"""The contract between an engine's forward pass and whoever saves its per-layer state."""
from __future__ import annotations

from typing import Protocol

import torch

from ..ragged import Segment


class LayerCapture(Protocol):
    """Receives, once per layer per batch, the whole batch's normalised layer input and its K/V.

    ``hidden`` is ``[T, D]``; ``k`` (rotated, as stored in the cache) and ``v`` are
    ``[T, n_kv_heads, head_size]``. The tensors are views of buffers the engine reuses: copy what you keep
    before returning.
    """

    def begin_batch(self, segments: list[Segment]) -> None: ...

    def on_layer(self, layer: int, hidden: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def end_batch(self) -> None: ...
