"""Which stored chunks each layer of a restore reads, and from which position it writes: one rule for every
engine layout (the serving engine's restore and vLLM's loads), for the writes and for the accounting alike.

A layer reads every chunk of the prefix, but for three rules: a sliding-window layer reads its last window
only (:class:`~hcache.planning.window.WindowRule`, the rule its rows were saved by), a recurrent (Mamba)
layer reads its state in the last chunk alone (:class:`~hcache.planning.checkpoints.StateRule` makes the
restore end where one is stored), and with tensor parallelism an H layer reads the chunks whose hidden
states this rank stores (:func:`shared_chunks`), the rest gathered from the other ranks."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.tensor_parallel import SINGLE, TPGroup
from ..planning.plan import Method, RestorePlan
from ..planning.window import WindowRule
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.stored_state import STATE, shared_chunks


@dataclass(frozen=True)
class LayerJob:
    """One stored layer of a restore: its ``method`` (H or KV), the ``chunks`` it reads (indices into the
    restore's chunks, which start at the sequence's chunk ``first``), and ``begin``, the first position of
    the sequence it writes; it writes up to the restore's end. ``gathered``: its rows are assembled across
    tensor-parallel ranks, every chunk from the restore's first on, this rank's ``chunks`` among them.
    ``state``: a recurrent layer's, which reads its state at the restore's end from its last chunk."""

    layer: int
    method: Method
    chunks: range
    begin: int
    gathered: bool = False
    state: bool = False

    @property
    def fmt(self) -> str:
        """The stored tensor the job reads of each of its chunks."""
        return STATE if self.state else self.method.value


def layer_jobs(
    plan: RestorePlan,
    rule: WindowRule,
    first: int,
    start: int,
    end: int,
    n: int,
    tp: TPGroup = SINGLE,
    agreed: int | None = None,
) -> list[LayerJob]:
    """The stored layers of ``plan`` for a restore of positions ``[start, end)`` from ``n`` verified chunks,
    the first of them chunk ``first`` of the sequence; none when no chunk is restored (``agreed``: how many
    every tensor-parallel rank holds, by default ``n``)."""
    agreed = n if agreed is None else agreed
    if not agreed:
        return []
    jobs = []
    for layer, method in enumerate(plan.layers):
        if method is Method.RE:
            continue
        if rule.spec.is_recurrent(layer):
            jobs.append(LayerJob(layer, method, range(n - 1, n) if n else range(0), end, state=True))
            continue
        gathered = method is Method.H and tp.world_size > 1
        if gathered:
            chunks, origin = shared_chunks(tp.rank, tp.world_size, agreed, first), first
        else:
            chunks = range(max(0, rule.first_read(layer, end) - first), n)
            origin = first + chunks.start
        jobs.append(LayerJob(layer, method, chunks, max(start, origin * CHUNK_TOKENS), gathered))
    return jobs


def reads(jobs: list[LayerJob]) -> dict[tuple[int, str], range]:
    """The chunks each ``(layer, format)`` read, as the accounting takes them
    (:meth:`~hcache.restore.stored_prefix.StoredPrefix.outcome`)."""
    return {(job.layer, job.fmt): job.chunks for job in jobs}
