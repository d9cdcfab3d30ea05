"""Facts about this machine, recorded next to every profile and benchmark result, and the source they ran.

GPU facts come from NVML (nvidia-ml-py) when a GPU is present; on a CPU-only machine the GPU fields are
None rather than guessed. :func:`source_commit` names the hcache source that produced a result.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
from pathlib import Path

from ..version import __version__

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # a checkout's root, where hcache is a git checkout


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> dict | None:
    import torch  # here, not at the top: the command line imports this module to build its parser

    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            name = pynvml.nvmlDeviceGetName(handle)
            return {
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                "driver": pynvml.nvmlSystemGetDriverVersion(),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or unusable: fall back to what torch knows
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return {"name": props.name, "memory_bytes": int(props.total_memory), "driver": None}


def machine_facts() -> dict:
    import torch

    gpu = _gpu()
    return {
        "hostname": socket.gethostname(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),  # when taken: OMP_NUM_THREADS, torch.set_num_threads, --torch-threads
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_name() -> str:
    """A file-name-safe name for this kind of machine: the GPU model, or the CPU model and core count."""
    gpu = _gpu()
    name = gpu["name"].replace("NVIDIA ", "") if gpu else f"cpu{os.cpu_count()}-{_cpu_name()}"
    slug = "".join(c if c.isalnum() else "-" for c in name.replace("(R)", "").replace("(TM)", "")).lower()
    return "-".join(part for part in slug.split("-") if part and part not in ("cpu", "processor"))[:60]


def source_commit(root: str | Path | None = None) -> str:
    """The hcache source a result was measured with: the short git commit of the checkout hcache runs from,
    with ``+dirty`` when tracked files have uncommitted changes (untracked files are not counted, as for
    ``git describe --dirty``); where hcache is not a git checkout of its own (a wheel in site-packages, even
    inside another project's repository, or no git), the package version, e.g. ``"0.1.0"``."""
    root = Path(root if root is not None else SOURCE_ROOT).resolve()

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=True)
        return done.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:  # hcache lies inside another repository
            return __version__
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # not a repository, no commit yet, no git, git hung
        return __version__
    return commit + ("+dirty" if dirty else "")
