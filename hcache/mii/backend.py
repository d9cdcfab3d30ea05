"""hcache as a DeepSpeed-MII backend: MII's own pipeline, server, batching loop and sampling, over hcache's
serving engine.

MII builds its engine in one place, ``mii.api.load_model``; the backend points that at
:func:`build_engine`, and MII's Dynamic SplitFuse loop then drives a
:class:`~hcache.serving_engine.ServingEngine` exactly as it drives ``InferenceEngineV2``. ``mii.serve`` runs
the engine in server processes that MII launches with ``python -m mii.launch.multi_gpu_server``; the
backend launches them with :mod:`hcache.mii.launch` instead, which installs the same hook there.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ..auto_profile import auto_profile
from ..engine import ReferenceEngine
from ..errors import InvalidRequestError
from ..fingerprint import checkpoint_fingerprint, model_fingerprint
from ..model_loader import load_model, model_dtype
from ..model_spec import ModelSpec
from ..profile import Profile, profile_command
from ..serving_engine import ServingEngine, is_auto
from ..tensor_parallel import SINGLE, TPGroup, shard_model
from .config import HCacheConfig

TESTED_MII = ((0, 3), (0, 4))  # [lowest, highest) MII minor versions whose loop this was checked against


def build_engine(model_config, hcache: HCacheConfig) -> ServingEngine:
    """The engine MII serves ``model_config`` with (``model_config`` is MII's ``ModelConfig``). With
    ``tensor_parallel`` above 1, this process is one rank of the deployment (MII starts one per rank)."""
    path = model_config.model_name_or_path
    tp = _tensor_parallel_group(model_config.tensor_parallel)
    if engine_kind(hcache) == "fastgen":
        from ..engine.fastgen import build_fastgen_engine

        engine = build_fastgen_engine(path, model_config.inference_engine_config)
        fingerprint, config = checkpoint_fingerprint(path, engine.spec), engine.config
    else:
        device = hcache.device or (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        loaded = load_model(path, model_dtype(hcache.dtype, device), device)
        fingerprint = model_fingerprint(loaded.model, loaded.spec)  # of the whole model, on every rank
        shard, spec = shard_model(loaded.model, loaded.spec, tp)
        engine = ReferenceEngine(shard, spec, num_blocks=hcache.num_blocks)
        config = model_config.inference_engine_config
    if model_config.max_length is None:  # else MII reads it from FastGen's checkpoint engine
        model_config.max_length = engine.spec.max_positions
    return ServingEngine(
        engine,
        fingerprint,
        _rank_dirs(hcache.store_dirs, tp) if hcache.enabled else None,
        model_name=path,
        plan=hcache.plan,
        save=hcache.save,
        namespace=hcache.namespace,
        store=hcache.store,
        profile=hcache.profile,
        readers=hcache.readers,
        request_log=hcache.request_log,
        config=config,
        tp=tp,
    )


def resolve_profile(hcache: HCacheConfig, path: str, tensor_parallel: int = 1) -> HCacheConfig:
    """Settle the profile once, where MII is started and before any replica loads: a given profile that does
    not fit is refused here, and ``plan="auto"`` alone gets this machine's profile (measured now if none is
    found and ``measure_profile``) or, after one warning, the default plan. The config returned leaves the
    replicas nothing to look up. With tensor parallelism each rank checks its own shard's profile instead."""
    if not hcache.enabled or tensor_parallel > 1 or (hcache.profile is None and not is_auto(hcache.plan)):
        return hcache
    from transformers import AutoConfig

    device = hcache.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = model_dtype(hcache.dtype, device)
    spec = ModelSpec.from_config(AutoConfig.from_pretrained(path), dtype)
    if hcache.profile is not None:
        Profile.load(hcache.profile, spec, command=profile_command(path, spec))
        return hcache
    measure = (lambda: load_model(path, dtype, device)) if hcache.measure_profile else None
    found = auto_profile(spec, path, measure=measure)
    return hcache.model_copy(update={"profile": str(found.resolve()) if found else None, "plan": "auto" if found else None})


def _rank_dirs(dirs: list[str], tp: TPGroup) -> list[str]:
    """Each rank of a deployment stores in directories of its own: a store's index and quota assume one
    writer process per directory."""
    if tp.world_size == 1:
        return dirs
    return [str(Path(d) / f"tp{tp.world_size}-rank{tp.rank}") for d in dirs]


def _tensor_parallel_group(degree: int) -> TPGroup:
    """This rank's group, joining the process group the launcher describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) unless it is already joined: NCCL on GPUs, gloo on a CPU."""
    if degree == 1:
        return SINGLE
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    tp = TPGroup.current()
    if tp.world_size != degree:
        raise InvalidRequestError(f"tensor_parallel={degree}, but the process group has {tp.world_size} ranks")
    return tp


def engine_kind(hcache: HCacheConfig) -> str:
    if hcache.engine == "auto":
        return "fastgen" if torch.cuda.is_available() else "reference"
    return hcache.engine


def check_mii_version() -> None:
    import mii

    version = tuple(int(p) for p in mii.__version__.strip().split(".")[:2])
    if not TESTED_MII[0] <= version < TESTED_MII[1]:
        lo, hi = (".".join(map(str, v)) for v in TESTED_MII)
        raise InvalidRequestError(f"the hcache MII backend is tested with deepspeed-mii >={lo},<{hi}; found {mii.__version__}")


def install(hcache: HCacheConfig) -> Callable[[], None]:
    """Make this process's MII build hcache's engine; returns the undo."""
    import mii.api

    check_mii_version()
    saved_load = mii.api.load_model
    mii.api.load_model = lambda model_config: build_engine(model_config, hcache)
    undo_cpu = _run_mii_loop_on_cpu() if not torch.cuda.is_available() else lambda: None

    def undo() -> None:
        mii.api.load_model = saved_load
        undo_cpu()

    return undo


def _run_mii_loop_on_cpu() -> Callable[[], None]:
    """Two things stop MII 0.3's loop on a CPU, neither about the model: it calls ``torch.cuda.synchronize()``
    unconditionally when a pipeline starts, which a CPU-only torch refuses (without CUDA it becomes the
    no-op it would be); and it finds rank 0 by ``current_device() == 0``, while DeepSpeed's CPU accelerator
    returns ``LOCAL_RANK`` as a string, so a launched server thinks it is not rank 0 and answers nothing."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    saved_sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    accelerator.current_device = lambda: int(os.environ.get("LOCAL_RANK", 0))

    def undo() -> None:
        torch.cuda.synchronize = saved_sync
        del accelerator.current_device

    return undo


@contextmanager
def installed(hcache: HCacheConfig) -> Iterator[None]:
    undo = install(hcache)
    try:
        yield
    finally:
        undo()


@contextmanager
def server_processes_launched_by_hcache(hcache: HCacheConfig, launched: list[subprocess.Popen]) -> Iterator[None]:
    """While ``mii.serve`` starts its processes, start them through :mod:`hcache.mii.launch` with the
    hcache config, in MII's own command line otherwise, and collect them in ``launched``."""
    from mii.backend.server import MIIServer, config_to_b64_str

    def launch(self, model_config, msg_server_type, ds_launch_str="", server_args=None):
        cmd = [
            *ds_launch_str.split(),
            sys.executable, "-m", "hcache.mii.launch",
            "--hcache-config", hcache.to_b64(),
            "--model-config", config_to_b64_str(model_config),
            *" ".join(server_args or []).split(),
        ]  # fmt: skip
        # A session of its own: Ctrl-C reaches only the serving process, which stops the deployment in
        # order (``terminate_server``) rather than each process dying where it stands.
        launched.append(subprocess.Popen(cmd, start_new_session=True))
        return launched[-1]

    saved = MIIServer._launch_server_process
    MIIServer._launch_server_process = launch
    try:
        yield
    finally:
        MIIServer._launch_server_process = saved


def openai_server(model_dir: str, balancer_port: int, port: int) -> subprocess.Popen:
    """MII's OpenAI-compatible server, in front of a running deployment's load balancer."""
    return subprocess.Popen(
        [sys.executable, "-m", "mii.entrypoints.openai_api_server", "--model", model_dir,
         "--load-balancer", f"localhost:{balancer_port}", "--port", str(port)]
    )  # fmt: skip


def stop(processes: list[subprocess.Popen], grace_s: float = 15) -> None:
    """Wait for a deployment's processes to exit after ``terminate_server``, and terminate those that do not:
    MII 0.3's REST gateway with ``restful_processes > 1`` handles ``/terminate`` in a forked child, so the
    gateway itself never stops."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
