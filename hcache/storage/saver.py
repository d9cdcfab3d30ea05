"""Turns a forward pass's per-layer rows into stored chunks.

The engine hands over, once per layer per batch, the rows of the whole ragged batch (the rows the caller
chose to save, keyed by format). The saver copies each sequence's rows into that sequence's pending chunk
and writes every chunk that becomes full. Only full 64-token chunks are ever stored; the trailing partial
chunk of a finished sequence is dropped and gets prefilled again by the next request (exact, at most 63
tokens of recompute), so a stored chunk is immutable once written.

This is the synchronous form of the paper's two-stage saver; the staging ring and the flushing threads
slot in behind the same three calls.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..ragged import Segment
from .chunk import Chunk, encode
from .chunk_key import CHUNK_TOKENS, next_key
from .chunk_store import ChunkStore

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    parent_key: str  # key of the last stored chunk (or the chain root)
    tokens: list[int] = field(default_factory=list)  # tokens past the stored prefix
    rows: dict[tuple[int, str], list[torch.Tensor]] = field(default_factory=dict)


class ChunkSaver:
    def __init__(self, store: ChunkStore, fingerprint: str):
        self.store = store
        self.fingerprint = fingerprint
        self.chunks_written = 0
        self.chunks_deduplicated = 0
        self.save_errors = 0
        self._pending: dict[int, _Pending] = {}
        self._segments: list[Segment] = []

    def open(self, uid: int, parent_key: str) -> None:
        """Start saving sequence ``uid`` whose tokens up to the chunk ``parent_key`` are already stored."""
        self._pending[uid] = _Pending(parent_key)

    def add_tokens(self, uid: int, tokens: list[int]) -> None:
        """Tokens about to be processed for ``uid``; their rows arrive with the next batch."""
        self._pending[uid].tokens.extend(tokens)

    def close(self, uid: int) -> None:
        """Forget ``uid``; rows of its trailing partial chunk are dropped."""
        self._pending.pop(uid, None)

    # ---- the capture side: called by the engine's forward ------------------------------------------
    def begin_batch(self, segments: list[Segment]) -> None:
        self._segments = [s for s in segments if s.uid in self._pending]

    def on_layer(self, layer: int, rows: dict[str, torch.Tensor]) -> None:
        for s in self._segments:
            pending = self._pending[s.uid]
            for fmt, t in rows.items():
                pending.rows.setdefault((layer, fmt), []).append(t[s.row : s.row + s.length].detach().to("cpu", copy=True))

    def end_batch(self) -> None:
        for s in self._segments:
            self._flush_full(s.uid)
        self._segments = []

    def _flush_full(self, uid: int) -> None:
        pending = self._pending[uid]
        while len(pending.tokens) >= CHUNK_TOKENS and pending.rows and all(
            sum(r.shape[0] for r in parts) >= CHUNK_TOKENS for parts in pending.rows.values()
        ):
            tokens = pending.tokens[:CHUNK_TOKENS]
            key = next_key(pending.parent_key, tokens)
            tensors = {}
            for name, parts in pending.rows.items():
                rows = torch.cat(parts)
                tensors[name] = rows[:CHUNK_TOKENS]
                pending.rows[name] = [rows[CHUNK_TOKENS:]]
            if self.store.contains(key):
                self.chunks_deduplicated += 1
            else:
                try:
                    self.store.put(key, encode(Chunk(key, tokens, self.fingerprint, tensors)))
                    self.chunks_written += 1
                except OSError as exc:  # saving degrades; serving goes on and the chunk is recomputed later
                    self.save_errors += 1
                    log.warning("could not save chunk %s: %s", key, exc)
            pending.parent_key = key
            pending.tokens = pending.tokens[CHUNK_TOKENS:]
