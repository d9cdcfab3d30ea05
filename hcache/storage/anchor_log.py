"""Which chains a prefix was stored under, to tell "stored under another model, settings or namespace" from
"never stored" when a look-up misses at a conversation's first chunk.

A chain's keys are rooted in the model fingerprint and the namespace, so another model's (or another
tenant's) copy of the same tokens is invisible to a look-up. The log maps the content of a chain's first
chunk (its tokens alone, :func:`~hcache.storage.chunk_key.content_key`) to opaque labels of the roots it was
saved under; the caller decides what a label means. Kept in memory (the latest ``ANCHORS_KEPT`` prefixes)
and, where the store has a local directory, appended to a file there, so a restarted server (say, after a
model or settings change) can still say why its first look-ups miss. The file is advisory: a torn or
foreign line is skipped, and it is compacted to the kept entries when it grows past twice their number.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

ANCHORS_FILE = "anchors.log"
ANCHORS_KEPT = 1 << 14


class AnchorLog:
    """Content key of a chain's first chunk -> the labels of the roots it was saved under. ``path``: the
    log file (None: memory only). ``consult``: other stores' logs (another layout's, beside this one), read
    once now and never written: their labels are answered too."""

    def __init__(
        self, path: str | os.PathLike | None, kept: int = ANCHORS_KEPT, consult: Iterable[str | os.PathLike] = ()
    ):
        self.path, self.kept = (Path(path) if path is not None else None), kept
        self._labels: OrderedDict[str, set[str]] = OrderedDict()
        self._lines = 0
        self._lock = threading.Lock()
        for content, label in _entries(self.path):
            self._lines += 1
            self._remember(content, label)
        self._consulted: dict[str, set[str]] = {}
        for other in consult:
            for content, label in _entries(Path(other)):
                self._consulted.setdefault(content, set()).add(label)

    def add(self, content: str, label: str) -> None:
        """Note that the chain whose first chunk has ``content`` was saved under ``label``."""
        if any(c.isspace() for c in content + label) or not content or not label:
            raise ValueError("anchor log entries are single words")
        with self._lock:
            if label in self._labels.get(content, ()):
                self._labels.move_to_end(content)
                return
            self._remember(content, label)
            if self.path is not None:
                self._append(f"{content} {label}\n")

    def labels(self, content: str) -> frozenset[str]:
        """The labels ``content``'s chains were saved under (of the latest ``kept`` prefixes)."""
        with self._lock:
            return frozenset(self._labels.get(content, ())) | self._consulted.get(content, set())

    def _remember(self, content: str, label: str) -> None:
        self._labels.setdefault(content, set()).add(label)
        self._labels.move_to_end(content)
        while len(self._labels) > self.kept:
            self._labels.popitem(last=False)

    def _append(self, line: str) -> None:
        try:
            if self._lines >= 2 * self.kept:
                self._compact()
            with _private(self.path, os.O_APPEND) as f:
                f.write(line)
            self._lines += 1
        except OSError as exc:
            log.warning("cannot write the anchor log %s: %s", self.path, exc)

    def _compact(self) -> None:
        """Rewrite the file with the entries kept, atomically: a reader sees the old file or the new one."""
        entries = [f"{content} {label}\n" for content, labels in self._labels.items() for label in sorted(labels)]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with _private(tmp, os.O_TRUNC) as f:
            f.write("".join(entries))
        os.replace(tmp, self.path)
        self._lines = len(entries)


def _entries(path: Path | None) -> Iterator[tuple[str, str]]:
    """A log file's entries (content, label), its torn or foreign lines skipped; none if it cannot be read."""
    if path is None or not path.exists():
        return
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:  # advisory: a store without it only reports fewer reasons
        log.warning("cannot read the anchor log %s: %s", path, exc)
        return
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            yield parts[0], parts[1]


def _private(path: Path, mode: int):
    """``path`` opened for writing, 0600 whatever the umask, as the store's other files: it holds hashes of
    the conversations' first tokens."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o600), "w")
