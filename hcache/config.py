"""hcache's settings (:class:`HCacheConfig`), and what they become for one model (:class:`ResolvedConfig`).

Every entry point builds one :class:`HCacheConfig`: :class:`~hcache.serving.runtime.HCacheRuntime` from its
keyword arguments, :mod:`hcache.mii` from its ``hcache=`` config, ``hcache serve`` from its flags. Bad
settings are refused here, each with one :class:`InvalidRequestError` message, before a model loads or a
store opens. :func:`~hcache.resolve.resolve` turns them and the model's shape into a
:class:`ResolvedConfig` (engine and device, plan policy, profile, formats and encodings to save) once, where
serving starts; engines, the store stack and MII's model servers receive it and resolve nothing again.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .defaults import DEFAULT_LOAD_IN_STEP_TOKENS, DEFAULT_READERS
from .errors import InvalidRequestError
from .model.loader import model_dtype
from .model.spec import ModelSpec
from .planning.checkpoints import StateRule
from .planning.plan import Method, RestorePlan
from .planning.policy import PlanPolicy, is_auto
from .planning.profile import Profile
from .planning.window import WindowRule
from .storage.chunk_key import check_namespace
from .storage.residency import Kept
from .storage.store_config import StoreConfig
from .storage.stored_state import Encoding, Format, code_dtypes, parse_stored_dtype

AUTO = "auto"  # a setting hcache decides
_RANK_DIR = "tp{size}-rank{rank}"  # a tensor-parallel rank's store directory, inside each of the settings' own
SavePolicy = Literal["plan", "all", "none"]
EngineKind = Literal["fastgen", "reference", "vllm"]
EvictionPolicy = Literal["cost", "lru"]
SelfCheck = Literal["on", "strict", "off"]
SlidingLayers = Literal["window", "all"]


_ENDPOINT = re.compile(r"tcp://[^\s/]+:(\d{1,5})|(ipc|inproc)://\S+")


class KvEvents(BaseModel):
    """Where ``hcache serve`` publishes what its tiers hold as vLLM's KV cache events
    (:mod:`hcache.vllm.publisher`): the fields of vLLM's ``--kv-events-config`` (``endpoint``: a ``tcp://``
    address with ``*`` binds, one with a host connects, as vLLM's; ``replay_endpoint``, ``buffer_steps``,
    ``hwm``, ``max_queue_size``, ``topic``; ``enable_kv_cache_events=False`` publishes nothing), and the two
    of vLLM's engine that its routers hash blocks by: ``block_size`` (``--block-size``) and
    ``prefix_caching_hash_algo`` (``--prefix-caching-hash-algo``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = True
    publisher: Literal["zmq"] = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, gt=0)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, gt=0)
    topic: str = ""
    block_size: int = Field(16, gt=0)
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256"

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str | None) -> str | None:
        found = _ENDPOINT.fullmatch(endpoint) if endpoint is not None else None
        if endpoint is not None and (found is None or (found[1] is not None and int(found[1]) > 65535)):
            raise ValueError("a ZMQ endpoint is tcp://HOST:PORT (* for every interface), ipc://PATH or inproc://NAME")
        return endpoint

    def listens(self) -> dict[str, tuple[str, int]]:
        """The TCP addresses the publisher listens on, by field: ``endpoint`` where it binds (``*``: every
        interface; with a host it connects), ``replay_endpoint`` always (a port 0 is the system's pick)."""
        found = {}
        for name, endpoint, binds in (
            ("endpoint", self.endpoint, self.endpoint.startswith("tcp://*:")),
            ("replay_endpoint", self.replay_endpoint, True),
        ):
            if endpoint is not None and endpoint.startswith("tcp://") and binds:
                host, port = endpoint[len("tcp://") :].rsplit(":", 1)
                if port != "0":
                    found[name] = ("0.0.0.0" if host == "*" else host.strip("[]"), int(port))
        return found


class HCacheConfig(BaseModel):
    """What a user sets. ``enabled=False`` serves on the same engine with no store: the recompute baseline.

    ``engine``: ``"fastgen"`` (DeepSpeed-FastGen, CUDA only), ``"reference"`` (HF transformers modules, any
    device) or ``"auto"`` (FastGen when a GPU is present; the runtime always uses the reference engine).
    ``store_dirs``: local chunk store directories, one per SSD. ``plan``: ``None`` (H for MHA models, KV
    where KV is no larger; ``"auto"`` when a ``profile`` is given), ``"auto"`` (the profile's bubble-free
    plan for each history length), ``"RE"``/``"H"``/``"KV"``, counts such as ``"2RE+20H+8KV"``, or a
    :class:`~hcache.planning.plan.RestorePlan`.
    ``profile``: a profile file from ``hcache profile`` (or a :class:`~hcache.planning.profile.Profile`), refused if
    measured for another model or machine.
    ``"auto"`` alone plans with this machine's profile, measured on first use unless
    ``measure_profile=False`` (then the default plan serves until ``hcache profile`` has run). ``save``:
    ``"plan"`` saves the formats the plan restores from, ``"all"`` hidden states and KV for every layer,
    ``"none"`` nothing. ``namespace``: keeps this deployment's chunks apart from others' in a shared store.
    ``store``: quota, TTL, host pool and write-back options, and ``shared``: stores shared with other nodes
    (a Redis server or cluster, a shared filesystem) below the local ``store_dirs``, which may then be
    empty. ``readers``: threads that load stored chunks into the host pool while the RE layers compute (0:
    inline). ``num_blocks``, ``device`` and ``dtype`` size the reference engine's KV cache and place its
    model (FastGen takes these from MII's ``inference_engine_config``). ``request_log``: a file that gets
    one JSON line per finished sequence. ``gpu_cache``: keep finished sequences' KV in spare KV blocks and
    adopt it (:mod:`hcache.serving.gpu_prefix_cache`). ``metrics_port``: serve the counters
    (:mod:`hcache.serving.metrics`) for Prometheus on ``metrics_host`` from each model server process
    (tensor-parallel rank ``r`` on ``metrics_port + r``). ``stored_dtype``: how saved state is encoded
    (:func:`~hcache.storage.stored_state.parse_stored_dtype`): ``"auto"`` (the model's dtype, lossless), ``"int8"``, ``"fp8"``, ``"8bit"``
    (each format in the 8-bit encoding that keeps its quality best: fp8 for H, int8 for KV), or per format
    as ``"H=fp8,KV=int8"``; orthogonal to the plan, and chunks of every encoding restore on any runtime
    (:mod:`hcache.storage.stored_state`). ``eviction``: what the GPU prefix cache and the host pool give up
    first when full: ``"cost"`` (the least recompute time saved per byte, per second idle, as Pensieve
    does) or ``"lru"`` (the least recently used). ``self_check``: before serving, restore a short random
    history by each method the plan may use and compare it with recompute: ``"on"`` disables a method that
    fails, ``"strict"`` refuses to start, ``"off"`` skips the check. ``sliding_layers``: what sliding-window
    layers store and restore: ``"window"``, the chunks their window reaches (:mod:`hcache.planning.window`),
    or ``"all"``, every token, as full-attention layers (conversations that branch far back restore too).
    ``state_every``: a recurrent (Mamba or gated-delta-net) layer's state is stored at the end of every
    ``state_every``-th chunk, and a prefix restores only to one of those ends (:mod:`hcache.planning.checkpoints`);
    in vLLM, at every ``state_every``-th of vLLM's own checkpoints (its Mamba block). ``kv_events``: publish
    what this node's tiers hold as vLLM's KV cache events over ZMQ from its model server (``hcache serve``,
    :mod:`hcache.mii`; :class:`KvEvents`), so that a router built for vLLM scores it (one rank; vLLM's connector
    publishes through vLLM's own ``--kv-events-config`` instead). ``load_in_step_tokens``: in vLLM, a
    stored prefix of at most this many tokens past vLLM's own prefix-cache hit loads inside the step that
    computes its request, which waits for it; a larger one loads while vLLM holds the request back and steps
    the others (0: every load so). Not for a model of several KV cache groups (hybrids, windows), whose failed
    loads vLLM takes by request only, nor under tensor parallelism. hcache's own engines always restore within
    the request's step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    engine: Literal["auto", "fastgen", "reference"] = "auto"
    store_dirs: list[str] = Field(default_factory=lambda: ["hcache-store"])
    profile: str | Profile | None = None
    plan: str | RestorePlan | None = None
    measure_profile: bool = True
    save: SavePolicy = "plan"
    namespace: str | None = None
    store: StoreConfig = StoreConfig()
    readers: int = Field(DEFAULT_READERS, ge=0)
    num_blocks: int = Field(256, gt=0)
    device: str | None = None
    dtype: str | None = None
    request_log: str | None = None
    gpu_cache: bool = False
    metrics_port: int | None = Field(None, ge=1, le=65535)
    metrics_host: str = "localhost"
    stored_dtype: str = AUTO
    eviction: EvictionPolicy = "cost"
    self_check: SelfCheck = "on"
    sliding_layers: SlidingLayers = "window"
    state_every: int = Field(1, gt=0)
    kv_events: KvEvents | None = None
    load_in_step_tokens: int = Field(DEFAULT_LOAD_IN_STEP_TOKENS, ge=0)

    @classmethod
    def of(cls, settings: HCacheConfig | Mapping | None = None, /, **overrides) -> HCacheConfig:
        """``settings`` (a config or a dict) with ``overrides``, validated; a bad value raises
        :class:`InvalidRequestError` naming the setting."""
        if isinstance(settings, HCacheConfig) and not overrides:
            return settings
        given = settings.model_dump() if isinstance(settings, HCacheConfig) else dict(settings or {})
        try:
            return cls(**{**given, **overrides})
        except ValidationError as exc:
            raise InvalidRequestError(_message(exc)) from None

    @field_validator("profile", "request_log", mode="before")
    @classmethod
    def _path(cls, path: object) -> object:
        return str(path) if isinstance(path, Path) else path

    @field_validator("store_dirs", mode="before")
    @classmethod
    def _dirs(cls, dirs: object) -> object:
        if dirs is None:
            return []
        if isinstance(dirs, (str, Path)):
            dirs = [dirs]
        if isinstance(dirs, Sequence) and "" in dirs:  # Path("") is the current directory
            raise ValueError("a store directory is named '' (give '.' for the current directory)")
        return [str(d) for d in dirs] if isinstance(dirs, Sequence) else dirs

    @field_validator("plan")
    @classmethod
    def _plan(cls, plan: str | RestorePlan | None) -> str | RestorePlan | None:
        if plan is None or is_auto(plan) or isinstance(plan, RestorePlan):
            return plan
        RestorePlan.check_syntax(plan)  # the layer count is checked against the model in resolve()
        return plan.strip().upper()

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, dtype: str | None) -> str | None:
        if dtype is not None:
            model_dtype(dtype, "cpu")
        return dtype

    @field_validator("stored_dtype")
    @classmethod
    def _stored_dtype(cls, stored_dtype: str) -> str:
        parse_stored_dtype(stored_dtype)
        return stored_dtype

    @field_validator("namespace", mode="before")
    @classmethod
    def _namespace(cls, namespace: object) -> str | None:
        return check_namespace(namespace, "namespace")  # before coercion: bytes are refused, as a request's are

    @property
    def published_events(self) -> KvEvents | None:
        """``kv_events`` where it publishes (None: not set, or ``enable_kv_cache_events=False``)."""
        return self.kv_events if self.kv_events is not None and self.kv_events.enable_kv_cache_events else None

    @model_validator(mode="after")
    def _somewhere_to_store(self) -> HCacheConfig:
        if self.enabled and not self.store_dirs and not self.store.shared:
            raise ValueError(
                "store_dirs may be empty only when store.shared names a shared store (enabled=False serves with no store)"
            )
        return self


class ResolvedConfig(BaseModel):
    """Settings resolved for one model (with tensor parallelism, one rank's shard): what the serving engine
    serves by. ``plan``: a fixed plan, or ``None`` for the profile's plan per history length.
    ``save_formats``: per layer, the stored formats to save (for the auto plan, every format it restores
    from at any length). ``stored_dtype``: the formats saved in an 8-bit encoding, parsed from the setting
    once. ``disabled``: the methods the start-up self-check (:mod:`hcache.serving.self_check`) failed, which
    no plan restores by for the rest of the process; ``verified``: those it passed, which a disabled
    method's layers fall back to (else RE). Plain data, so that ``hcache.mii.serve`` hands it to its model
    servers as JSON."""

    model_config = ConfigDict(frozen=True)

    settings: HCacheConfig
    spec: ModelSpec
    model_name: str
    engine: EngineKind = "reference"
    device: str = "cpu"
    tensor_parallel: int = 1
    profile: Profile | None = None
    plan: RestorePlan | None = None
    save_formats: tuple[frozenset[Format], ...]
    stored_dtype: dict[Format, Encoding] = {}
    disabled: frozenset[Method] = frozenset()
    verified: frozenset[Method] = frozenset()

    @property
    def stored(self) -> bool:
        """Whether there is a store (a local directory or a shared store) to restore from and save to."""
        return self.settings.enabled

    @functools.cached_property
    def encodings(self) -> dict[str, torch.dtype]:
        """The stored formats saved in an 8-bit encoding, and its code dtype; the others are lossless."""
        return code_dtypes(self.stored_dtype)

    @property
    def store(self) -> StoreConfig:
        return self.settings.store

    def store_dirs(self, rank: int = 0) -> list[str] | None:
        """The local store directories of tensor-parallel ``rank`` (None: no local disk). Ranks store in
        directories of their own: a store's index and quota assume one writer process per directory."""
        dirs = self.settings.store_dirs
        if not self.stored or not dirs:
            return None
        if self.tensor_parallel == 1:
            return dirs
        return [str(Path(d) / _RANK_DIR.format(size=self.tensor_parallel, rank=rank)) for d in dirs]

    def other_layouts(self) -> list[Path]:
        """The first store directory of each other tensor-parallel layout written beside this one: at size 1
        the directory itself, at size N rank 0's. Their anchor logs say what a store of another size held."""
        if not self.stored or not self.settings.store_dirs:
            return []
        base, own = Path(self.settings.store_dirs[0]), Path(self.store_dirs(0)[0])
        found = [base, *sorted(base.glob(_RANK_DIR.format(size="*", rank=0)))]
        return [d for d in found if d != own and d.is_dir()]

    @property
    def policy(self) -> PlanPolicy:
        """The plan policy these settings serve by: which plan each restore follows (made on each call: a
        copy with other ``disabled`` methods must not share it)."""
        return PlanPolicy(
            self.spec,
            self.plan,
            self.profile,
            self.encodings,
            self.engine != "vllm",
            self.disabled,
            self.verified,
            self.window_rule(self.spec),
            self.state_rule(self.spec),
        )

    def window_rule(self, spec: ModelSpec, block: int = 1) -> WindowRule:
        """The window rule for ``spec`` (this model, or an engine's view of it) in an engine of ``block``-token
        KV blocks, by the ``sliding_layers`` setting. FastGen windows no layer (its Mistral attends to every
        position), so on it every token is stored and restored."""
        return WindowRule(spec, block, every_token=self.settings.sliding_layers == "all" or self.engine == "fastgen")

    def state_rule(self, spec: ModelSpec) -> StateRule:
        """Where ``spec``'s recurrent layers keep their state, by the ``state_every`` setting; in vLLM, only where
        one of its steps ends (:mod:`hcache.planning.checkpoints`)."""
        return StateRule(spec, self.settings.state_every, at_step_end=self.engine == "vllm")

    def kept(self, spec: ModelSpec, layer: int) -> Kept:
        """Which chunks keep what a load reads of ``layer``: a recurrent layer's state, those at checkpoints; a
        sliding-window layer's rows under the window rule, the last window of each save; else every chunk (every
        row, or none of a layer that is not stored, which a load recomputes). KV cache events announce a group's
        blocks by it (:class:`~hcache.vllm.events.Group`)."""
        if not self.save_formats[layer]:
            return Kept.EVERY
        if spec.is_recurrent(layer):
            return Kept.CHECKPOINTS
        return Kept.EVERY if self.window_rule(spec).window(layer) is None else Kept.WINDOW

    def check_engine(self, spec: ModelSpec) -> None:
        """Refuse an engine whose model differs from the one these settings were resolved for (in its dtype
        too if a profile was: costs are measured in one dtype)."""
        mine = self.spec if self.profile is not None else dataclasses.replace(self.spec, dtype=spec.dtype)
        if spec.to_json() != mine.to_json():
            raise InvalidRequestError(
                f"the engine's model ({spec.describe()}) is not the one the hcache config was resolved for "
                f"({self.spec.describe()}): resolve it for this engine's model, dtype and tensor parallelism"
            )


def engine_and_device(settings: HCacheConfig, model_type: str | None = None) -> tuple[EngineKind, str]:
    """The engine and device that ``settings`` run on, decided where they resolve (model servers read them
    from :class:`ResolvedConfig`): ``"auto"`` is FastGen where torch sees a GPU and FastGen serves the
    family of ``model_type`` (if given), else the reference engine; the device is the GPU if there is one.
    ``"fastgen"`` for a family it does not serve is refused, naming why."""
    from .engine.fastgen import SUPPORTED_MODEL_TYPES, check_model_type

    cuda = torch.cuda.is_available()
    if settings.engine == AUTO:
        engine = "fastgen" if cuda and (model_type is None or model_type in SUPPORTED_MODEL_TYPES) else "reference"
    else:
        engine = settings.engine
    if engine == "fastgen" and model_type is not None:
        check_model_type(model_type)
    return engine, settings.device or ("cuda" if cuda else "cpu")


def _message(exc: ValidationError) -> str:
    """One line per bad setting: its name and what is wrong with it."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "config"
        why = str(error["ctx"]["error"]) if "error" in error.get("ctx", {}) else error["msg"]
        given = f"{error['input']!r:.80}"  # a value may be long (a 10,000-character namespace): its start
        lines.append(f"hcache setting {where!r}: {why} (given {given})" if where != "config" else why)
    return "; ".join(lines)
