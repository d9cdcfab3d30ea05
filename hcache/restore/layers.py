"""The one layer-by-layer restore: each stored layer's rows read out of the host pool and written into an
engine's KV cache through a :class:`RestoreTarget`, one implementation per engine layout (the serving
engine's paged cache, FastGen's or the reference engine's, and vLLM's), pipelined as
:meth:`~hcache.transfer.copier.Copier.pipeline` runs it: a layer's copies on the copier's side stream a
few layers ahead of the compute that consumes them. KV rows are written where they are copied; H rows are
decoded, gathered across tensor-parallel ranks where the layer is, and handed to the target to rebuild
K/V, on the caller's stream after their copy's event."""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from ..model.tensor_parallel import SINGLE, TPGroup
from ..ops.quant import QuantRows
from ..planning.plan import Method
from ..storage.chunk import ChunkImage
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.image_rows import ImageRows
from ..storage.stored_state import decode_rows, stored_rows
from ..transfer.copier import Copier
from ..transfer.scratch import Scratch
from .reads import LayerJob


class RestoreTarget(Protocol):
    """Where a restore writes: an engine's KV cache in its own layout. Positions are the sequence's; a job
    writes ``[job.begin, end)``; a recurrent layer's job, its state at ``end``."""

    def write_kv(self, job: LayerJob, rows: StoredRows) -> None:
        """Write the layer's stored K/V rows (K rotated) into the cache; called on the copier's side
        stream, so the copy and the write are one stage."""
        ...

    def write_hidden(self, job: LayerJob, hidden: torch.Tensor) -> None:
        """Rebuild the layer's K/V from its hidden states ``hidden`` (``[end - job.begin, D]``, on the
        cache's device) and write them; called on the caller's stream, after the rows' copy."""
        ...

    def write_state(self, job: LayerJob, rows: torch.Tensor) -> None:
        """Set a recurrent layer's state at the restore's end from the rows its last chunk stores it in
        (:func:`~hcache.storage.stored_state.pack_state`)."""
        ...


class StoredRows:
    """A restore's verified chunks (``images``, the first of them chunk ``first`` of the sequence), read a
    layer at a time, up to position ``end``. Where the images share one arena and layout and the device
    reads it (``shared``: :class:`~hcache.storage.image_rows.ImageRows`), a layer is one gather, into
    ``scratch``'s buffers if given (a CPU's); otherwise one copy per chunk (a DMA from its pinned slot, on a
    GPU: :meth:`Copier.gather`).
    ``filler``: the rows of a chunk this rank lacks but the tensor-parallel agreement holds (past its own
    bad chunk: garbage the agreement cuts off)."""

    def __init__(
        self,
        images: list[ChunkImage],
        first: int,
        end: int,
        copier: Copier | None,
        dtype: torch.dtype,
        scratch: Scratch | None = None,
        shared: ImageRows | None = None,
        filler: torch.Tensor | None = None,
    ):
        self.images, self.first, self.end, self.copier, self.dtype = images, first, end, copier, dtype
        self.scratch, self.shared, self.filler = scratch, shared, filler

    def parts(self, job: LayerJob) -> list[torch.Tensor | QuantRows]:
        """The layer's rows of positions ``[job.begin, end)`` in place, one part per chunk, as stored (for a
        target that copies them into its cache itself, in one batched call)."""
        chunks = job.chunks
        parts = [stored_rows(self.images[j], job.layer, job.method.value) for j in chunks]
        parts[-1] = parts[-1][: self.end - (self.first + chunks[-1]) * CHUNK_TOKENS]
        parts[0] = parts[0][job.begin - (self.first + chunks.start) * CHUNK_TOKENS :]
        return parts

    def kv(self, job: LayerJob) -> list[torch.Tensor | QuantRows]:
        """The layer's rows of positions ``[job.begin, end)``, as stored, for a target that writes (and
        dequantises) them into its cache itself: gathered in one transfer where they can be, else in place,
        one part per chunk (copied straight into the cache, a DMA each)."""
        if self.shared is None:
            return self.parts(job)
        (run,) = self.gather(job)
        origin = (self.first + job.chunks.start) * CHUNK_TOKENS
        return [run[job.begin - origin : self.end - origin]]

    def gather(self, job: LayerJob) -> list[torch.Tensor | QuantRows]:
        """The layer's rows of its chunks, copied to the device: one run per encoding the chunks were
        stored in (one, unless they differ)."""
        if self.scratch is not None:
            self.scratch.next_job()
        if self.shared is not None:
            empty = self.scratch.empty if self.scratch is not None else self._empty
            return [self.shared.stored_rows(job.layer, job.method.value, job.chunks, empty)]
        n = len(self.images)
        parts = [stored_rows(self.images[j], job.layer, job.method.value) if j < n else self.filler for j in job.chunks]
        return gather_runs(self.copier, parts, self.scratch)

    def _empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.shared.base.device)

    def decode(self, runs: list[torch.Tensor | QuantRows]) -> torch.Tensor:
        """:meth:`gather`'s runs as one tensor in the model's dtype (8-bit rows dequantised into the scratch's
        slot of the job gathered last, used up before it is reused)."""
        empty = self.scratch.empty if self.scratch is not None else None
        pieces = [decode_rows(run, self.dtype, empty) for run in runs]
        if len(pieces) == 1:
            return pieces[0]
        if pieces:
            return torch.cat(pieces)
        return torch.empty(
            0, *self.filler.shape[1:], dtype=self.dtype, device=self.copier.device
        )  # a rank with no chunk of it

    def rows(
        self, job: LayerJob, runs: list[torch.Tensor | QuantRows], tp: TPGroup = SINGLE, agreed: int = 0
    ) -> torch.Tensor:
        """The layer's rows of positions ``[job.begin, end)``, decoded from :meth:`gather`'s runs; a gathered
        layer's assembled from every rank's first (a collective: every rank calls it)."""
        rows = self.decode(runs)
        if job.gathered:
            rows, origin = tp.gather_in_turn(rows, agreed, CHUNK_TOKENS, self.first), self.first
        else:
            origin = self.first + job.chunks.start
        origin *= CHUNK_TOKENS
        return (
            rows
            if (job.begin, self.end) == (origin, origin + rows.shape[0])
            else rows[job.begin - origin : self.end - origin]
        )


def restore_layers(
    jobs: list[LayerJob], rows: StoredRows, target: RestoreTarget, copier: Copier, tp: TPGroup = SINGLE, agreed: int = 0
) -> None:
    """Write each job's layer into ``target``: KV on the copier's side stream as its rows are read, H rebuilt
    on this stream after its copy, ``copier.depth`` layers behind. Returns once the last copy has been
    ordered before anything this stream runs next. ``agreed``: the chunks every tensor-parallel rank holds,
    which a gathered layer assembles."""

    def stage(job: LayerJob) -> list | None:
        if job.state:
            if job.chunks:
                target.write_state(job, rows.images[job.chunks[-1]].tensor(job.layer, job.fmt))
            return None
        if job.method is Method.H:
            return rows.gather(job)
        if job.chunks and job.begin < rows.end:
            target.write_kv(job, rows)
        return None

    def finish(job: LayerJob, runs: list | None, done) -> None:
        if runs is None:
            return
        copier.wait(done, *run_tensors(runs))
        hidden = rows.rows(job, runs, tp, agreed)
        if len(hidden):
            target.write_hidden(job, hidden)

    copier.wait(copier.pipeline(jobs, stage, finish))


def gather_runs(
    copier: Copier, parts: list[torch.Tensor | QuantRows], scratch: Scratch | None = None
) -> list[torch.Tensor | QuantRows]:
    """Rows of consecutive chunks on the device, one gather per run of chunks stored alike (one run,
    unless the chunks were saved in different encodings): lossless rows, or codes and scales (in
    ``scratch``'s buffers, if given: :meth:`Copier.gather`)."""
    runs = [list(run) for _, run in itertools.groupby(parts, _encoding)]
    return [
        QuantRows(copier.gather([p.codes for p in run], scratch), copier.gather([p.scale for p in run], scratch))
        if isinstance(run[0], QuantRows)
        else copier.gather(run, scratch)
        for run in runs
    ]


def run_tensors(runs: list[torch.Tensor | QuantRows]) -> list[torch.Tensor]:
    """The device tensors :func:`gather_runs` made: what a stream that reads them must keep alive."""
    return [t for run in runs for t in ((run.codes, run.scale) if isinstance(run, QuantRows) else (run,))]


def _encoding(part: torch.Tensor | QuantRows) -> tuple:
    """What chunks stored alike share: gathered together, in one run."""
    return type(part), (part.codes if isinstance(part, QuantRows) else part).dtype
