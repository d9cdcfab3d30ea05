"""One sequence's recurrent state: each recurrent layer's convolution and recurrent state (a Mamba-2 layer's SSM
state, a gated delta net's), kept by the reference engine per sequence and handed to transformers' mixer as its
``cache_params``, so that the mixer's own arithmetic continues a sequence from it (a prefill from a state, or a
decode step) and updates it in place. Both kinds read and update the same cache interface, so one class serves
them, by the state's shape (:class:`~hcache.model.spec.MambaSpec`)."""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from ..model.spec import MambaSpec
from ..storage.stored_state import pack_state, unpack_state


class RecurrentState:
    """The cache object a recurrent mixer reads (``has_previous_state``, ``layers[i]``) and updates
    (``update_conv_state``, ``update_recurrent_state``), holding transformers' own per-layer state."""

    def __init__(self) -> None:
        self.layers: dict[int, LinearAttentionLayer] = {}

    def has_previous_state(self, layer_idx: int) -> bool:
        layer = self.layers.get(layer_idx)
        return layer is not None and layer.has_previous_state[0]

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, **kwargs) -> torch.Tensor:
        return self.layers.setdefault(layer_idx, LinearAttentionLayer()).update_conv_state(conv_states, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, **kwargs) -> torch.Tensor:
        return self.layers.setdefault(layer_idx, LinearAttentionLayer()).update_recurrent_state(recurrent_states)

    def rows(self, layer: int) -> torch.Tensor:
        """The layer's state now, as a chunk stores it (a copy: the state moves on in place)."""
        state = self.layers[layer]
        return pack_state([state.conv_states[0], state.recurrent_states[0]])

    def load(self, layer: int, rows: torch.Tensor, mamba: MambaSpec, dtype: torch.dtype) -> None:
        """Set the layer's state from a chunk's rows: the sequence continues from there. The recurrent state
        stays float32 (as stored, and as a gated delta net computes it); the convolution's takes ``dtype``."""
        conv, ssm = unpack_state(rows, [(1, *mamba.conv_shape), (1, *mamba.ssm_shape)])
        state = self.layers[layer] = LinearAttentionLayer()
        state.lazy_initialization(conv_states=conv.to(dtype), conv_kernel_size=mamba.conv_kernel)
        state.lazy_initialization(recurrent_states=ssm)
        state.conv_states[0].copy_(conv)
        state.recurrent_states[0].copy_(ssm)
        state.has_previous_state[0] = True
