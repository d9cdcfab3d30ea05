"""Where chunks live. A store maps a chunk key to the chunk's bytes; it knows nothing of models."""
from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import BinaryIO, Protocol

from ..errors import StorageError
from .chunk_key import LAYOUT_VERSION


class ChunkStore(Protocol):
    bytes_written: int

    def contains(self, key: str) -> bool: ...

    def open(self, key: str) -> BinaryIO | None:
        """The chunk's bytes as a seekable binary file (the caller closes it), or None if absent."""

    def put(self, key: str, data: bytes) -> None: ...

    def discard(self, key: str) -> None: ...


class DirectoryChunkStore:
    """Chunk files under one directory: ``chunks/<key[:2]>/<key>.safetensors``.

    A chunk is written to a temporary name and renamed into place, so a reader sees either no chunk or a
    whole one. The directory is checked for writability up front: a store that cannot save fails when it
    is opened, not in the middle of serving.
    """

    _MARKER = "hcache-store.json"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.bytes_written = 0
        self._lock = threading.Lock()
        try:
            (self.root / "chunks").mkdir(parents=True, exist_ok=True)
            marker = self.root / self._MARKER
            if marker.exists():
                version = json.loads(marker.read_text()).get("layout_version")
                if version != LAYOUT_VERSION:
                    raise StorageError(
                        f"store {self.root} has layout version {version}, this hcache reads {LAYOUT_VERSION}; "
                        f"use a new directory"
                    )
            else:
                self._write_atomic(marker, json.dumps({"layout_version": LAYOUT_VERSION}).encode())
            probe = self.root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"chunk store {self.root} is not a writable directory: {exc}") from exc

    def _path(self, key: str) -> Path:
        return self.root / "chunks" / key[:2] / f"{key}.safetensors"

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def open(self, key: str) -> BinaryIO | None:
        try:
            return open(self._path(key), "rb", buffering=0)
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        self._write_atomic(path, data)
        with self._lock:
            self.bytes_written += len(data)

    def discard(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "chunks").glob("*/*.safetensors"))
