"""The one way every entry point that serves (the runtime, MII's model servers) builds its serving engine."""

from __future__ import annotations

from ..config import ResolvedConfig
from ..engine.interface import Engine
from ..model.tensor_parallel import SINGLE, TPGroup
from .engine import ServingEngine
from .self_check import self_check
from .store_stack import StoreStack


def serving_engine(
    config: ResolvedConfig, engine: Engine, fingerprint: str, tp: TPGroup = SINGLE, *, engine_config: object = None
) -> ServingEngine:
    """The serving engine over ``engine`` and its store stack, after the self-check the config's
    ``self_check`` asks for: with the failed methods disabled, or
    :class:`~hcache.serving.self_check.SelfCheckFailed` under ``"strict"``."""
    config = self_check(config, engine, fingerprint, tp)
    serving = ServingEngine(engine, StoreStack(config, engine, fingerprint, tp), engine_config=engine_config)
    serving.metrics.self_check_disabled = frozenset(m.value for m in config.disabled)
    return serving
