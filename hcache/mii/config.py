"""The hcache backend's options for ``mii.pipeline`` / ``mii.serve``: where state is stored, how it is restored."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..storage.host_tier import DEFAULT_READERS
from ..storage.store_config import StoreConfig
from .requests import check_namespace


class HCacheConfig(BaseModel):
    """``enabled=False`` serves MII on the same engine with no store: the recompute baseline.

    ``engine``: ``"fastgen"`` (DeepSpeed-FastGen, CUDA only), ``"reference"`` (HF transformers modules, any
    device) or ``"auto"`` (FastGen when a GPU is present). ``plan``: ``None`` (H for MHA models, KV where KV
    is smaller; ``"auto"`` when a profile is given), ``"auto"``, ``"RE"``/``"H"``/``"KV"`` or counts such as
    ``"2RE+20H+8KV"``. ``"auto"`` alone plans with this machine's profile, measured on first use unless
    ``measure_profile=False`` (then the default plan serves until ``hcache profile`` has run). ``store``:
    quota, TTL, host pool and write-back options, and ``tiers``: stores shared with other replicas (a
    Redis server or cluster, a shared filesystem) below the local ``store_dirs``, which may then be empty. ``num_blocks``, ``device`` and ``dtype`` size the reference
    engine's KV cache and place its model (FastGen takes these from MII's ``inference_engine_config``).
    ``request_log``: a file that gets one JSON line per finished sequence (tokens restored and computed,
    bytes read, plan, fallback, and each put's restore: plan and tokens). ``gpu_cache``: keep finished
    sequences' KV in spare KV blocks and adopt it (:mod:`hcache.gpu_prefix_cache`). ``metrics_port``: serve
    the counters (:mod:`hcache.metrics`) for Prometheus on ``metrics_host`` from each model server process
    (tensor-parallel rank ``r`` on ``metrics_port + r``).
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    engine: Literal["auto", "fastgen", "reference"] = "auto"
    store_dirs: list[str] = Field(default_factory=lambda: ["hcache-store"])
    profile: str | None = None
    plan: str | None = None
    measure_profile: bool = True
    save: Literal["plan", "all", "none"] = "plan"
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

    @model_validator(mode="after")
    def _somewhere_to_store(self) -> HCacheConfig:
        if not self.store_dirs and not self.store.tiers:
            raise ValueError("store_dirs may be empty only when store.tiers names a shared tier")
        return self

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, namespace: str | None) -> str | None:
        return check_namespace(namespace, "namespace")
