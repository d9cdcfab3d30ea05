"""hcache as a DeepSpeed-MII backend: MII's own pipeline, server, batching loop and sampling, over hcache's
serving engine.

MII builds its engine in one place, ``mii.api.load_model``; the backend points that at
:func:`build_engine`, and MII's Dynamic SplitFuse loop then drives a
:class:`~hcache.serving.engine.ServingEngine` exactly as it drives ``InferenceEngineV2``. ``mii.serve`` runs
the engine in server processes that MII launches with ``python -m mii.launch.multi_gpu_server``; the
backend launches them with :mod:`hcache.mii.launch` instead, which installs the same hook there.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from ..config import HCacheConfig, ResolvedConfig, engine_and_device, resolve
from ..engine import ReferenceEngine
from ..errors import InvalidRequestError, ModelNotFoundError, StorageError
from ..model.fingerprint import checkpoint_fingerprint, model_fingerprint
from ..model.loader import check_device, load_model, model_dtype
from ..model.spec import ModelSpec
from ..model.tensor_parallel import SINGLE, TPGroup, local_spec, shard_model
from ..serving.engine import ServingEngine
from ..serving.metrics import serve_metrics
from . import detokenize, failures
from .requests import CACHE_SALT, check_generate_options, check_rest_body

CONFIG_ENV = "HCACHE_MII_CONFIG"  # how server processes get the hcache config: not on their command lines
LOG_LEVEL_ENV = "HCACHE_LOG_LEVEL"  # the level server processes log at: hcache's where they were started

IDLE_WAIT_S = 0.1  # an idle model server waits this long on its request queue at a time (see _wait_when_idle)
TESTED_MII = ((0, 3), (0, 4))  # [lowest, highest) MII minor versions whose loop this was checked against


def build_engine(model_config, hcache: ResolvedConfig) -> ServingEngine:
    """The engine MII serves ``model_config`` with (``model_config`` is MII's ``ModelConfig``), by the config
    :func:`resolve_deployment` resolved. With ``tensor_parallel`` above 1, this process is one rank of the
    deployment (MII starts one per rank)."""
    path, settings = model_config.model_name_or_path, hcache.settings
    tp = _tensor_parallel_group(model_config.tensor_parallel)
    if hcache.engine == "fastgen":
        from ..engine.fastgen import build_fastgen_engine

        engine = build_fastgen_engine(path, model_config.inference_engine_config)
        fingerprint, config = checkpoint_fingerprint(path, engine.spec), engine.config
    else:
        device = hcache.device  # "cuda" is this rank's GPU: the process group set it
        loaded = load_model(path, model_dtype(settings.dtype, device), device)
        fingerprint = model_fingerprint(loaded.model, loaded.spec)  # of the whole model, on every rank
        shard, spec = shard_model(loaded.model, loaded.spec, tp)
        engine = ReferenceEngine(shard, spec, num_blocks=settings.num_blocks)
        config = model_config.inference_engine_config
    if model_config.max_length is None:  # else MII reads it from FastGen's checkpoint engine
        model_config.max_length = context_length(hcache)
    serving = ServingEngine(engine, fingerprint, hcache, tp=tp, engine_config=config)
    if settings.metrics_port is not None:
        port = settings.metrics_port + tp.rank
        try:
            serve_metrics(serving.metrics, port, settings.metrics_host)
        except OSError as e:  # another replica on this host has the port: serve without the endpoint
            warnings.warn(f"hcache metrics not served on {settings.metrics_host}:{port}: {e}", stacklevel=2)
    return serving


def resolve_deployment(settings: HCacheConfig, path: str, tensor_parallel: int = 1) -> ResolvedConfig:
    """Resolve the settings once, where MII is started and before any model server loads, for the model's
    shape read from its config (with tensor parallelism, a rank's shard): a bad setting, plan or profile is
    refused here, and ``plan="auto"`` alone gets this machine's profile (measured now, from the model, if
    none is found and ``measure_profile``) or, after one warning, the default plan. The model servers get
    the result and resolve nothing."""
    spec = _model_spec(path, settings)
    if tensor_parallel > 1:
        spec = local_spec(spec, TPGroup(0, tensor_parallel))
    _, device = engine_and_device(settings)
    return resolve(
        settings, spec, path, tensor_parallel=tensor_parallel, measure=lambda: load_model(path, getattr(torch, spec.dtype), device)
    )


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


def check_deployment(hcache: ResolvedConfig) -> None:
    """Refuse, before any server process starts, a store or request log the model servers could not use:
    each rank's store directories are checked as its engine will open them (lock free, layout current)."""
    settings = hcache.settings
    if hcache.stored:
        for rank in range(hcache.tensor_parallel):
            settings.store.check_dirs(hcache.store_dirs(rank))
    if settings.request_log is not None and not os.access(Path(settings.request_log).parent, os.W_OK):
        raise StorageError(f"cannot write the request log {settings.request_log}: its directory is missing or read-only")


def _model_spec(path: str, settings: HCacheConfig) -> ModelSpec:
    """The model's shape from its config alone (no weights), in the dtype its engine will run it in:
    ``dtype`` if set; FastGen runs a checkpoint in its own half-precision dtype; the reference engine in
    float16 on a GPU and float32 on the CPU."""
    from transformers import AutoConfig

    engine, device = engine_and_device(settings)
    check_device(device)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read the model config in {path!r}: {exc}") from exc
    dtype = model_dtype(settings.dtype, device)
    if settings.dtype is None and engine == "fastgen":  # FastGen runs the config's dtype
        checkpoint = getattr(config, "dtype", None)
        dtype = checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.float16
    return ModelSpec.from_config(config, dtype)


def context_length(hcache: ResolvedConfig) -> int:
    """The longest sequence a deployment serves: the model's positions; on the reference engine, no more
    than its KV cache holds (a longer sequence would wait in MII's scheduler forever)."""
    spec = hcache.spec
    if hcache.engine == "fastgen":
        return spec.max_positions
    return min(spec.max_positions, hcache.settings.num_blocks * ReferenceEngine.BLOCK_SIZE)


def check_mii_version() -> None:
    import mii

    version = tuple(int(p) for p in mii.__version__.strip().split(".")[:2])
    if not TESTED_MII[0] <= version < TESTED_MII[1]:
        lo, hi = (".".join(map(str, v)) for v in TESTED_MII)
        raise InvalidRequestError(f"the hcache MII backend is tested with deepspeed-mii >={lo},<{hi}; found {mii.__version__}")


def install(hcache: ResolvedConfig) -> Callable[[], None]:
    """Make this process's MII build hcache's engine; returns the undo."""
    import mii.api

    check_mii_version()
    saved_load = mii.api.load_model
    mii.api.load_model = lambda model_config: build_engine(model_config, hcache)
    undos = [
        _run_mii_loop_on_cpu() if not torch.cuda.is_available() else lambda: None,
        _check_requests(),
        detokenize.install(),
        failures.install(),  # after the checks: it wraps them
        _bind_internal_ports_to_loopback(),
    ]

    def undo() -> None:
        mii.api.load_model = saved_load
        for undo_one in reversed(undos):
            undo_one()

    return undo


def _check_requests() -> Callable[[], None]:
    """Check each request as MII makes it, before it enters the batching loop (a bad one raises in its
    caller, and the loop never sees it), and open each new sequence in its request's namespace
    (``cache_salt``), which rides on MII's request object and, to the other tensor-parallel ranks, on
    MII's broadcast of the batch. Before each put, requests still waiting in MII's buffer start reading
    their stored chunks into the host pool (look-ahead prefetch), once each. Returns the undo."""
    from mii.batching.data_classes import Request, RequestMsg
    from mii.batching.ragged_batching import RaggedBatchBase

    make, put = RaggedBatchBase.make_request, RaggedBatchBase.put

    def make_request(self, tid, uid, input_tokens, kwargs):
        options, namespace = check_generate_options(kwargs, len(input_tokens), self.max_length)
        request = make(self, tid, uid, input_tokens, options)
        request.hcache_namespace = namespace
        return request

    def put_in_namespaces(self, uids, tokenized_input):
        engine = self.inference_engine
        for r in self.buffer:
            if not r.is_flush_request and r.seq_length == 0 and not getattr(r, "hcache_prefetched", False):
                engine.prefetch(r.prompt_tokens.tolist(), getattr(r, "hcache_namespace", None))
                r.hcache_prefetched = True
        for r in self.scheduled_requests.requests_to_run:
            # not open: its first put, or its first again after MII preempted or hcache retried it
            if getattr(r, "hcache_namespace", None) is not None and r.uid in uids and not engine.is_open(r.uid):
                engine.open(r.uid, namespace=r.hcache_namespace)
        return put(self, uids, tokenized_input)

    RaggedBatchBase.make_request, RaggedBatchBase.put = make_request, put_in_namespaces
    if not getattr(Request, "hcache_broadcasts_namespace", False):  # for good: MII ignores the extra key
        to_msg, from_msg = Request.to_msg_dict, RequestMsg.from_msg_dict

        def to_msg_dict(self):
            return {**to_msg(self), CACHE_SALT: getattr(self, "hcache_namespace", None)}

        def msg_from_dict(msg):
            request = from_msg(msg)
            request.hcache_namespace = msg.get(CACHE_SALT)
            return request

        Request.to_msg_dict, RequestMsg.from_msg_dict = to_msg_dict, staticmethod(msg_from_dict)
        Request.hcache_broadcasts_namespace = True

    def undo() -> None:
        RaggedBatchBase.make_request, RaggedBatchBase.put = make, put

    return undo


def keeping_the_loop_installed(pipeline) -> None:
    """Keep hcache's request checks and failure handling on ``pipeline`` (built while :func:`install` was in effect)
    after the install is undone: its class becomes a subclass that holds them."""
    cls = type(pipeline)
    methods = {name: getattr(cls, name) for name in (*failures.LOOP_METHODS, "make_request", "put")}
    pipeline.__class__ = type(cls.__name__, (cls,), methods)


def install_server(hcache: ResolvedConfig, model_config, rest_gateway: bool) -> None:
    """For the life of one of MII's server processes: :func:`install`, and, in the REST gateway, every
    request checked at the door and every error answered with its HTTP status and message."""
    install(hcache)
    _store_everything_at_shutdown()
    _wait_when_idle()
    if rest_gateway:
        _check_rest_requests(model_config)


def _wait_when_idle() -> None:
    """MII's serving loop polls its request queue without blocking, so an idle model server keeps a CPU core
    busy (several nodes on one machine starve each other). With nothing to run, rank 0 now blocks on the
    queue instead: a request wakes it at once, and a stop is still seen within ``IDLE_WAIT_S``. Everything
    running goes back through that queue after each step, so an empty buffer and queue mean idle."""
    from mii.batching.ragged_batching import MIIAsyncPipeline

    schedule = MIIAsyncPipeline.schedule_requests

    def schedule_requests(self) -> None:
        if self.is_rank_0 and not self.buffer:
            try:
                self.buffer.append(self.request_queue.get(timeout=IDLE_WAIT_S))
            except queue.Empty:
                pass
        schedule(self)

    MIIAsyncPipeline.schedule_requests = schedule_requests


def _store_everything_at_shutdown() -> None:
    """A model server told to stop (MII's terminate) closes its serving engine once its batching loop has
    ended: the saver drains and every chunk saved is written to the stores below, Redis included, before the
    process exits. Otherwise chunks still queued for write-back are left to the interpreter's exit."""
    from mii.batching.ragged_batching import MIIAsyncPipeline

    shutdown = MIIAsyncPipeline.shutdown

    def shutdown_and_store(self) -> None:
        shutdown(self)
        self.inference_engine.close()

    MIIAsyncPipeline.shutdown = shutdown_and_store


def _bind_internal_ports_to_loopback() -> Callable[[], None]:
    """MII's internal gRPC servers and rank 0's ZMQ broadcast listen on loopback only (MII binds them to
    every interface); returns the undo."""
    import grpc
    import zmq

    make_server, zmq_bind = grpc.server, zmq.Socket.bind

    def server(*args, **kwargs):
        s = make_server(*args, **kwargs)
        add_port = s.add_insecure_port
        s.add_insecure_port = lambda address: add_port(address.replace("[::]:", "localhost:", 1))
        return s

    grpc.server = server
    zmq.Socket.bind = lambda self, address: zmq_bind(self, address.replace("tcp://*:", "tcp://127.0.0.1:", 1))

    def undo() -> None:
        grpc.server, zmq.Socket.bind = make_server, zmq_bind

    return undo


def _check_rest_requests(model_config) -> None:
    """MII's REST gateway, with a bad request refused with HTTP 400 and the reason, before it reaches the
    deployment, and a request the deployment fails answered with :func:`failures.http_status` and the
    deployment's message (MII's gateway answers every error with a bare HTTP 500)."""
    import grpc
    import mii.grpc_related.restful_gateway as gateway
    from flask import jsonify, request
    from mii.constants import RESTFUL_API_PATH
    from transformers import AutoConfig, AutoTokenizer

    path = model_config.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer or path)
    max_length = model_config.max_length or ModelSpec.from_config(AutoConfig.from_pretrained(path), torch.float32).max_positions
    create_app = gateway.createRestfulGatewayApp

    def create_checked_app(deployment_name, server_thread):
        app = create_app(deployment_name, server_thread)
        route = f"/{RESTFUL_API_PATH}/{deployment_name}"

        @app.before_request
        def refuse_bad_request():
            if request.method == "POST" and request.path == route:
                try:
                    check_rest_body(request.get_json(silent=True), tokenizer.encode, max_length)
                except InvalidRequestError as exc:
                    return jsonify({"error": str(exc)}), 400
            return None

        [endpoint] = [rule.endpoint for rule in app.url_map.iter_rules() if rule.rule == route]
        generate = app.view_functions[endpoint]

        def generate_or_answer_the_error(*args, **kwargs):
            try:
                return generate(*args, **kwargs)
            except grpc.RpcError as exc:
                return jsonify({"error": exc.details()}), failures.http_status(exc.code())

        app.view_functions[endpoint] = generate_or_answer_the_error
        return app

    gateway.createRestfulGatewayApp = create_checked_app


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
def installed(hcache: ResolvedConfig) -> Iterator[None]:
    undo = install(hcache)
    try:
        yield
    finally:
        undo()


@contextmanager
def server_processes_launched_by_hcache(hcache: ResolvedConfig, launched: list[subprocess.Popen]) -> Iterator[None]:
    """While ``mii.serve`` starts its processes, start them through :mod:`hcache.mii.launch` with the
    hcache config, in MII's own command line otherwise, and collect them in ``launched``.

    The processes log as hcache's logger here does (``hcache -v``: INFO): below INFO, DeepSpeed's launcher
    is quiet (``--log_level error``: no training-launcher lines), and so are MII's and the REST gateway's
    INFO messages (:mod:`hcache.mii.launch`). MII writes two hostfiles to the temporary directory as it
    starts, reads them then, and leaves them behind: they are removed once it has started (or failed to)."""
    import contextlib
    import logging

    from mii.backend.server import MIIServer, config_to_b64_str

    level = logging.getLogger("hcache").getEffectiveLevel()
    hostfiles: list[str] = []

    def init(self, mii_config):
        given = mii_config.hostfile  # when it is missing, MII writes one to the temporary directory
        try:
            saved_init(self, mii_config)
        finally:
            if mii_config.hostfile != given:
                hostfiles.append(mii_config.hostfile)

    def ds_launch_str(self, replica_config, hostfile, use_multiple_hosts):
        hostfiles.append(hostfile)  # one per replica, written for DeepSpeed's launcher, which is not given it
        return saved_ds_launch_str(self, replica_config, hostfile, use_multiple_hosts)

    def launch(self, model_config, msg_server_type, ds_launch_str="", server_args=None):
        launcher = ds_launch_str.split()
        if launcher[:1] == ["deepspeed"]:  # DeepSpeed's launcher from this Python, not the first on PATH
            launcher[:1] = [sys.executable, "-m", "deepspeed.launcher.runner"]
            if level > logging.INFO:
                launcher[3:3] = ["--log_level", "error"]
        cmd = [
            *launcher,
            sys.executable, "-m", "hcache.mii.launch",
            "--model-config", config_to_b64_str(model_config),
            *" ".join(server_args or []).split(),
        ]  # fmt: skip
        # The hcache config (store paths, namespace) goes in the environment, which only this user can read,
        # not on the command line, which every local user can. A session of its own: Ctrl-C reaches only
        # the serving process, which stops the deployment in order (``terminate_server``) rather than each
        # process dying where it stands, and ``stop`` can end the launcher with the server it started.
        env = dict(os.environ, **{CONFIG_ENV: hcache.model_dump_json(), LOG_LEVEL_ENV: logging.getLevelName(level)})
        launched.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        launched[-1].hcache_saves = msg_server_type == "MII server"  # the others hold no state
        return launched[-1]

    def wait_until_live(self, processes, replicas):
        # MII's own wait sleeps 5 s a round, even once the servers are up: a node would start seconds late.
        for process, replica in zip(processes, replicas):
            while not all(self._is_socket_open(replica.hostname, port) for port in replica.tensor_parallel_ports):
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"the model server exited with status {process.returncode} while starting")
                time.sleep(0.2)

    saved_init, saved_ds_launch_str = MIIServer.__init__, MIIServer._generate_ds_launch_str
    saved = MIIServer._launch_server_process, MIIServer._wait_until_server_is_live
    MIIServer._launch_server_process, MIIServer._wait_until_server_is_live = launch, wait_until_live
    MIIServer.__init__, MIIServer._generate_ds_launch_str = init, ds_launch_str
    try:
        yield
    finally:
        MIIServer._launch_server_process, MIIServer._wait_until_server_is_live = saved
        MIIServer.__init__, MIIServer._generate_ds_launch_str = saved_init, saved_ds_launch_str
        for path in hostfiles:
            with contextlib.suppress(OSError):
                os.remove(path)


def openai_server(model_dir: str, balancer_port: int, port: int, host: str = "localhost", *, max_model_len: int | None = None,
                  names: list[str] | None = None, starting: bool = False, verbose: bool = False) -> subprocess.Popen:
    """hcache's OpenAI-compatible server (:mod:`hcache.openai`) on ``host``, in front of a deployment's load
    balancer. ``starting``: the deployment is still starting; ``/health`` answers 503 until the server gets
    ``READY_SIGNAL``."""
    command = [sys.executable, "-m", "hcache.openai", "--model", model_dir, "--load-balancer", f"localhost:{balancer_port}",
               "--host", host, "--port", str(port)]  # fmt: skip
    for name in names or []:
        command += ["--served-model-name", name]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    command += ["--starting"] * starting + ["--verbose"] * verbose
    return subprocess.Popen(command, start_new_session=True)  # Ctrl-C reaches the serving process, which drains this one first


def stop(processes: list[subprocess.Popen], grace_s: float = 15) -> None:
    """End a deployment's processes after ``terminate_server``, each with all it started (each leads a
    session, see ``launch``). The load balancer and the REST gateway hold no state and end at once (MII
    0.3's gateway, with ``restful_processes > 1``, handles ``/terminate`` in a forked child and so never
    stops). A model server writes its saved chunks as it stops: it gets up to ``grace_s`` for that, then
    its session (DeepSpeed's launcher, which notices its child's exit only once a second) ends. SIGTERM
    first, SIGKILL 5 s later."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        if not getattr(process, "hcache_saves", True):
            _signal_session(process, signal.SIGTERM)
    while any(_model_server_running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            _signal_session(process, sig)
        deadline = time.monotonic() + 5.0
        while any(_live_session(p) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.1)


def _model_server_running(process: subprocess.Popen) -> bool:
    """Whether ``process``'s model server (hcache's launch module, under DeepSpeed's launcher) still runs."""
    if not getattr(process, "hcache_saves", True):
        return False
    for p in _live_session(process):
        try:
            if p.cmdline()[1:3] == ["-m", "hcache.mii.launch"]:  # the server, not the launchers naming it
                return True
        except psutil.Error:
            pass
    return False


def _live_session(process: subprocess.Popen) -> list[psutil.Process]:
    """The processes of ``process``'s session still running: zombies, which a container's init may reap
    late, do not count."""
    process.poll()  # reap the leader once it exits
    live = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == process.pid:
                live.append(p)
        except OSError:
            pass
    return live


def _signal_session(process: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to every process of ``process``'s session."""
    process.poll()
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
