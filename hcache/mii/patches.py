"""Every attribute hcache sets on MII, DeepSpeed, grpc, zmq and ``torch.cuda``, in one list; each group
installed together and undone together, in reverse order, leaving nothing behind.

hcache serves through MII's own pipeline, servers, batching loop and sampling by replacing a few of their
attributes. Each replacement is made, from the original it wraps, by a function in the module whose job it
is (:mod:`.engine_factory`, :mod:`.requests`, :mod:`.detokenize`, :mod:`.failures`, :mod:`.gateway`,
:mod:`.loop`, :mod:`.processes`, :mod:`.stopping`); the groups below say which attribute each replaces. They rely on MII's
internals: :func:`check_mii_version` refuses a version they were not checked against.

When each group is in effect:

- while ``hcache.mii.pipeline`` builds a pipeline (:func:`install`), undone once it is built. The pipeline
  keeps the replacements of its own loop's methods in a subclass of its class
  (:func:`hold_loop_patches`), and holds ``REQUEST_CLASSES`` until it is destroyed;
- in one of MII's server processes, while MII's server runs (:func:`install_server`; :mod:`.launch`
  undoes it when the server returns);
- in the process calling ``hcache.mii.serve``, while MII starts its processes
  (:func:`launching_with_hcache`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from ..config import ResolvedConfig
from ..errors import InvalidRequestError
from . import detokenize, engine_factory, failures, gateway, loop, processes, requests, stopping

TESTED_MII = ((0, 3), (0, 4))  # [lowest, highest) MII minor versions whose internals this was checked against
ABSENT = object()  # what an owner held of a name it did not hold itself


@dataclass(frozen=True)
class Patch:
    """``owner.name`` replaced by ``make(original, *context)`` (``original``: ABSENT where there is none).
    ``owner``: ``"module"``, ``"module:Class"`` or ``"module:function()"``, the object that function returns."""

    owner: str
    name: str
    make: Callable[..., Any]

    def target(self) -> Any:
        module, _, path = self.owner.partition(":")
        target = importlib.import_module(module)
        for part in filter(None, path.split(".")):
            target = getattr(target, part.removesuffix("()"))
            if part.endswith("()"):
                target = target()
        return target

    def __str__(self) -> str:
        return f"{self.owner}.{self.name}"


_RAGGED, _SERVER = "mii.batching.ragged_batching", "mii.grpc_related.modelresponse_server"
_LOOP, _PIPELINE, _ASYNC = f"{_RAGGED}:RaggedBatchBase", f"{_RAGGED}:MIIPipeline", f"{_RAGGED}:MIIAsyncPipeline"

# ---- every patch, by group --------------------------------------------------------------------------------
ENGINE = (Patch("mii.api", "load_model", engine_factory.building_hcache_engines),)  # context: the ResolvedConfig
ON_CPU = (  # where torch has no CUDA
    Patch("torch.cuda", "synchronize", loop.no_synchronize),
    Patch("deepspeed.accelerator:get_accelerator()", "current_device", loop.local_rank_as_int),
)
CHECKS = (
    Patch(_LOOP, "make_request", requests.checking_requests),
    Patch(_LOOP, "put", requests.opening_in_namespaces),
    Patch(_LOOP, "_process_logits", stopping.as_asked),
    Patch(_LOOP, "_generate_output", stopping.leaving_out_stop_tokens),
)
DETOKENIZING = (
    Patch("mii.modeling.tokenizers:HFTokenizer", "decode", detokenize.without_special_tokens),
    Patch(_RAGGED, "ReadableStream", detokenize.incremental),
)
FAILURES = (  # installed after CHECKS: its make_request and put wrap theirs
    Patch(_LOOP, "make_request", failures.joining_its_call),
    Patch(_LOOP, "generate", failures.failing_the_batch),
    Patch(_LOOP, "put", failures.retrying_alone),
    Patch(_LOOP, "flush", failures.flushing_each),
    Patch(_LOOP, "schedule_requests", failures.dropping_failed_calls),
    Patch(_PIPELINE, "__call__", failures.serving_one_call),
    Patch(f"{_SERVER}:ModelResponse", "GeneratorReply", failures.aborting_with_status),
    Patch(f"{_SERVER}:ModelResponse", "GeneratorReplyStream", failures.ending_cleanly),
    Patch(f"{_SERVER}:LoadBalancingInterceptor", "intercept_service", failures.passing_status),
    Patch(f"{_SERVER}:ParallelStubInvoker", "__init__", failures.remembering_address),
)
LOOPBACK = (
    Patch("grpc", "server", gateway.loopback_grpc_server),
    Patch("zmq:Socket", "bind", gateway.loopback_zmq_bind),
)
REQUEST_CLASSES = (  # MII's request classes: held while a pipeline or a model server lives (see Shared)
    Patch("mii.batching.data_classes:Request", "to_msg_dict", requests.sending_namespace),
    Patch("mii.batching.data_classes:RequestMsg", "from_msg_dict", requests.receiving_namespace),
    Patch("mii.batching.data_classes:Request", "is_done", stopping.counting_new_tokens),
)
MODEL_SERVER = (  # after FAILURES: this schedule_requests calls theirs
    Patch(_ASYNC, "schedule_requests", loop.waiting_when_idle),
    Patch(_ASYNC, "shutdown", loop.storing_everything),
)
REST_GATEWAY = (  # context: MII's model config
    Patch("mii.grpc_related.restful_gateway", "createRestfulGatewayApp", gateway.checked_rest_gateway),
)
LAUNCHING = (  # context: a processes.Launch
    Patch("mii.backend.server:MIIServer", "__init__", processes.noting_hostfile),
    Patch("mii.backend.server:MIIServer", "_generate_ds_launch_str", processes.noting_replica_hostfile),
    Patch("mii.backend.server:MIIServer", "_launch_server_process", processes.through_hcache_launch),
    Patch("mii.backend.server:MIIServer", "_wait_until_server_is_live", processes.waiting_briefly),
)
EVERY = (
    *ENGINE,
    *ON_CPU,
    *CHECKS,
    *DETOKENIZING,
    *FAILURES,
    *LOOPBACK,
    *REQUEST_CLASSES,
    *MODEL_SERVER,
    *REST_GATEWAY,
    *LAUNCHING,
)


class Patches:
    """Attributes set together, each saved with what its owner held of it before (in its own ``__dict__``:
    an inherited one is not the owner's), to be restored together: :meth:`undo` restores them in reverse
    order, deleting those the owner did not hold, and releases the shared groups held. Undoing twice, or
    after a failed install, is harmless."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []  # (owner, name, original or ABSENT), in the order set
        self._releases: list[Callable[[], None]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, vars(owner).get(name, ABSENT)))
        setattr(owner, name, value)

    def install(self, group: tuple[Patch, ...], *context: Any) -> Patches:
        """Every patch of ``group``, made with ``context``; if one fails, everything set here is undone."""
        try:
            for patch in group:
                owner = patch.target()
                self.set(owner, patch.name, patch.make(getattr(owner, patch.name, ABSENT), *context))
        except BaseException:
            self.undo()
            raise
        return self

    def hold(self, shared: Shared) -> Patches:
        self._releases.append(shared.hold())
        return self

    def undo(self) -> None:
        while self._releases:
            self._releases.pop()()
        while self.saved:
            owner, name, original = self.saved.pop()
            if original is ABSENT:
                with suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


class Shared:
    """A group installed while anything holds it: the first hold installs it, the last release undoes it.
    For a group that what outlives an install needs (the request classes a pipeline uses), while several
    such may live at once."""

    def __init__(self, group: tuple[Patch, ...]) -> None:
        self.group, self._patches, self._holders, self._lock = group, Patches(), 0, threading.Lock()

    def hold(self) -> Callable[[], None]:
        """Hold the group; returns the release, which only its first call does."""
        with self._lock:
            if self._holders == 0:
                self._patches.install(self.group)
            self._holders += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                self._holders -= 1
                if self._holders == 0:
                    self._patches.undo()

        return release


HELD_REQUEST_CLASSES = Shared(REQUEST_CLASSES)


def check_mii_version() -> None:
    import mii

    version = tuple(int(p) for p in mii.__version__.strip().split(".")[:2])
    if not TESTED_MII[0] <= version < TESTED_MII[1]:
        lo, hi = (".".join(map(str, v)) for v in TESTED_MII)
        raise InvalidRequestError(
            f"the hcache MII backend is tested with deepspeed-mii >={lo},<{hi}; found {mii.__version__}"
        )


def install(hcache: ResolvedConfig) -> Patches:
    """Make this process's MII build hcache's engine and run hcache's loop, until the result is undone
    (``with install(hcache):``)."""
    import torch

    check_mii_version()
    patches = Patches().install(ENGINE, hcache)
    if not torch.cuda.is_available():
        patches.install(ON_CPU)
    for group in (CHECKS, DETOKENIZING, FAILURES, LOOPBACK):
        patches.install(group)
    return patches


installed = install  # ``with installed(hcache):``


def install_server(hcache: ResolvedConfig, model_config, rest_gateway: bool) -> Patches:
    """For one of MII's server processes, until its server returns: :func:`install`, MII's request classes'
    replacements, the model server's idle wait and store at shutdown, and, in the REST gateway, every request
    checked at the door and every error answered with its HTTP status and message."""
    patches = install(hcache).hold(HELD_REQUEST_CLASSES).install(MODEL_SERVER)
    if rest_gateway:
        patches.install(REST_GATEWAY, model_config)
    return patches


def hold_loop_patches(pipeline) -> None:
    """Keep hcache's replacements of ``pipeline``'s loop methods (it was built while :func:`install` was in
    effect) after the install is undone: its class becomes a subclass that holds them, and MII's classes are
    left as they were. MII's request classes are held until the pipeline is destroyed."""
    cls = type(pipeline)
    methods = {p.name: getattr(cls, p.name) for p in (*CHECKS, *FAILURES) if p.owner in (_LOOP, _PIPELINE)}
    held = Patches().hold(HELD_REQUEST_CLASSES)

    def destroy(self) -> None:
        try:
            cls.destroy(self)
        finally:
            held.undo()

    pipeline.__class__ = type(cls.__name__, (cls,), {**methods, "destroy": destroy})


@contextmanager
def launching_with_hcache(hcache: ResolvedConfig, launched: list) -> Iterator[None]:
    """While ``mii.serve`` starts its processes, start them through :mod:`hcache.mii.launch` with the hcache
    config (:class:`~hcache.mii.processes.Launch`), and collect them in ``launched``. MII's hostfiles and the
    servers' error file are removed once it has started (or failed to)."""
    launch = processes.Launch(hcache, launched)
    try:
        with Patches().install(LAUNCHING, launch):
            yield
    finally:
        launch.remove_files()
