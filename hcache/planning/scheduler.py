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
RE+KV and three-way plans. For a fixed ``L_RE`` both sums are linear in ``L_KV``, so their max is
minimised at an end of the range or next to the crossing: O(layers) candidates, not O(layers²).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .plan import RestorePlan

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
        return max(re * self.c_token + h * self.h_compute + kv * self.c_kv, h * self.io_h + kv * self.io_kv)


def partition(
    costs: LayerCosts, num_layers: int, bytes_h: int = 0, bytes_kv: int = 0, allow_h: bool = True, allow_kv: bool = True,
    allow_re: bool = True,
) -> RestorePlan:
    """The plan with the least ``max(compute, io)``; among equal times, the one storing fewest bytes
    (``bytes_h``, ``bytes_kv``: stored bytes per token per layer of each format). ``allow_h``/``allow_kv``
    False: plans without that method (one the start-up self-check disabled); with neither, RE alone.
    ``allow_re`` False: plans without RE, for an engine that computes every layer of a token it does not
    load (vLLM); then KV where neither H nor KV is allowed.

    H is never chosen when KV dominates it (no more I/O, compute or stored bytes per layer), as with GQA
    models whose hidden states outweigh their K/V: swapping such an H layer for KV never costs anything."""
    dominated = costs.io_kv <= costs.io_h and costs.c_kv <= costs.h_compute and bytes_kv <= bytes_h
    allow_h = allow_h and not dominated
    best: tuple[float, int, int, int] | None = None  # (time, stored bytes, re, kv)
    if not allow_re and not allow_h:
        allow_kv = True
    for re in range(num_layers + 1 if allow_re else 1):
        rest = num_layers - re
        candidates = {0, rest, *(_crossings(costs, re, rest) if allow_h else ())}
        for kv in candidates:
            h = rest - kv
            if (h and not allow_h) or (kv and not allow_kv):
                continue
            key = (costs.plan_time(re, h, kv), h * bytes_h + kv * bytes_kv, re, kv)
            if best is None or _better(key, best):
                best = key
    _, _, re, kv = best
    return RestorePlan.split(num_layers, re=re, kv=kv)


def _crossings(costs: LayerCosts, re: int, rest: int) -> set[int]:
    """The integer ``L_KV`` on either side of where compute and I/O cross, for ``L_RE = re``."""
    # compute(kv) = re·Ct + (rest-kv)·C_H' + kv·C_KV ; io(kv) = (rest-kv)·IO_H + kv·IO_KV ; C_H' = C_H + AG_H
    slope = (costs.c_kv - costs.h_compute) - (costs.io_kv - costs.io_h)
    if slope == 0:
        return set()
    x = (rest * costs.io_h - re * costs.c_token - rest * costs.h_compute) / slope
    if not math.isfinite(x):
        return set()
    return {min(rest, max(0, k)) for k in (math.floor(x), math.ceil(x))}


def _better(a: tuple[float, int, int, int], b: tuple[float, int, int, int]) -> bool:
    if a[0] < b[0] * (1 - _TIE):
        return True
    if a[0] > b[0] * (1 + _TIE):
        return False
    return a[1:] < b[1:]
