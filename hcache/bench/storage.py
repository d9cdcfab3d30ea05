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

With ``--tier redis://host:port/db`` (or ``--tier redis``: a server of its own on loopback) the store is
that Redis tier alone, and the raw side is redis-py on the same bytes, with as many threads:
- ``redis_read_ratio``: a restore of chunks not in memory (one GET per chunk into a pool slot, every
  checksum verified) over raw GETs of the same values; ``redis_write_ratio``: publishing (write-back by
  the tier's writers) over raw SETs.
- ``redis_layer_values_ratio``: raw pipelined GETs of one value per (chunk, layer) over raw GETs of one
  value per chunk: the other layout the store could have used.
- ``save_overhead``: as above, saving to the Redis tier (no local disk).
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
from ..storage.chunk import Chunk, ChunkLayout, encode
from ..storage.chunk_key import CHUNK_TOKENS, next_key, root_key
from ..storage.host_pool import PAGE
from ..storage.host_tier import HostTier
from ..storage.redis_server import RedisServer
from ..storage.store_config import StoreConfig
from ..storage.stored_state import TensorSpec

_BLOCK = 4 << 20  # raw I/O request size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dirs", nargs="+", default=None, help="directories to test, one per SSD (default: one temporary directory)"
    )
    parser.add_argument(
        "--tier",
        default=None,
        help="measure a Redis tier instead: redis://host:port/db, or 'redis' for a server of its own",
    )
    parser.add_argument("--chunks", type=int, default=64, help="chunks written and read")
    parser.add_argument("--layers", type=int, default=30, help="layers per chunk")
    parser.add_argument("--width", type=int, default=576, help="values per token and layer (fp32)")
    parser.add_argument("--threads", type=int, default=8, help="store writers and readers")
    parser.add_argument("--repeats", type=int, default=3, help="alternating store/raw I/O repeats")
    parser.add_argument(
        "--model", default="smollm2", help="model for the saver overhead ('smollm2', 'random:llama', ...)"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved on/off rounds")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch threads for the decode loop (default: torch's own)"
    )


def run(args: argparse.Namespace) -> dict:
    if args.tier is not None:
        return _run_redis(args)
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
    result = {**io_result, **_save_overhead(args)}
    print(
        f"write: store {result['store_write_mb_s']:.0f} MB/s, raw O_DIRECT {result['raw_write_mb_s']:.0f} MB/s, "
        f"ratio {result['write_ratio']:.2f}\n"
        f"read:  store {result['store_read_mb_s']:.0f} MB/s, raw O_DIRECT {result['raw_read_mb_s']:.0f} MB/s, "
        f"ratio {result['read_ratio']:.2f}"
    )
    _print_save(result)
    return result


def _run_redis(args: argparse.Namespace) -> dict:
    if args.tier != "redis" and not args.tier.startswith(("redis://", "rediss://")):
        raise SystemExit(
            f"bench storage --tier measures one Redis server (redis://host:port/db or 'redis'), not {args.tier!r}"
        )
    server = RedisServer().start() if args.tier == "redis" else None
    url = server.url if server else args.tier
    try:
        result = {"tier": "redis (a server of its own on loopback)" if server else url, **_redis_benchmark(url, args)}
        result.update(_save_overhead(args, tiers=(url,)))
    finally:
        if server:
            server.close()
    print(
        f"write: store {result['store_write_mb_s']:.0f} MB/s, raw SET {result['raw_write_mb_s']:.0f} MB/s, "
        f"ratio {result['redis_write_ratio']:.2f}\n"
        f"read:  store {result['store_read_mb_s']:.0f} MB/s, raw GET {result['raw_read_mb_s']:.0f} MB/s, "
        f"ratio {result['redis_read_ratio']:.2f}\n"
        f"one value per layer: raw pipelined GETs {result['raw_layer_read_mb_s']:.0f} MB/s, "
        f"{result['redis_layer_values_ratio']:.2f} of one value per chunk"
    )
    _print_save(result)
    return result


def _print_save(result: dict) -> None:
    print(
        f"decode step: saving off {result['step_ms_off']:.1f} ms, on {result['step_ms_on']:.1f} ms, "
        f"overhead {result['save_overhead'] * 100:+.1f}% (saver stalls: {result['saver_stalls']})\n"
        "absolute figures depend on this machine's disk and CPU; compare only the ratios, measured side by side"
    )


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
    chunks = _chunks(args)
    total = sum(len(data) for _, data in chunks)
    tier = StoreConfig(host_bytes=_pool_bytes(chunks), writers=args.threads).open_store(dirs, readers=args.threads)
    raw_files = [d / "raw-sequential.bin" for d in dirs]
    share = -(-total // len(dirs))
    with ThreadPoolExecutor(len(dirs)) as raw_pool:
        times = _alternate(
            tier,
            chunks,
            args,
            {
                "raw_write": lambda: list(raw_pool.map(lambda p: _raw_write(p, share), raw_files)),
                "raw_read": lambda: list(raw_pool.map(_raw_read, raw_files)),
            },
        )
    tier.close()
    return {
        "bytes": total,
        "directories": len(dirs),
        "direct_io": {"store": tier.stores[0].direct, "raw": [direct_io.supports_direct(d) for d in dirs]},
        **_throughputs(times, total),
        "write_ratio": _ratio(times, "raw_write", "store_write"),
        "read_ratio": _ratio(times, "raw_read", "store_read"),
    }


def _redis_benchmark(url: str, args: argparse.Namespace) -> dict:
    import redis

    chunks = _chunks(args)
    total = sum(len(data) for _, data in chunks)
    namespace = f"bench{os.getpid()}"
    config = StoreConfig(host_bytes=_pool_bytes(chunks), writers=args.threads, tiers=(f"{url}?namespace={namespace}",))
    tier = config.open_store(None, readers=args.threads)
    client = redis.Redis.from_url(url, max_connections=args.threads, socket_timeout=30)
    raw = {f"raw:{namespace}:{chunk.key}": data for chunk, data in chunks}
    layers = {  # the other layout: one value per (chunk, layer), read with one pipeline per chunk
        f"raw:{namespace}:{chunk.key}": [
            (f"raw:{namespace}:{chunk.key}:{n}", t.numpy().tobytes()) for n, t in chunk.tensors.items()
        ]
        for chunk, _ in chunks
    }

    def get_layers(name: str) -> list:
        pipe = client.pipeline(transaction=False)
        for layer_name, _ in layers[name]:
            pipe.get(layer_name)
        return pipe.execute()

    for name, values in layers.items():
        client.mset(dict(values))
    with ThreadPoolExecutor(args.threads) as pool:
        times = _alternate(
            tier,
            chunks,
            args,
            {
                "raw_write": lambda: list(pool.map(lambda kv: client.set(*kv), raw.items())),
                "raw_read": lambda: list(pool.map(client.get, raw)),
                "raw_layer_read": lambda: list(pool.map(get_layers, raw)),
            },
        )
    errors = tier.stores[0].stats()["errors"] + tier.write_errors
    tier.close()
    for name, values in layers.items():
        client.delete(name, *(n for n, _ in values))
    client.close()
    if errors:
        raise RuntimeError(f"{errors} Redis operation(s) failed during the benchmark: its figures would be wrong")
    return {
        "bytes": total,
        **_throughputs(times, total),
        "redis_write_ratio": _ratio(times, "raw_write", "store_write"),
        "redis_read_ratio": _ratio(times, "raw_read", "store_read"),
        "redis_layer_values_ratio": _ratio(times, "raw_read", "raw_layer_read"),
    }


def publish(tier: HostTier, chunk: Chunk) -> bool:
    """Save a chunk given as tensors into ``tier`` as the saver would (lay it out in a pool slot, fill its
    rows, publish it); False if the pool has no room. For benchmarks and tests: serving saves through the
    saver."""
    specs = [TensorSpec(layer, fmt, tuple(t.shape[1:]), t.dtype) for (layer, fmt), t in chunk.tensors.items()]
    image = tier.create(ChunkLayout.plan(specs, chunk.fingerprint), chunk.fingerprint)
    if image is None:
        return False
    for name, t in chunk.tensors.items():
        image.tensor(*name).copy_(t)
    tier.publish(image, chunk.key, chunk.tokens, parent=chunk.parent)
    return True


def _pool_bytes(chunks: list[tuple[Chunk, bytes]]) -> int:
    return sum(len(data) for _, data in chunks) + (len(chunks) + 1) * PAGE


def _alternate(tier, chunks: list[tuple[Chunk, bytes]], args: argparse.Namespace, raw: dict) -> dict[str, list[float]]:
    """The store's writes and reads alternate with the ``raw`` ones, ``--repeats`` times, so that a device
    shared with other work disturbs both sides alike; the seconds each took, by name."""

    def store_write() -> None:
        """As the saver publishes: into the host pool, written back by the tier's writers."""
        for chunk, _ in chunks:
            publish(tier, chunk)
        tier.flush()

    def store_read() -> None:
        """As a restore of chunks not in memory: one read per chunk into a pool slot, every checksum verified."""
        tier.drop_resident()
        for image in [f.result() for f in [tier.fetch(chunk.key) for chunk, _ in chunks]]:
            tier.release(image)

    work = {"store_write": store_write, "store_read": store_read, **raw}
    times: dict[str, list[float]] = {name: [] for name in work}
    for _ in tqdm(range(args.repeats), desc="I/O repeats (store and raw)", leave=False):
        for key in tier.keys():
            tier.discard(key)
        for name, fn in work.items():
            began = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - began)
    return times


def _throughputs(times: dict[str, list[float]], total: int) -> dict[str, float]:
    return {f"{name}_mb_s": total / 1e6 / statistics.median(t) for name, t in times.items()}


def _ratio(times: dict[str, list[float]], raw: str, store: str) -> float:
    """The store's throughput over the raw one: the median of per-repeat ratios."""
    return statistics.median(r / s for r, s in zip(times[raw], times[store]))


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
def _save_overhead(args: argparse.Namespace, tiers: tuple[str, ...] = ()) -> dict:
    from ..model.loader import load_model
    from ..serving.runtime import HCacheRuntime

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    loaded = load_model(args.model)
    g = torch.Generator().manual_seed(1)

    def batch() -> list[list[int]]:  # fresh prompts each round: repeated ones would be deduplicated, not saved
        return [
            torch.randint(0, loaded.spec.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)
        ]

    with tempfile.TemporaryDirectory(prefix="hcache-bench-saver-") as tmp:
        runtimes = {
            on: HCacheRuntime(
                loaded,
                None if on and tiers else Path(tmp) / str(on),
                save="plan" if on else "none",
                store=StoreConfig(shared=tiers if on else ()),
            )
            for on in (True, False)
        }
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
