"""A disk store's directory: made private, locked to one process, labelled with its layout and savers, and
where each chunk's file is.

Each directory of a store holds ``chunks/<key[:2]>/<key>.safetensors`` and ``hcache-store.json``, its manifest: the layout version,
which a store of another version refuses, and the labels (for the runtime: model fingerprint and dtype) of
everyone who has saved there. Labels are opaque here. Directories are 0700 whatever the umask: the chunk
files hold token ids in clear. Opening one takes its lock (:mod:`.dir_lock`) before reading the manifest.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import StorageError
from . import dir_lock
from . import direct_io as dio
from .chunk_key import LAYOUT_VERSION

MANIFEST = "hcache-store.json"
DIR_MODE = 0o700
CHUNK_KEY = re.compile(r"[0-9a-f]{32}")
SUFFIX = ".safetensors"


def chunk_path(directory: Path, key: str) -> Path:
    """Where a store directory keeps the chunk ``key``."""
    return directory / "chunks" / key[:2] / f"{key}{SUFFIX}"


def key_of(path: Path) -> str | None:
    """The key of the chunk file at ``path``, or None for any other file (a temporary one, say)."""
    key = path.name[: -len(SUFFIX)]
    return key if path.name.endswith(SUFFIX) and CHUNK_KEY.fullmatch(key) and path.parent.name == key[:2] else None


def directories(dirs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """A store's directories, one or a list of them: at least one, none listed twice."""
    paths = [Path(dirs)] if isinstance(dirs, (str, os.PathLike)) else [Path(p) for p in dirs]
    if not paths:
        raise StorageError("a chunk store needs at least one directory")
    if len({p.resolve() for p in paths}) != len(paths):
        raise StorageError(f"a directory is listed twice in {[str(p) for p in paths]}")
    return paths


def open_dir(d: Path, labels: dict[str, str] | None, shared: bool) -> tuple[Callable[[], None], bool]:
    """Create and lock ``d`` and record ``labels`` in its manifest (None: only check it); returns the
    lock's release and whether this is the only store object of the process on ``d``."""
    try:
        for sub in (d, d / "chunks"):
            sub.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            os.chmod(sub, DIR_MODE)
    except OSError as exc:
        raise StorageError(f"chunk store {d} is not a writable directory: {exc}") from exc
    release, first = dir_lock.acquire(d, shared)
    try:
        manifest = d / MANIFEST
        record = json.loads(manifest.read_text()) if manifest.exists() else {"layout_version": LAYOUT_VERSION}
        if not isinstance(record, dict):
            raise StorageError(f"store {d}: {MANIFEST} is not a JSON object; use a new directory")
        if record.get("layout_version") != LAYOUT_VERSION:
            raise StorageError(
                f"store {d} has layout version {record.get('layout_version')!r}, this hcache reads "
                f"{LAYOUT_VERSION}; use a new directory"
            )
        producers = record.setdefault("producers", [])
        if not isinstance(producers, list):
            raise StorageError(f"store {d}: the producers in {MANIFEST} are not a list; use a new directory")
        if labels is not None and (not manifest.exists() or (labels and labels not in producers)):
            if labels:
                producers.append(labels)
            tmp = d / f".{MANIFEST}.{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dio.FILE_MODE)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record, indent=1))
            os.replace(tmp, manifest)
    except (OSError, ValueError) as exc:
        release()
        raise StorageError(f"chunk store {d} is not a writable directory: {exc}") from exc
    except BaseException:
        release()
        raise
    return release, first
