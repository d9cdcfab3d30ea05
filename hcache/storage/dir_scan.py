"""A disk store's start-up: the chunk files in its directories, each checked, from which its index is
rebuilt. Temporary files are writes that never got published: deleted, unless another store object may be
writing them (a shared directory, or one another object of the process has open), and then only a day old.
A bad file is deleted; a file of another layout version is another hcache's, left alone; a chunk in two
directories keeps its newer copy. Each file's time is its last use, and its header names its parent."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .chunk import ChunkImage, ChunkInvalid, ChunkOtherVersion, read_header
from .lru_index import Entry
from .store_dir import key_of

log = logging.getLogger(__name__)

STALE_TMP_S = 86400.0  # a temporary file this old is an abandoned write, whoever may be writing


@dataclass
class Scan:
    chunks: dict[str, tuple[Path, Entry]] = field(
        default_factory=dict
    )  # good ones: entries' ``where`` is the directory's index
    dropped: list[str] = field(default_factory=list)  # keys of the files found bad, deleted
    other_version: int = 0  # files of another layout version, left alone


def scan(dirs: list[Path], verify: str, sole: list[bool]) -> Scan:
    """Check every chunk file in ``dirs`` (``verify``: ``"header"`` reads its header, ``"full"`` every checksum
    too, ``"none"`` nothing, so no parent is known); ``sole``: per directory, whether no other store object
    may be writing there."""
    found = Scan()
    for i, d in enumerate(dirs):
        for path in (d / "chunks").glob("*/*"):
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                if sole[i] or _age(path) > STALE_TMP_S:
                    path.unlink(missing_ok=True)
                continue
            key = key_of(path)
            if key is None:
                continue
            parent = ""
            try:
                st = path.stat()
                if verify == "full":
                    data = torch.frombuffer(bytearray(path.read_bytes()) or bytearray(1), dtype=torch.uint8)
                    parent = ChunkImage.parse(data, key, st.st_size).parent
                elif verify == "header":
                    with open(path, "rb") as f:
                        parent = read_header(f, key, st.st_size)[1].get("parent", "")
            except ChunkOtherVersion as exc:  # another hcache's: not this store's to count, serve or delete
                log.warning("leaving chunk file %s alone: %s", path, exc)
                found.other_version += 1
                continue
            except (OSError, ChunkInvalid) as exc:
                log.warning("dropping chunk file %s at start-up: %s", path, exc)
                found.dropped.append(key)
                path.unlink(missing_ok=True)
                continue
            entry = Entry(st.st_size, st.st_mtime, i, stamped=st.st_mtime, parent=parent)
            if key in found.chunks:  # the same chunk in two directories: keep the newer copy
                older, newer = sorted([found.chunks[key], (path, entry)], key=lambda pe: pe[1].last_used)
                older[0].unlink(missing_ok=True)
                found.chunks[key] = newer
            else:
                found.chunks[key] = (path, entry)
    return found


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0
