"""``hcache store``: inspect, verify and evict the chunks of a disk store's directory, also while a server
holds it.

A live store is locked by the process serving it (:mod:`.dir_lock`); these commands do not take that lock.
They read chunk files directly, never write the manifest, the lock or any chunk, skip the temporary files
of writes in flight (``.*.tmp``), and delete only whole chunk files with ``os.unlink``. The serving process
forgets a deleted chunk the first time it reads it (:meth:`~.disk_store.DiskChunkStore.read_into` treats a
missing file as a miss and drops it from its index). A chunk of another layout version (another hcache's,
in a rolling upgrade sharing the store) is reported and never deleted.

The parser is built without importing torch: the chunk code is imported when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


class _BadArguments(Exception):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "store", help="inspect, verify or evict the chunks of a store directory (also while a server holds it)"
    )
    ops = p.add_subparsers(dest="store_command", required=True)
    inspect = ops.add_parser("inspect", help="chunks, bytes, formats and encodings, layers, models, ages (read-only)")
    inspect.add_argument("dir", metavar="DIR", help="a store directory (hcache serve --store-dir)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    verify = ops.add_parser("verify", help="read every chunk and check every checksum; exit status 1 if any is bad")
    verify.add_argument("dir", metavar="DIR", help="a store directory")
    verify.add_argument("--repair", action="store_true", help="remove the chunks that fail verification")
    evict = ops.add_parser("evict", help="remove the chunks that match every filter given")
    evict.add_argument("dir", metavar="DIR", help="a store directory")
    evict.add_argument(
        "--older-than", type=float, default=None, metavar="SECONDS", help="not used (file time) for this long"
    )
    evict.add_argument(
        "--namespace", default=None, metavar="NS", help="saved under this namespace (found by walking key chains)"
    )
    evict.add_argument("--model", default=None, metavar="FINGERPRINT", help="saved by the model of this fingerprint")


@dataclass
class _File:
    path: Path
    key: str
    size: int
    mtime: float
    ino: int


def _store_dir(arg: str) -> Path:
    from .chunk_key import LAYOUT_VERSION
    from .store_dir import MANIFEST

    d = Path(arg)
    manifest = d / MANIFEST
    if not d.is_dir() or not manifest.is_file() or not (d / "chunks").is_dir():
        raise _BadArguments(f"{arg} is not a store directory (no {MANIFEST} and chunks/)")

    try:
        record = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise _BadArguments(f"{arg}: unreadable {MANIFEST}: {exc}") from None
    if not isinstance(record, dict) or record.get("layout_version") != LAYOUT_VERSION:
        version = record.get("layout_version") if isinstance(record, dict) else None
        raise _BadArguments(f"store {arg} has layout version {version!r}, this hcache reads {LAYOUT_VERSION}")
    return d


def _chunk_files(d: Path) -> list[_File]:
    """The published chunk files (``chunks/<key[:2]>/<key>.safetensors``); temporary files are skipped."""
    from .store_dir import SUFFIX, key_of  # imports torch: here, so that `hcache --help` does not

    files = []
    for path in sorted((d / "chunks").glob("*/*" + SUFFIX)):
        key = key_of(path)
        if key is None:
            continue
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # evicted meanwhile
        files.append(_File(path, key, st.st_size, st.st_mtime, st.st_ino))
    return files


def _header(f: _File) -> tuple[str, dict, dict]:
    """(status, tensors {(layer, format): dtype}, metadata) of a chunk from its header: status ``ok``,
    ``other version``, ``bad: <reason>`` or ``gone`` (deleted meanwhile)."""
    from .chunk import ChunkInvalid, ChunkOtherVersion, read_header

    try:
        with open(f.path, "rb") as file:
            layout, meta = read_header(file, f.key, f.size)
    except FileNotFoundError:
        return "gone", {}, {}
    except ChunkOtherVersion:
        return "other version", {}, {}
    except ChunkInvalid as exc:
        return f"bad: {exc}", {}, {}
    except OSError as exc:
        return f"bad: unreadable ({exc})", {}, {}
    return "ok", {name: entry.dtype for name, entry in layout.entries.items()}, meta


def _dtype_name(dtype) -> str:
    """An 8-bit encoding's name (``int8``, ``fp8``), or the dtype's (``float16``)."""
    from .stored_state import Encoding

    return next((e.value for e in Encoding if e.dtype == dtype), str(dtype).removeprefix("torch."))


def inspect(d: Path) -> dict:
    from .stored_state import base_format

    files = _chunk_files(d)
    status, formats, models, layers = Counter(), {}, Counter(), Counter()
    for f in files:
        state, tensors, meta = _header(f)
        status[state.split(":")[0]] += 1
        if state != "ok":
            continue
        models[meta.get("fingerprint", "")] += 1
        seen = set()
        for (_, fmt), dtype in tensors.items():
            if fmt == base_format(fmt):  # not a scale tensor
                seen.add((fmt, _dtype_name(dtype)))
        for fmt, encoding in seen:
            formats.setdefault(fmt, Counter())[encoding] += 1
        layers.update({layer for layer, _ in tensors})
    mtimes = [f.mtime for f in files]
    now = time.time()
    return {
        "dir": str(d),
        "chunks": len(files),
        "bytes": sum(f.size for f in files),
        "readable": status["ok"],
        "other_version": status["other version"],
        "bad_header": status["bad"],
        "formats": {fmt: dict(sorted(c.items())) for fmt, c in sorted(formats.items())},  # chunks holding each
        "layers": dict(
            sorted(layers.items())
        ),  # chunks holding each layer: a sliding-window layer's, only near each save's end
        "models": dict(models.most_common()),
        "namespaces": None,
        "namespaces_note": "not recorded in chunk metadata (a namespace is hashed into the chain's keys); evict --namespace finds its chunks by walking the key chains",
        "oldest_age_s": round(now - min(mtimes), 1) if mtimes else None,
        "newest_age_s": round(now - max(mtimes), 1) if mtimes else None,
        "quota_bytes": None,
        "quota_note": "not recorded in the store: a quota is a setting of the process serving it (store.quota_bytes)",
    }


def _print_inspect(r: dict) -> None:
    print(f"store {r['dir']}: {r['chunks']} chunks, {r['bytes']} bytes")
    print(f"  readable {r['readable']}, other layout version {r['other_version']}, bad header {r['bad_header']}")
    for fmt, encodings in r["formats"].items():
        print(f"  format {fmt}: " + ", ".join(f"{e} in {n} chunks" for e, n in encodings.items()))
    by_count: dict[int, list[int]] = {}
    for layer, n in r["layers"].items():
        by_count.setdefault(n, []).append(layer)
    for n, layers in sorted(by_count.items(), reverse=True):
        print(f"  layers {', '.join(map(str, layers))}: in {n} chunks")
    for fingerprint, n in r["models"].items():
        print(f"  model {fingerprint}: {n} chunks")
    print(f"  namespaces: {r['namespaces_note']}")
    if r["chunks"]:
        print(f"  ages (file time): oldest {r['oldest_age_s']:.0f} s, newest {r['newest_age_s']:.0f} s")
    print(f"  quota: {r['quota_note']}")


def _same_file(f: _File) -> bool:
    """Whether ``f.path`` is still the file that was looked at (a server may have replaced it since)."""
    try:
        return os.stat(f.path).st_ino == f.ino
    except OSError:
        return False


def verify(d: Path, repair: bool) -> int:
    import torch
    from tqdm import tqdm

    from .chunk import ChunkImage, ChunkInvalid, ChunkOtherVersion

    files = _chunk_files(d)
    good, other, bad, removed = 0, [], [], 0
    for f in tqdm(files, desc="verifying chunks", unit="chunk", file=sys.stderr, disable=None, leave=False):
        try:
            with open(f.path, "rb") as file:
                f.ino = os.fstat(file.fileno()).st_ino  # the file read, whatever happens to the path
                data = file.read()
            buffer = torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)
            ChunkImage.parse(buffer, f.key, len(data), verify=True)
            good += 1
        except FileNotFoundError:
            continue  # evicted by the server meanwhile
        except ChunkOtherVersion as exc:
            other.append((f, str(exc)))
        except (ChunkInvalid, OSError) as exc:
            bad.append((f, str(exc)))
            if repair and isinstance(exc, ChunkInvalid) and exc.discard and _same_file(f):
                try:
                    os.unlink(f.path)
                    removed += 1
                except FileNotFoundError:
                    pass
    for f, why in bad:
        print(f"bad: {f.path}: {why}")
    for f, why in other:
        print(f"other version (left alone): {f.path}: {why}")
    print(
        f"verified {len(files)} chunks in {d}: {good} good, {len(bad)} bad, {len(other)} of another layout version"
        + (f"; removed {removed} bad" if repair else "")
    )
    return 1 if bad else 0


def _namespace_keys(files: list[_File], namespace: str, headers: dict) -> set[str]:
    """The keys of the chunks saved under ``namespace``: the chains from its roots (one per model), a level
    at a time. A chunk whose parent is gone cannot be placed and is not matched."""
    from .chunk_key import next_key, root_key

    by_model: dict[str, list[tuple[str, list[int]]]] = {}
    for f in files:
        status, _, meta = headers[f.key]
        if status == "ok":
            try:
                by_model.setdefault(meta.get("fingerprint", ""), []).append(
                    (f.key, json.loads(meta.get("tokens", "null")))
                )
            except ValueError:
                continue
    found: set[str] = set()
    for fingerprint, chunks in by_model.items():
        parents, left = [root_key(fingerprint, namespace)], chunks
        while parents and left:
            level, rest = [], []
            for key, tokens in left:
                (level if any(next_key(p, tokens) == key for p in parents) else rest).append((key, tokens))
            parents, left = [key for key, _ in level], rest
            found.update(parents)
    return found


def evict(d: Path, older_than: float | None, namespace: str | None, model: str | None) -> int:
    files = _chunk_files(d)
    headers = {f.key: _header(f) for f in files}
    in_namespace = _namespace_keys(files, namespace, headers) if namespace is not None else None
    now, removed, freed, kept_other = time.time(), 0, 0, 0
    for f in files:
        status, _, meta = headers[f.key]
        if status == "gone":
            continue
        if status == "other version":
            kept_other += 1
            continue
        if older_than is not None and now - f.mtime < older_than:
            continue
        if model is not None and (status != "ok" or meta.get("fingerprint") != model):
            continue
        if in_namespace is not None and f.key not in in_namespace:
            continue
        if not _same_file(f):
            continue  # rewritten since it was read: look again next time
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            continue
        removed += 1
        freed += f.size
    print(
        f"evicted {removed} chunks, {freed} bytes from {d}"
        + (f" ({kept_other} of another layout version left alone)" if kept_other else "")
    )
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        if args.store_command == "evict":
            if args.older_than is None and args.namespace is None and args.model is None:
                raise _BadArguments(
                    "store evict needs a filter: --older-than SECONDS, --namespace NS or --model FINGERPRINT"
                )
            if args.older_than is not None and not args.older_than >= 0:
                raise _BadArguments(f"--older-than must be a number of seconds >= 0, not {args.older_than}")
            if args.namespace is not None:
                from ..errors import InvalidRequestError
                from .chunk_key import check_namespace

                try:
                    check_namespace(args.namespace, "--namespace")
                except InvalidRequestError as exc:
                    raise _BadArguments(str(exc)) from None
        d = _store_dir(args.dir)
    except _BadArguments as exc:
        print(f"hcache store: error: {exc}", file=sys.stderr)
        return 2
    if args.store_command == "inspect":
        report = inspect(d)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print_inspect(report)
        return 0
    if args.store_command == "verify":
        return verify(d, args.repair)
    return evict(d, args.older_than, args.namespace, args.model)
