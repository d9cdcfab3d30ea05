"""Restore plans: which method rebuilds each layer's KV cache.

A plan is layer-wise (§4.1.1 of the paper): the first layers by token recompute (RE), the middle ones from
hidden states (H), the last ones from offloaded KV (KV). Any plan of that shape is valid; the scheduler
chooses among them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

import torch

from ..errors import InvalidRequestError
from ..model.spec import ModelSpec
from ..ops.quant import SCALE_DTYPE
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.stored_state import STATE, STATE_DTYPE, Format, scale_shape, state_row_shape


def row_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """A token's rows of each stored format, for a model: a hidden-state vector (H), and K and V of each KV
    head, or an MLA model's one latent row (KV); and a recurrent layer's state, as a chunk's rows hold it
    (:data:`STATE`). What a chunk holds is described to the storage layer by this, and a chunk of one shape
    never loads into a model of another."""
    shapes = {Format.H.value: (spec.hidden_size,), Format.KV.value: (spec.kv_parts, spec.num_kv_heads, spec.head_size)}
    if spec.mamba is not None:
        shapes[STATE] = state_row_shape(spec.mamba.numel)
    return shapes


class Method(str, Enum):
    """How a layer's K/V is rebuilt. H and KV restore from the stored format of their name (one name, the
    storage layer's :class:`~hcache.storage.stored_state.Format`); RE stores nothing."""

    RE = "RE"  # prefill from the tokens: nothing stored
    H = Format.H.value  # hidden states: K/V GEMM + RoPE
    KV = Format.KV.value  # offloaded K/V: copy only

    @property
    def stored_format(self) -> Format | None:
        return None if self is Method.RE else Format(self.value)

    def bytes_per_token_layer(self, spec: ModelSpec, encoding: torch.dtype | None = None) -> int:
        """Stored bytes per token per layer restored by this method: in the model's dtype, or with an 8-bit
        ``encoding`` one byte per value and a float16 scale per vector (a hidden row; a K or V head)."""
        if self is Method.RE:
            return 0
        shape = row_shapes(spec)[self.value]
        if encoding is None:
            return math.prod(shape) * spec.itemsize
        return math.prod(shape) * encoding.itemsize + math.prod(scale_shape(shape)) * SCALE_DTYPE.itemsize

    def layer_bytes_per_token(
        self, spec: ModelSpec, layer: int, encoding: torch.dtype | None = None, state_every: int = 1
    ) -> float:
        """Stored bytes per token of ``layer`` restored by this method: its rows, or for a recurrent layer (H and
        KV alike: either reads its state, :mod:`hcache.restore.reads`) its state, kept once every ``state_every``
        chunks (:class:`~hcache.planning.checkpoints.StateRule`), over the tokens it stands for."""
        if self is not Method.RE and spec.is_recurrent(layer):
            return state_bytes(spec) / (state_every * CHUNK_TOKENS)
        return self.bytes_per_token_layer(spec, encoding)


def state_bytes(spec: ModelSpec) -> int:
    """The bytes of one recurrent layer's state as a chunk stores it: a chunk's rows of :data:`STATE`, never
    encoded; what a restore of the layer reads, however long the history."""
    return CHUNK_TOKENS * math.prod(row_shapes(spec)[STATE]) * STATE_DTYPE.itemsize


_ORDER = {Method.RE: 0, Method.H: 1, Method.KV: 2}
# Counts in RE, H, KV order, each optional, with a "+" only between two present terms.
_PLAN = re.compile(r"(?:([0-9]+)RE(?=\+[0-9]|$)\+?)?(?:([0-9]+)H(?=\+[0-9]|$)\+?)?(?:([0-9]+)KV)?", re.ASCII)


@dataclass(frozen=True)
class RestorePlan:
    layers: tuple[Method, ...]

    def __post_init__(self):
        ranks = [_ORDER[m] for m in self.layers]
        if ranks != sorted(ranks):
            raise InvalidRequestError(f"plan {self} is not of the form RE* H* KV* (RE first, KV last)")

    @classmethod
    def split(cls, num_layers: int, re: int = 0, kv: int = 0) -> "RestorePlan":
        if re < 0 or kv < 0 or re + kv > num_layers:
            raise InvalidRequestError(f"cannot split {num_layers} layers into {re} RE + {kv} KV")
        return cls((Method.RE,) * re + (Method.H,) * (num_layers - re - kv) + (Method.KV,) * kv)

    @classmethod
    def uniform(cls, num_layers: int, method: Method | str) -> "RestorePlan":
        return cls((Method(method),) * num_layers)

    @classmethod
    def parse(cls, text: str, num_layers: int) -> "RestorePlan":
        """``"H"``, ``"KV"`` or ``"RE"`` for one method on every layer, or counts such as ``"2RE+20H+8KV"``:
        ASCII digits, each method at most once and in the order RE, H, KV, joined by single ``+`` signs."""
        counts = cls.check_syntax(text)
        if counts is None:
            return cls.uniform(num_layers, text.strip().upper())
        if sum(counts) != num_layers:
            raise InvalidRequestError(f"plan {text.strip()!r} covers {sum(counts)} layers, the model has {num_layers}")
        return cls.split(num_layers, re=counts[0], kv=counts[2])

    @staticmethod
    def check_syntax(text: object) -> tuple[int, int, int] | None:
        """The RE, H and KV counts a plan string gives (None: one method on every layer), or a clear error;
        whether the counts fit a model is :meth:`parse`'s to check."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"a plan is a string such as 'H' or '2RE+20H+8KV', not {type(text).__name__}")
        text = text.strip().upper()
        if text in Method.__members__:
            return None
        parts = _PLAN.fullmatch(text)
        if parts is None or not any(parts.groups()):
            raise InvalidRequestError(f"cannot parse plan {text!r}: use auto, RE, H, KV or counts like '2RE+20H+8KV'")
        return tuple(int(g or 0) for g in parts.groups())

    def count(self, method: Method) -> int:
        return sum(m is method for m in self.layers)

    def stored_bytes_per_token(
        self, spec: ModelSpec, encodings: dict[str, torch.dtype] | None = None, state_every: int = 1
    ) -> float:
        """Stored bytes per token over every layer, with ``encodings`` (:func:`stored_encodings`) if given, and a
        recurrent layer's state kept every ``state_every`` chunks."""
        return sum(
            m.layer_bytes_per_token(spec, layer, (encodings or {}).get(m.value), state_every)
            for layer, m in enumerate(self.layers)
        )

    def __str__(self) -> str:
        return "+".join(f"{self.count(m)}{m.value}" for m in Method if self.count(m)) or "empty"


def default_plan(spec: ModelSpec) -> RestorePlan:
    """The plan without a hardware profile: H where hidden states are the smaller transfer (MHA, r > 1)
    and the family's weights are known, KV otherwise (GQA: KV moves no more bytes and needs no compute)."""
    hidden = spec.restores_hidden and spec.kv_to_hidden_ratio > 1
    return RestorePlan.uniform(spec.num_layers, Method.H if hidden else Method.KV)
