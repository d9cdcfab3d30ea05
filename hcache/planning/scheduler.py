"""The bubble-free partition (§4.1.2 of the paper): how many layers to restore by RE, H and KV.

Restore runs two resources side by side: compute (RE layers, then the H layers' GEMM, RoPE and scatter,
then the KV layers' scatter) and I/O (the H and KV layers' bytes). With per-layer costs for the history
length at hand, a plan ``(L_RE, L_H, L_KV)`` takes ``max(compute, io)``::

    compute = L_RE·C_token + L_H·(C_H + AG_H) + L_KV·C_KV
    io      =                L_H·IO_H + L_KV·IO_KV

With tensor parallelism every cost is one rank's (its heads, its share of the reads), and ``AG_H`` is the
all-gather that assembles an H layer's rows from the ranks: it runs between the layers' GEMMs, on the
compute side. Without TP it is 0.

The paper solves two special cases in closed form (H+KV when compute-bound, RE+H when I/O-bound, with
``C_KV = 0``). Here every ``RE* H* KV*`` split is a candidate, which also admits the paper's "naive hybrid"
RE+KV and three-way plans. Layers may cost differently: a sliding-window layer's H and KV restore its
window, not the history (:mod:`hcache.planning.window`), and a recurrent layer's read its state, whatever the
history (:meth:`~hcache.planning.profile.Profile.plan`), so the sums run over each layer's own costs (and
stored bytes), from prefix sums, for every split: O(layers²) candidates of O(1) each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .plan import Method, RestorePlan

# Plans whose times differ by less than this fraction are ties; ties go to the plan that stores fewer bytes.
_TIE = 1e-9


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per layer to restore one history of a given length, by each method's resource."""

    c_token: float  # RE: a full layer forward over the history (compute)
    c_h: float  # H: K/V GEMM + RoPE + scatter (compute)
    c_kv: float  # KV: scatter of saved K/V (compute)
    io_h: float  # H: hidden states from the store to the device (I/O)
    io_kv: float  # KV: K/V from the store to the device (I/O)
    ag_h: float = 0.0  # H with tensor parallelism: all-gather of the layer's rows (compute side)

    @property
    def h_compute(self) -> float:
        return self.c_h + self.ag_h

    def plan_time(self, re: int, h: int, kv: int) -> float:
        """A plan's time where every layer costs this."""
        return float(_Sums([self] * (re + h + kv)).time(re, kv))


def _prefix(values: Sequence[float]) -> np.ndarray:
    """Prefix sums from 0, so that a run of layers' sum costs O(1), for every split at once."""
    return np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))


class _Sums:
    """Prefix sums of each layer's costs."""

    def __init__(self, layers: Sequence[LayerCosts]):
        def prefix(cost) -> np.ndarray:
            return _prefix([cost(c) for c in layers])

        self.n = len(layers)
        self.re, self.h, self.kv = prefix(lambda c: c.c_token), prefix(lambda c: c.h_compute), prefix(lambda c: c.c_kv)
        self.io_h, self.io_kv = prefix(lambda c: c.io_h), prefix(lambda c: c.io_kv)

    def time(self, re, kv):
        """``max(compute, io)`` of the plans with the first ``re`` layers RE and the last ``kv`` KV (numbers or
        arrays of them)."""
        mid = self.n - kv
        compute = self.re[re] + self.h[mid] - self.h[re] + self.kv[self.n] - self.kv[mid]
        return np.maximum(compute, self.io_h[mid] - self.io_h[re] + self.io_kv[self.n] - self.io_kv[mid])


def partition(
    costs: LayerCosts | Sequence[LayerCosts],
    num_layers: int,
    bytes_h: float | Sequence[float] = 0,
    bytes_kv: float | Sequence[float] = 0,
    allow_h: bool = True,
    allow_kv: bool = True,
    allow_re: bool = True,
) -> RestorePlan:
    """The plan with the least ``max(compute, io)``; among times equal within a relative 1e-9, the one
    storing fewest bytes (``bytes_h``, ``bytes_kv``: stored bytes per token of each format, every layer's or
    each layer's), then the fewest RE and KV layers. ``costs``: every layer's, or each layer's.
    ``allow_h``/``allow_kv`` False: plans without that method (one the start-up self-check disabled); with
    neither, RE alone. ``allow_re`` False: plans without RE, for an engine that computes every layer of a token
    it does not load (vLLM); then KV where neither H nor KV is allowed.

    H is never chosen when KV dominates it on every layer (no more I/O, compute or stored bytes), as with
    GQA models whose hidden states outweigh their K/V: swapping such an H layer for KV never costs anything."""
    layers = [costs] * num_layers if isinstance(costs, LayerCosts) else list(costs)
    per_layer = [[b] * num_layers if np.isscalar(b) else list(b) for b in (bytes_h, bytes_kv)]
    dominated = all(c.io_kv <= c.io_h and c.c_kv <= c.h_compute and kv <= h for c, h, kv in zip(layers, *per_layer))
    allow_h = allow_h and not dominated
    if not allow_re and not allow_h:
        allow_kv = True
    re, kv = np.meshgrid(np.arange(num_layers + 1 if allow_re else 1), np.arange(num_layers + 1), indexing="ij")
    h = num_layers - re - kv
    valid = (h >= 0) & ((h == 0) | allow_h) & ((kv == 0) | allow_kv)
    re, kv = re[valid], kv[valid]
    seconds = _Sums(layers).time(re, kv)
    fastest = seconds <= seconds.min() * (1 + _TIE)
    re, kv, mid = re[fastest], kv[fastest], num_layers - kv[fastest]
    stored_h, stored_kv = (_prefix(b) for b in per_layer)
    stored = stored_h[mid] - stored_h[re] + stored_kv[num_layers] - stored_kv[mid]
    best = np.lexsort((kv, re, stored))[0]
    return RestorePlan.split(num_layers, re=int(re[best]), kv=int(kv[best]))


def plan_seconds(layers: Sequence[LayerCosts], plan: RestorePlan) -> float:
    """``max(compute, io)`` of ``plan`` with each layer's costs."""
    return float(_Sums(layers).time(plan.count(Method.RE), plan.count(Method.KV)))
