"""A sequence as hcache keeps it in whichever engine runs it (the serving engine over DeepSpeed or the
reference engine, vLLM's worker): one :class:`Session` each, opened and closed by the same rules, so a
conversation is keyed, saved and anchored alike wherever it ran, and its record is the one its request-log
line writes out (:func:`~hcache.restore.records.log_requests`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..storage.anchor_log import AnchorLog
from ..storage.chunk_key import KeyChain, content_key, root_key
from ..transfer.saver import ChunkSaver, PartialChunk
from .miss_reasons import anchor_label
from .records import SequenceRecord


class SessionStack(Protocol):
    """What a session needs of the store stack it runs over (the serving layer's
    :class:`~hcache.serving.store_stack.StoreStack`, which stands above this core)."""

    fingerprint: str
    saver: ChunkSaver | None
    capture: Any  # whether the stack saves: anchors are filed only then
    anchors: AnchorLog | None


@dataclass
class Session:
    """Sequence ``uid`` of an engine over a store stack: the key chain over the tokens the engine holds (the
    saver reads it, so what the sequence saves is keyed as what it restores), its chain's root as the
    anchor log files it (:func:`~hcache.restore.miss_reasons.first_chunk_miss` reads it), and what it has
    cost (its request-log line)."""

    uid: int
    chain: KeyChain
    label: str
    record: SequenceRecord = field(default_factory=SequenceRecord)

    @classmethod
    def open(
        cls, stack: SessionStack, uid: int, namespace: str | None, record: SequenceRecord | None = None, **more
    ) -> Session:
        """Open ``uid``, its chunks keyed under ``namespace`` (None: the chunks every sequence without one
        shares), and known to ``stack``'s saver if it has one (which saves what the engine hands it: nothing
        where no format is saved). ``record``: one kept from before (vLLM's record of a request
        outlives its sequence: its load comes first, and a preempted request starts a new one); ``more``:
        an engine's own fields, where it keeps its sequences in a subclass."""
        chain = KeyChain(root_key(stack.fingerprint, namespace))
        if stack.saver is not None:
            stack.saver.open(uid, chain)
        record = SequenceRecord() if record is None else record
        return cls(uid=uid, chain=chain, label=anchor_label(stack.fingerprint, namespace), record=record, **more)

    def close(self, stack: SessionStack, *, keep_partial: bool = False, anchored: bool = True) -> PartialChunk | None:
        """Done: its full chunks published (:meth:`~hcache.transfer.saver.ChunkSaver.close`, which returns
        its partial chunk with ``keep_partial``) and, where it saved and is ``anchored`` (it did not fail
        part-way), its first chunk filed under its root, which tells a later miss of that chunk
        under another model, tenant or layout from one never stored."""
        if anchored and self.chain.chunks and stack.capture is not None:
            stack.anchors.add(content_key(self.chain.chunks[0][1]), self.label)
        return stack.saver.close(self.uid, keep_partial=keep_partial) if stack.saver is not None else None
