"""The profile behind ``plan="auto"`` when none is given: this machine's, or one measured on first use.

A profile holds only on the machine it was measured on (:meth:`Profile.check`), so a server that moves to
another machine must not plan with the old one, and must not stop either. Lookup order:
1. ``$HCACHE_HOME/profiles/<machine>-<model>.json``, the per-machine cache that ``hcache profile`` writes;
2. ``profiles/<machine>-<model>.json`` under the working directory (profiles kept with a checkout).

A file there that does not fit (measured elsewhere, by an older hcache, for another shape) is skipped. If
none fits and measuring is allowed, a short profile is measured now, with a progress bar, and saved in the
cache for the next start. Otherwise the default plan serves, and one warning says how to profile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ..model.loader import LoadedModel
from ..model.spec import ModelSpec
from .profile import Profile, ProfileMismatch, default_profile_path, profile_command

log = logging.getLogger(__name__)


def auto_profile(
    spec: ModelSpec, model_name: str, tensor_parallel: int = 1, measure: Callable[[], LoadedModel] | None = None
) -> Path | None:
    """The path of a profile that fits ``spec`` here, or None after a warning (the caller serves the default
    plan). ``measure``, if given, returns the model to measure when none fits (loaded only then); profiles
    measured on first use are single-rank, so with tensor parallelism nothing is measured."""
    command = profile_command(model_name, spec)
    skipped = []
    for path in (default_profile_path(model_name), default_profile_path(model_name, "profiles")):
        if path.is_file():
            try:
                Profile.load(path, spec, tensor_parallel, command)
                return path
            except ProfileMismatch as exc:
                skipped.append(f"{path}: {exc}")
    why = f"plan 'auto' found no profile of {model_name} for this machine"
    if skipped:
        why += f" (skipped {'; '.join(skipped)})"
    if measure is None or tensor_parallel > 1:
        log.warning("%s; serving the default plan. Measure one with `%s`: the next start uses it", why, command)
        return None
    from .profiler import default_tokens, measure_profile

    path = default_profile_path(model_name)
    log.warning("%s; measuring a short one (`%s --short`), saved to %s for the next start", why, command, path)
    loaded = measure()
    profile = measure_profile(loaded, default_tokens(spec.max_positions, short=True))
    profile.command = f"{command} --short (measured on first use)"
    profile.save(path)
    return path
