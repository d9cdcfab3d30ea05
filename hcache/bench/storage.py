"""Chunk store read/write throughput against raw sequential O_DIRECT I/O, and the saver's decode overhead.

All three figures are measured side by side in one run on the same directories:
- ``write_ratio``: chunk-store write throughput (published into the host pool, written back by
  ``--threads`` writers straight from the slots: atomic publish, fsync, round-robin over the directories)
  over a raw sequential O_DIRECT write of the same bytes, one large file per directory, fdatasync'd at the
  end.
- ``read_ratio``: chunk-store read throughput (a restore of chunks not in memory: one O_DIRECT read per
  chunk into a host-pool slot, every checksum verified, by ``--threads`` readers) over a raw sequential
  O_DIRECT read of those large files.
- ``save_overhead``: time per decode step with the two-stage saver on over off, on the reference engine;
  runs are interleaved and the median of the per-round ratios is taken.
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from ..storage import direct_io
from ..storage.chunk import Chunk, encode
from ..storage.chunk_key import CHUNK_TOKENS, next_key, root_key
from ..storage.store_config import StoreConfig
from ..transfer.host_pool import PAGE

_BLOCK = 4 << 20  # raw I/O request size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dirs", nargs="+", default=None, help="directories to test, one per SSD (default: one temporary directory)")
    parser.add_argument("--chunks", type=int, default=64, help="chunks written and read")
    parser.add_argument("--layers", type=int, default=30, help="layers per chunk")
    parser.add_argument("--width", type=int, default=576, help="values per token and layer (fp32)")
    parser.add_argument("--threads", type=int, default=8, help="store writers and readers")
    parser.add_argument("--repeats", type=int, default=3, help="alternating store/raw I/O repeats")
    parser.add_argument("--model", default="smollm2", help="model for the saver overhead ('smollm2', 'random:llama', ...)")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved on/off rounds")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch threads for the decode loop (default: torch's own)"
    )


def run(args: argparse.Namespace) -> dict:
    scratch = None
    if args.dirs is None:
        scratch = tempfile.mkdtemp(prefix="hcache-bench-storage-")
        dirs = [Path(scratch)]
    else:
        dirs = [Path(d) / f"hcache-bench-{os.getpid()}" for d in args.dirs]
    try:
        io_result = _io_benchmark(dirs, args)
    finally:
        for d in [Path(scratch)] if scratch else dirs:
            shutil.rmtree(d, ignore_errors=True)
    save_result = _save_overhead(args)
    result = {**io_result, **save_result}
    print(
        f"write: store {result['store_write_mb_s']:.0f} MB/s, raw O_DIRECT {result['raw_write_mb_s']:.0f} MB/s, "
        f"ratio {result['write_ratio']:.2f}\n"
        f"read:  store {result['store_read_mb_s']:.0f} MB/s, raw O_DIRECT {result['raw_read_mb_s']:.0f} MB/s, "
        f"ratio {result['read_ratio']:.2f}\n"
        f"decode step: saving off {result['step_ms_off']:.1f} ms, on {result['step_ms_on']:.1f} ms, "
        f"overhead {result['save_overhead'] * 100:+.1f}% (saver stalls: {result['saver_stalls']})\n"
        "absolute figures depend on this machine's disk and CPU; compare only the ratios, measured side by side"
    )
    return result


# ---- chunk store against raw sequential I/O ------------------------------------------------------------
def _chunks(args: argparse.Namespace) -> list[tuple[Chunk, bytes]]:
    g = torch.Generator().manual_seed(0)
    root, out = root_key("bench"), []
    for i in tqdm(range(args.chunks), desc="encoding chunks", leave=False):
        tokens = torch.randint(0, 50_000, (CHUNK_TOKENS,), generator=g).tolist()
        tensors = {(layer, "H"): torch.randn(CHUNK_TOKENS, args.width, generator=g) for layer in range(args.layers)}
        chunk = Chunk(next_key(root, tokens + [i]), tokens, "bench", tensors)
        out.append((chunk, encode(chunk)))
    return out


def _io_benchmark(dirs: list[Path], args: argparse.Namespace) -> dict:
    """Store and raw I/O alternate, ``--repeats`` times; throughputs and ratios are medians over repeats,
    so a disk shared with other work disturbs both sides alike."""
    chunks = _chunks(args)
    total = sum(len(data) for _, data in chunks)
    tier = StoreConfig(host_bytes=total + (len(chunks) + 1) * PAGE, writers=args.threads).open_store(dirs, readers=args.threads)
    raw_files = [d / "raw-sequential.bin" for d in dirs]
    share = -(-total // len(dirs))

    def store_write() -> None:
        """As the saver publishes: into the host pool, written back by the tier's writers (fsync per chunk)."""
        for chunk, _ in chunks:
            tier.put(chunk)
        tier.flush()

    def store_read() -> None:
        """As a restore of chunks not in memory: one read per chunk into a pool slot, every checksum verified."""
        tier.drop_resident()
        for image in [f.result() for f in [tier.fetch(chunk.key) for chunk, _ in chunks]]:
            tier.release(image)

    times: dict[str, list[float]] = {"store_write": [], "raw_write": [], "store_read": [], "raw_read": []}
    with ThreadPoolExecutor(len(dirs)) as raw_pool:
        for _ in tqdm(range(args.repeats), desc="I/O repeats (store and raw)", leave=False):
            for key in tier.keys():
                tier.discard(key)
            for name, work in [
                ("store_write", store_write),
                ("raw_write", lambda: list(raw_pool.map(lambda p: _raw_write(p, share), raw_files))),
                ("store_read", store_read),
                ("raw_read", lambda: list(raw_pool.map(_raw_read, raw_files))),
            ]:
                began = time.perf_counter()
                work()
                times[name].append(time.perf_counter() - began)
    tier.close()
    direct_raw = [direct_io.supports_direct(d) for d in dirs]
    mb = total / 1e6
    return {
        "bytes": total,
        "directories": len(dirs),
        "direct_io": {"store": tier.stores[0].direct, "raw": direct_raw},
        **{f"{name}_mb_s": mb / statistics.median(t) for name, t in times.items()},
        "write_ratio": statistics.median(r / s for r, s in zip(times["raw_write"], times["store_write"])),
        "read_ratio": statistics.median(r / s for r, s in zip(times["raw_read"], times["store_read"])),
    }


def _raw_write(path: Path, nbytes: int) -> None:
    fd, _ = direct_io.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True)
    buf = mmap.mmap(-1, _BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(os.urandom(_BLOCK))
    try:
        for offset in range(0, nbytes, _BLOCK):
            os.pwrite(fd, buf, offset)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _raw_read(path: Path) -> int:
    fd, _ = direct_io.open_fd(path, os.O_RDONLY, True)
    buf, offset = mmap.mmap(-1, _BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), 0
    try:
        while (n := os.preadv(fd, [buf], offset)) > 0:
            offset += n
    finally:
        os.close(fd)
    return offset


# ---- the saver on a decode loop ---------------------------------------------------------------------------
def _save_overhead(args: argparse.Namespace) -> dict:
    from ..model_loader import load_model
    from ..runtime import HCacheRuntime

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    loaded = load_model(args.model)
    g = torch.Generator().manual_seed(1)

    def batch() -> list[list[int]]:  # fresh prompts each round: repeated ones would be deduplicated, not saved
        return [torch.randint(0, loaded.spec.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]

    with tempfile.TemporaryDirectory(prefix="hcache-bench-saver-") as tmp:
        runtimes = {on: HCacheRuntime(loaded, Path(tmp) / str(on), save="plan" if on else "none") for on in (True, False)}
        for rt in runtimes.values():  # warm-up: first-call allocations, thread start
            rt.generate_batch(batch(), 4, restore=False, stop_token_ids=set())
        steps: dict[bool, list[float]] = {True: [], False: []}
        for _ in tqdm(range(args.rounds), desc="decode rounds (saving on/off)", leave=False):
            prompts = batch()
            for on in (True, False):
                began = time.perf_counter()
                results = runtimes[on].generate_batch(prompts, args.steps, restore=False, stop_token_ids=set())
                total = time.perf_counter() - began  # includes the saver's drain at the end of the request
                steps[on].append((total - results[0].ttft_s) / (args.steps - 1))
        saver = runtimes[True].saver
        stalls, written = saver.stalls, saver.chunks_published
        for rt in runtimes.values():
            rt.close()
    ratios = [on / off for on, off in zip(steps[True], steps[False])]
    return {
        "save_overhead": statistics.median(ratios) - 1,
        "step_ms_on": statistics.median(steps[True]) * 1e3,
        "step_ms_off": statistics.median(steps[False]) * 1e3,
        "saver_stalls": stalls,
        "saver_chunks_published": written,
        "decode": {
            "model": args.model,
            "batch": args.batch,
            "prompt": args.prompt,
            "steps": args.steps,
            "rounds": args.rounds,
            "torch_threads": torch.get_num_threads(),
        },
    }
