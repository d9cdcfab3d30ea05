"""What a paged load is asked to do: plain values, which the engine's scheduler builds (vLLM's, in a process
that needs neither torch nor the store) and the worker's loader (:mod:`hcache.paged.loader`) carries out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoadJob:
    """A request's stored positions ``[start, end)`` to load into its blocks (``block_ids``: every block it
    holds, in order, in each KV cache group). ``tokens``: its prompt up to ``end``, which keys the chunks;
    ``namespace``: its root's. ``in_step``: the step that computes the request waits for it (a small load,
    scheduled with the request), where other loads run while the engine holds their request back."""

    req_id: str
    namespace: str | None
    tokens: list[int]
    block_ids: list[list[int]]
    start: int
    end: int
    in_step: bool = False
