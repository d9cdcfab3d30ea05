"""What this machine has: the GPU and its driver, CUDA, torch, DeepSpeed and FastGen's ops, Triton, and the
disk under the store. Like ``ds_report`` and vLLM's ``collect_env``: facts to read before any number."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import torch

from ..machine.facts import machine_facts
from ..storage.direct_io import supports_direct


def describe_environment(store_dir: Path) -> dict:
    facts = machine_facts()
    return {
        "cpu": facts["cpu"],
        "cpu_count": facts["cpu_count"],
        "gpu": facts["gpu"],
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "deepspeed_mii": _version("deepspeed-mii"),
        "fastgen_ops": _fastgen_ops(),
        "triton": _version("triton"),
        "store": _disk(store_dir),
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fastgen_ops() -> dict[str, bool] | str:
    """Per FastGen op, whether DeepSpeed has it prebuilt or compiled already (else the first request builds
    it, for minutes: ``hcache prepare --fastgen``)."""
    if not torch.cuda.is_available():
        return "not usable: FastGen's ops need a CUDA GPU"
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops import op_builder
        from torch.utils.cpp_extension import _get_build_directory

        from ..engine.fastgen import FASTGEN_OP_BUILDERS
    except ImportError as exc:
        return f"unavailable: {exc}"
    ops = {}
    for name in FASTGEN_OP_BUILDERS:
        builder = getattr(op_builder, name)()
        built = Path(_get_build_directory(builder.name, verbose=False)) / f"{builder.name}.so"
        ops[builder.name] = bool(installed_ops.get(builder.name, False)) or built.is_file()
    return ops


def _disk(directory: Path) -> dict:
    """The filesystem under ``directory``: its device and type (from /proc/mounts), size and free space."""
    directory.mkdir(parents=True, exist_ok=True)
    real = directory.resolve()
    device, fstype, mount = "?", "?", "/"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, point, kind = line.split()[:3]
            if (real == Path(point) or Path(point) in real.parents) and len(point) >= len(mount):
                device, fstype, mount = dev, kind, point
    except OSError:
        pass
    stat = os.statvfs(real)
    return {
        "path": str(real),
        "device": device,
        "filesystem": fstype,
        "mount": mount,
        "size_bytes": stat.f_frsize * stat.f_blocks,
        "free_bytes": stat.f_frsize * stat.f_bavail,
        "o_direct": supports_direct(real),
    }
