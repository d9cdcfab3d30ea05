"""The one step that resolves hcache's settings for a model (:func:`resolve`), where the process that starts
serving runs: the runtime's constructor, or ``hcache.mii.pipeline``/``serve`` before any model server starts.
It sits above the settings (:mod:`hcache.config`) and planning (:mod:`hcache.planning`), which knows no
settings: ``plan="auto"`` may measure this machine's profile (:mod:`hcache.planning.auto_profile`), which
runs an engine and a store."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Mapping

from .config import EngineKind, HCacheConfig, ResolvedConfig, engine_and_device
from .errors import InvalidRequestError, UnsupportedModelError
from .model.loader import LoadedModel
from .model.spec import ModelSpec
from .planning.auto_profile import auto_profile
from .planning.plan import Method
from .planning.policy import fixed_plan, is_auto
from .planning.profile import Profile, profile_command
from .storage.chunk_key import CHUNK_TOKENS
from .storage.stored_state import Format, parse_stored_dtype


def resolve(
    settings: HCacheConfig | Mapping | None,
    spec: ModelSpec,
    model_name: str,
    *,
    tensor_parallel: int = 1,
    measure: Callable[[], LoadedModel] | None = None,
    engine: EngineKind | None = None,
) -> ResolvedConfig:
    """The settings resolved for ``spec`` (with tensor parallelism, a rank's shard), to run on ``engine``
    (``None``: :func:`engine_and_device`'s). The profile is the one given (which must fit), or for
    ``plan="auto"`` alone this machine's (:mod:`hcache.planning.auto_profile`), measured from the model
    ``measure`` returns if none is found and ``measure_profile`` allows, else none and the default plan
    after one warning."""
    settings = HCacheConfig.of(settings)
    kind, device = engine_and_device(settings, spec.model_type)
    profile = None
    if settings.enabled:
        command = profile_command(model_name, spec)
        profile = settings.profile
        if profile is None and is_auto(settings.plan):
            profile = auto_profile(spec, model_name, tensor_parallel, measure if settings.measure_profile else None)
        if isinstance(profile, Profile):
            profile.check(spec, tensor_parallel, command)
        elif profile is not None:
            profile = Profile.load(profile, spec, tensor_parallel, command)
    auto = profile is not None and (settings.plan is None or is_auto(settings.plan))
    config = ResolvedConfig(
        settings=settings,
        spec=spec,
        model_name=model_name,
        engine=engine or kind,
        device=device,
        tensor_parallel=tensor_parallel,
        profile=profile,
        plan=None if auto else fixed_plan(settings.plan, spec),
        save_formats=(),
        stored_dtype=parse_stored_dtype(settings.stored_dtype),
    )
    _ = config.policy  # made now, so that a plan the engine cannot run is refused before a model loads
    if settings.enabled and tensor_parallel > 1 and config.engine != "vllm" and config.window_rule(spec).sliding_layers:
        raise UnsupportedModelError(
            "a model with sliding-window layers cannot be served with tensor parallelism here by the window rule: its "
            "ranks gather each H layer's rows chunk by chunk, and the rule stores only the last window's (set "
            "sliding_layers='all', serve it at tensor_parallel=1, or in vLLM)"
        )
    if spec.recurrent_layers and (settings.gpu_cache or tensor_parallel > 1):
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r} has recurrent (Mamba or gated-delta-net) layers, whose state hcache keeps "
            "per sequence and at chunk ends: the GPU prefix cache keeps K/V blocks alone, and tensor parallelism would "
            "split the state (serve it with gpu_cache=False at tensor_parallel=1)"
        )
    if settings.published_events is not None:
        _check_events(tensor_parallel)
    config = config.model_copy(update={"save_formats": _save_formats(config)})
    if not spec.restores_hidden and (
        (config.plan is not None and Method.H in config.plan.layers)
        or any(Method.H.value in f for f in config.save_formats)
    ):
        why = (
            "its attention caches one latent row a token (MLA), not the K/V heads a layer's K/V projection rebuilds"
            if spec.kv_lora_rank
            else "hcache does not know where its layer input and K/V projection live"
        )
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r}: {why}, which hidden states (H) need (plan "
            f"{str(config.plan or settings.plan)!r}, save={settings.save!r}); give plan 'KV' and save 'plan': its K/V "
            "rows are stored and loaded as the engine computes them"
        )
    return config


def _check_events(tensor_parallel: int) -> None:
    """Refuse ``kv_events`` where they cannot be published whole (:mod:`hcache.vllm.publisher`): every model is,
    each kind of layer in a KV cache group of its own, but one process holds one rank's part of each chunk."""
    if tensor_parallel > 1:
        raise InvalidRequestError(
            f"kv_events is published by one model server, and at tensor_parallel={tensor_parallel} each rank "
            "holds its own part of every chunk: serve at tensor_parallel=1, or without kv_events"
        )
    if importlib.util.find_spec("vllm") is None:
        raise InvalidRequestError("kv_events is published by vLLM's own publisher: install vllm (scripts/install.sh)")


def self_check_methods(config: ResolvedConfig) -> frozenset[Method]:
    """The stored methods the start-up self-check tries: a fixed plan's; for the profile's plans, every
    method they pick at some history length, also with H or KV disabled (so whatever a disabled method
    falls back to was tried too: KV, and H where KV does not dominate it)."""
    if config.plan is not None:
        plans = [config.plan]
    else:
        plans = [
            config.profile.plan(config.spec, n, config.encodings, allow_h=h, allow_kv=kv)
            for n in _lengths(config)
            for h, kv in ((True, True), (False, True), (True, False))
        ]
    return frozenset(m for plan in plans for m in plan.layers) - {Method.RE}


def disable_methods(config: ResolvedConfig, failed: Iterable[Method], passed: Iterable[Method]) -> ResolvedConfig:
    """``config`` after the self-check: the ``failed`` methods disabled for the process (their layers restore
    by a ``passed`` method, else by RE; see :meth:`ResolvedConfig.allowed`) and no longer saved."""
    checked = config.model_copy(update={"disabled": frozenset(failed), "verified": frozenset(passed)})
    checked = checked.model_copy(
        update={"plan": checked.policy.allowed(config.plan) if config.plan is not None else None}
    )
    return checked.model_copy(update={"save_formats": _save_formats(checked)})


def _save_formats(config: ResolvedConfig) -> tuple[frozenset[Format], ...]:
    save, spec = config.settings.save if config.stored else "none", config.spec
    if save == "none":
        return (frozenset(),) * spec.num_layers
    if save == "all":
        return (frozenset(m.value for m in (Method.H, Method.KV) if m not in config.disabled),) * spec.num_layers
    # every plan the config restores by: the fixed one, or those auto picks over the context range
    plans = [config.plan] if config.plan is not None else [config.policy.plan_for(None, n) for n in _lengths(config)]
    return tuple(frozenset(p.layers[layer].stored_format for p in plans) - {None} for layer in range(spec.num_layers))


def _lengths(config: ResolvedConfig) -> list[int]:
    """The history lengths the profile's plans are taken at: those it measured, and powers of two."""
    return sorted({*config.profile.tokens, *_powers_of_two(CHUNK_TOKENS, config.spec.max_positions)})


def _powers_of_two(start: int, stop: int) -> list[int]:
    return [start << i for i in range(max(1, stop // start).bit_length())]
