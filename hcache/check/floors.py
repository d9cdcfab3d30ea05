"""The floors every restore stands on, measured here: host-to-device copy (pinned and pageable), the device's
own copy peak, and the store disk's O_DIRECT read. A restore is judged against these, not against a
datasheet. On a CPU the "device" is host memory, and only the memcpy and the disk are measured."""

from __future__ import annotations

import mmap
import os
import statistics
import time
from pathlib import Path

import torch

from ..storage.direct_io import read_file, write_file


def measure_floors(store_dir: Path, quick: bool) -> dict:
    """Bandwidths in GB/s, each the median of a few timed copies after a warm-up."""
    size = (64 if quick else 512) << 20
    out: dict = {"bytes": size}
    if torch.cuda.is_available():
        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        out["h2d_pinned_gbps"] = _gbps(
            size, device.copy_, torch.empty(size, dtype=torch.uint8, pin_memory=True), cuda=True
        )
        out["h2d_pageable_gbps"] = _gbps(size, device.copy_, torch.empty(size, dtype=torch.uint8), cuda=True)
        out["device_copy_gbps"] = _gbps(size, device.copy_, torch.empty_like(device), cuda=True)
    else:
        target = torch.empty(size, dtype=torch.uint8)
        out["host_copy_gbps"] = _gbps(size, target.copy_, torch.ones(size, dtype=torch.uint8), cuda=False)
    out["disk_read_gbps"], out["disk_o_direct"] = _disk_read(store_dir, size)
    return out


def _gbps(size: int, copy, source: torch.Tensor, cuda: bool, repeats: int = 5) -> float:
    seconds = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        copy(source, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return size / statistics.median(seconds[1:]) / 1e9


def _disk_read(directory: Path, size: int) -> tuple[float, bool]:
    """One file of ``size`` bytes written to ``directory`` and read back whole with O_DIRECT (so the page
    cache does not answer), as the store reads a chunk; falls back to a buffered read where O_DIRECT is
    refused, and says so."""
    path = directory / f".hcache-check-{os.getpid()}"
    buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    try:
        buffer.write(os.urandom(1 << 20) * (size >> 20))
        direct = write_file(path, memoryview(buffer), size, direct=True, sync=True)
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            read_file(path, memoryview(buffer), size, direct=direct)
            seconds.append(time.perf_counter() - start)
        return size / statistics.median(seconds) / 1e9, direct
    finally:
        path.unlink(missing_ok=True)
        buffer.close()
