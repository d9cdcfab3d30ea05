"""The plan policy, the one place that decides which plan a restore follows: a plan as given (``"auto"``, a
plan string, a :class:`~.plan.RestorePlan`, or none) made fixed for a model, a request's own plan, the plan
for a history of given length (a fixed one, or the profile's best), and what the engine and the start-up
self-check allow. It knows no settings: :mod:`hcache.resolve` builds a :class:`PlanPolicy` from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequestError
from ..model.spec import ModelSpec
from .checkpoints import StateRule
from .plan import Method, RestorePlan, default_plan
from .profile import Profile
from .window import WindowRule


def is_auto(plan: object) -> bool:
    """Whether ``plan`` is ``"auto"``: the profile's plan per history length."""
    return isinstance(plan, str) and plan.strip().lower() == "auto"


def fixed_plan(plan: str | RestorePlan | None, spec: ModelSpec) -> RestorePlan:
    """A fixed plan for ``spec``: the one given, or the default for ``None`` (and for ``"auto"`` with no
    profile, after :func:`~.auto_profile.auto_profile`'s warning)."""
    if plan is None or is_auto(plan):
        return default_plan(spec)
    if isinstance(plan, RestorePlan):
        if len(plan.layers) != spec.num_layers:
            raise InvalidRequestError(f"plan {plan} covers {len(plan.layers)} layers, the model has {spec.num_layers}")
        return plan
    return RestorePlan.parse(plan, spec.num_layers)


@dataclass(frozen=True)
class PlanPolicy:
    """``plan``: the deployment's fixed plan, or ``None`` for the profile's per history length.
    ``encodings``: the stored formats kept in 8 bits (their costs differ). ``recomputes_layers``: whether the
    engine can recompute a token's first layers and restore the rest (a plan's RE layers): not vLLM, which
    computes every layer of a token it does not load. ``disabled``: the methods the self-check failed, which
    no plan restores by; ``verified``: those it passed, which a disabled method's layers fall back to.
    ``window``: the window rule restores follow, by which the profile costs each layer; ``states``: where recurrent
    layers keep their state, by which it weighs their stored bytes."""

    spec: ModelSpec
    plan: RestorePlan | None = None
    profile: Profile | None = None
    encodings: dict[str, torch.dtype] = field(default_factory=dict)
    recomputes_layers: bool = True
    disabled: frozenset[Method] = frozenset()
    verified: frozenset[Method] = frozenset()
    window: WindowRule | None = None
    states: StateRule | None = None

    def __post_init__(self) -> None:
        if self.plan is not None:
            self._runnable(self.plan)

    def _runnable(self, plan: RestorePlan) -> RestorePlan:
        if not self.recomputes_layers and Method.RE in plan.layers:
            raise InvalidRequestError(
                f"plan {str(plan)!r} recomputes layers (RE), which this engine cannot: it computes every layer of a token it "
                "does not load. Give a plan of H and KV layers, such as 'H', 'KV' or '20H+10KV'"
            )
        return plan

    def request_plan(self, plan: str | RestorePlan | None) -> RestorePlan | None:
        """A request's own plan (``None``: the deployment's), checked against the model; ``None`` back
        means the profile's plan per history length."""
        if plan is None:
            return self.plan
        if is_auto(plan):
            if self.profile is None:
                raise InvalidRequestError("plan 'auto' needs a profile: pass profile=... or run `hcache profile`")
            return None
        return self._runnable(self.allowed(fixed_plan(plan, self.spec)))

    def plan_for(self, plan: RestorePlan | None, history: int) -> RestorePlan:
        """The plan a restore of ``history`` tokens follows, given a request's resolved ``plan``: for the
        profile's, the best one without the disabled methods."""
        if plan is not None:
            return plan
        allow = {
            m: m not in self.disabled and (m is not Method.H or self.spec.restores_hidden)
            for m in (Method.H, Method.KV)
        }
        return self.profile.plan(
            self.spec,
            history,
            self.encodings,
            allow_h=allow[Method.H],
            allow_kv=allow[Method.KV],
            allow_re=self.recomputes_layers,
            window=self.window,
            states=self.states,
        )

    def allowed(self, plan: RestorePlan) -> RestorePlan:
        """``plan`` without the disabled methods: their layers restore by a method that passed the
        self-check, or else by RE, and every layer before the last RE one is RE too (RE runs the first
        layers, so a plan is ``RE* H* KV*``)."""
        if not self.disabled.intersection(plan.layers):
            return plan
        passed = [m for m in (Method.KV, Method.H) if m in self.verified - self.disabled]
        layers = [(passed[0] if passed else Method.RE) if m in self.disabled else m for m in plan.layers]
        recompute = max((i + 1 for i, m in enumerate(layers) if m is Method.RE), default=0)
        return RestorePlan((Method.RE,) * recompute + tuple(layers[recompute:]))
