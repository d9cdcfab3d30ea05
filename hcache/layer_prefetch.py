"""The I/O side of the pipelined restore: a layer's stored rows are read (and uploaded) ahead of the compute
that consumes them.

Stored chunks are token-major on disk (one file per 64 tokens) while restore is layer-major, so layer ``l``
needs one small read from every chunk. A :class:`ReaderPool`'s threads split the chunks between them
(file ``j`` always goes to reader ``j % W``, so no two threads ever share a file) and each fills its
chunks' rows of a layer's host buffer. An upload thread then hands the finished layer to the device: on a
GPU the buffer is pinned and copied on a side stream, and the consumer waits only on that layer's event,
so layer ``l+1``'s read and copy overlap layer ``l``'s compute (and the RE layers, which need no data).
At most ``depth`` layers are in flight, which bounds host memory.

Without a pool the same reads run inline, one layer at a time: the sequential executor that the
pipelined one must equal.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .storage.chunk import ChunkInvalid, ChunkReader
from .storage.chunk_key import CHUNK_TOKENS

DEFAULT_READERS = min(8, os.cpu_count() or 1)
DEFAULT_DEPTH = 4


class ReaderPool:
    """Long-lived reader threads plus one upload thread, shared by every restore of a runtime."""

    def __init__(self, readers: int = DEFAULT_READERS):
        if readers < 1:
            raise ValueError(f"a reader pool needs at least one reader, not {readers}")
        self.readers = [ThreadPoolExecutor(1, thread_name_prefix=f"hcache-read{i}") for i in range(readers)]
        self.uploader = ThreadPoolExecutor(1, thread_name_prefix="hcache-upload")

    def close(self) -> None:
        for pool in (*self.readers, self.uploader):
            pool.shutdown(wait=True)


@dataclass
class LayerRows:
    layer: int
    fmt: str
    rows: torch.Tensor  # [chunks·64, *row_shape] on the device; rows of chunks at or past ``bad`` are garbage
    bad: tuple[int, ChunkInvalid | OSError] | None  # the first of the format's readers whose rows failed to read or verify


class LayerPrefetcher:
    """Yields, in order, each ``(layer, format)`` of ``jobs`` as a :class:`LayerRows` over all ``readers``,
    or over ``readers[format]`` when formats are stored in different chunks (tensor parallelism: a rank
    stores the hidden states of only some chunks).

    ``row_shapes`` gives each format's per-token shape and ``dtype`` the stored dtype the model expects: a
    chunk whose tensor differs is reported as bad, never reshaped into place.
    """

    def __init__(
        self,
        readers: list[ChunkReader] | dict[str, list[ChunkReader]],
        jobs: list[tuple[int, str]],
        row_shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        pool: ReaderPool | None = None,
        depth: int = DEFAULT_DEPTH,
    ):
        self.readers = readers if isinstance(readers, dict) else dict.fromkeys(row_shapes, readers)
        # Each file belongs to one pool thread (by its position among all files), whatever the format.
        files = dict.fromkeys(id(r) for rs in self.readers.values() for r in rs)
        self._position = {file: i for i, file in enumerate(files)}
        self.jobs, self.row_shapes, self.dtype = jobs, row_shapes, dtype
        self.device, self.pool, self.depth = torch.device(device), pool, max(1, depth)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda and pool is not None else None
        self._futures: list[Future] = []  # per layer: its upload
        self._reads: list[Future] = []  # every read submitted

    def __enter__(self) -> "LayerPrefetcher":
        if self.pool is not None:
            for i in range(min(self.depth, len(self.jobs))):
                self._submit(i)
        return self

    def __exit__(self, *exc) -> None:
        for f in (*self._reads, *self._futures):  # the files close after this: no read may still be running
            f.exception()

    def __iter__(self):
        for i, (layer, fmt) in enumerate(self.jobs):
            if self.pool is None:
                buf = self._new_buffer(fmt)
                rows = self._finish(layer, fmt, buf, [self._read(layer, fmt, buf, 0, 1)])
                rows.rows = rows.rows.to(self.device)
                yield rows
                continue
            if i + self.depth < len(self.jobs):
                self._submit(i + self.depth)
            rows, event = self._futures[i].result()
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
                rows.rows.record_stream(torch.cuda.current_stream(self.device))
            yield rows

    # ---- internals ---------------------------------------------------------------------------------
    def _new_buffer(self, fmt: str) -> torch.Tensor:
        shape = (len(self.readers[fmt]) * CHUNK_TOKENS, *self.row_shapes[fmt])
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.cuda)

    def _submit(self, i: int) -> None:
        layer, fmt = self.jobs[i]
        buf = self._new_buffer(fmt)
        workers = len(self.pool.readers)
        reads = [w.submit(self._read, layer, fmt, buf, k, workers) for k, w in enumerate(self.pool.readers)]
        self._reads += reads
        self._futures.append(self.pool.uploader.submit(self._upload, layer, fmt, buf, reads))

    def _read(self, layer: int, fmt: str, buf: torch.Tensor, first: int, step: int) -> tuple[int, Exception] | None:
        """Fill the rows of the files at positions ``first, first+step, …``; stop at this thread's first bad one."""
        readers = self.readers[fmt]
        for j in (j for j, r in enumerate(readers) if self._position[id(r)] % step == first):
            try:  # straight into the layer buffer; a tensor of another shape or dtype is refused
                readers[j].read_into(layer, fmt, buf[j * CHUNK_TOKENS : (j + 1) * CHUNK_TOKENS])
            except (ChunkInvalid, OSError) as exc:
                return j, exc
        return None

    def _upload(self, layer: int, fmt: str, buf: torch.Tensor, reads: list[Future]) -> tuple[LayerRows, object]:
        rows = self._finish(layer, fmt, buf, [f.result() for f in reads])
        if self.stream is None:
            return rows, None
        with torch.cuda.stream(self.stream):
            rows.rows = buf.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return rows, event

    def _finish(self, layer: int, fmt: str, buf: torch.Tensor, bads: list) -> LayerRows:
        bad = min((b for b in bads if b is not None), key=lambda b: b[0], default=None)
        return LayerRows(layer, fmt, buf, bad)
