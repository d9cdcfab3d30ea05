"""The one step that resolves hcache's settings for a model (:func:`resolve`), where the process that starts
serving runs: the runtime's constructor, or ``hcache.mii.pipeline``/``serve`` before any model server starts.
It sits above the settings (:mod:`hcache.config`) because ``plan="auto"`` may measure this machine's profile
(:mod:`hcache.planning.auto_profile`), which runs an engine and a store."""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..config import EngineKind, HCacheConfig, ResolvedConfig, engine_and_device, fixed_plan, is_auto
from ..model.loader import LoadedModel
from ..model.spec import ModelSpec
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.stored_state import code_dtypes, parse_stored_dtype
from .auto_profile import auto_profile
from .plan import Method, RestorePlan
from .profile import Profile, profile_command


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
    kind, device = engine_and_device(settings)
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
    plan = None if auto else fixed_plan(settings.plan, spec)
    save = settings.save if settings.enabled else "none"
    stored_dtype = parse_stored_dtype(settings.stored_dtype)
    return ResolvedConfig(
        settings=settings,
        spec=spec,
        model_name=model_name,
        engine=engine or kind,
        device=device,
        tensor_parallel=tensor_parallel,
        profile=profile,
        plan=plan,
        save_formats=_save_formats(save, plan, profile, spec, code_dtypes(stored_dtype)),
        stored_dtype=stored_dtype,
    )


def _save_formats(
    save: str, plan: RestorePlan | None, profile: Profile | None, spec: ModelSpec, encodings: dict[str, torch.dtype]
) -> tuple[frozenset[str], ...]:
    if save == "none":
        return (frozenset(),) * spec.num_layers
    if save == "all":
        return (frozenset((Method.H.value, Method.KV.value)),) * spec.num_layers
    if plan is not None:
        plans = [plan]
    else:  # every plan auto picks over the context range
        lengths = sorted({*profile.tokens, *_powers_of_two(CHUNK_TOKENS, spec.max_positions)})
        plans = [profile.plan(spec, n, encodings) for n in lengths]
    return tuple(frozenset(p.layers[layer].stored_format for p in plans) - {None} for layer in range(spec.num_layers))


def _powers_of_two(start: int, stop: int) -> list[int]:
    return [start << i for i in range(max(1, stop // start).bit_length())]
