"""A hardware profile: measured per-layer restore costs of one model on one machine.

``hcache profile`` measures it (:mod:`hcache.planning.profiler`); the scheduler reads it to choose a plan for each
history length. Costs are measured on a grid of history lengths and interpolated linearly between them
(extrapolated from the last two points), which follows the linear I/O and GEMM terms exactly and the
quadratic attention term of ``C_token`` closely enough on a dense grid.

A profile is only valid for the model shape and machine it was measured on, by the same measuring
procedure; :meth:`Profile.check` refuses anything else with a message that says what differs and the command
that measures a fitting one. ``hcache profile`` saves to a per-machine cache under ``HCACHE_HOME``, where
``plan="auto"`` looks first (:mod:`hcache.planning.auto_profile`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import HCacheError
from ..machine.facts import machine_facts, machine_name
from ..model.loader import cache_home
from ..model.spec import ModelSpec
from ..version import __version__
from .checkpoints import StateRule
from .plan import Method, RestorePlan, state_bytes
from .scheduler import LayerCosts, partition, plan_seconds
from .window import WindowRule

# Bump when what is measured, or how, changes: older profiles are then stale.
PROFILE_VERSION = 2  # 2: I/O measured as whole chunks loaded into the host pool, then copied out per layer
COST_NAMES = ("c_token", "c_h", "c_kv", "io_h", "io_kv")
TP_COST_NAMES = ("ag_h",)  # measured only with tensor parallelism; 0 without
# The compute costs of restoring a layer stored in 8 bits (dequantisation included; ``stored_dtype``).
# Profiles measured before these existed plan 8-bit restores with the lossless compute costs.
ENCODED_COST_NAMES = ("c_h8", "c_kv8")
# A recurrent layer's forward over the history (its RE), measured only for a model with recurrent layers: its
# mixer costs otherwise than attention (``c_token``, an attention layer's).
C_TOKEN_RECURRENT = "c_token_recurrent"


class ProfileMismatch(HCacheError):
    """A profile measured for another model, on another machine, or by an older procedure."""


def model_shape_key(spec: ModelSpec) -> str:
    """Costs depend on a model's shape and dtype, not its weights: random-weight models share profiles."""
    return hashlib.blake2b(spec.to_json().encode(), digest_size=8).hexdigest()


def default_profile_path(model_name: str, root: str | Path | None = None) -> Path:
    """``<root>/<machine>-<model>.json``; by default in the per-machine cache, ``$HCACHE_HOME/profiles``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(model_name).name).lower()
    return Path(root if root is not None else cache_home() / "profiles") / f"{machine_name()}-{safe}.json"


def profile_command(model_name: str, spec: ModelSpec) -> str:
    """The command that measures a profile of this model here, into the cache ``plan="auto"`` reads."""
    return f"hcache profile --model {model_name} --dtype {spec.dtype}"


@dataclass
class Profile:
    model_name: str
    model_shape: str  # model_shape_key of the profiled model
    model: dict  # ModelSpec.describe(), for people reading the file
    machine_name: str
    machine: dict  # machine_facts()
    tokens: list[int]  # the history lengths measured
    seconds: dict[str, list[float]]  # cost name -> seconds per layer at each of ``tokens``
    bandwidth: dict[str, float] = field(default_factory=dict)  # measured bytes/s, for people reading the file
    version: int = PROFILE_VERSION
    hcache_version: str = ""
    command: str = ""  # how it was measured, for people reading the file
    tensor_parallel: int = 1  # the TP degree: costs are one rank's, and ``model`` describes its shard

    def costs(self, history: int, io_scale: dict[str, float] | None = None) -> LayerCosts:
        """The costs at ``history`` tokens; for the formats in ``io_scale`` (stored in 8 bits: their stored
        bytes over the lossless ones), I/O scaled to the bytes stored and the 8-bit compute costs."""
        names = [name for name in (*COST_NAMES, *TP_COST_NAMES) if name in self.seconds]
        costs = {name: _interp(history, self.tokens, self.seconds[name]) for name in names}
        for fmt, scale in (io_scale or {}).items():
            encoded = f"c_{fmt.lower()}8"
            if encoded in self.seconds:
                costs[f"c_{fmt.lower()}"] = _interp(history, self.tokens, self.seconds[encoded])
            costs[f"io_{fmt.lower()}"] *= scale
        return LayerCosts(**costs)

    def recurrent_forward(self, history: int) -> float:
        """A recurrent layer's forward over ``history`` tokens (its RE), for a profile of a hybrid."""
        return _interp(history, self.tokens, self.seconds[C_TOKEN_RECURRENT])

    def plan(
        self,
        spec: ModelSpec,
        history: int,
        encodings: dict[str, torch.dtype] | None = None,
        allow_h: bool = True,
        allow_kv: bool = True,
        allow_re: bool = True,
        window: WindowRule | None = None,
        states: StateRule | None = None,
    ) -> RestorePlan:
        """``spec``: the model, or with TP the rank's shard (whose hidden states it stores 1/TP of).
        ``encodings``: the formats stored in 8 bits (``stored_dtype``), whose real bytes and dequantisation
        cost the partition then weighs. ``allow_h=False``: the best RE+KV plan; ``allow_kv=False``: the
        best RE+H plan; ``allow_re=False``: the best H+KV plan. ``window``: the window rule the restore
        follows (by default the spec's windows'); ``states``: where recurrent layers keep their state (by
        default every chunk), which weighs their stored bytes."""
        costs, bytes_h, bytes_kv = self._stored_costs(spec, history, encodings, window, states)
        return partition(costs, spec.num_layers, bytes_h, bytes_kv, allow_h, allow_kv, allow_re)

    def bound_seconds(self, spec: ModelSpec, history: int, encodings: dict[str, torch.dtype] | None = None) -> float:
        """The restore time the profile predicts for the best plan: the lower bound a pipelined executor
        can approach."""
        plan = self.plan(spec, history, encodings)
        return plan_seconds(self._stored_costs(spec, history, encodings)[0], plan)

    def _stored_costs(
        self,
        spec: ModelSpec,
        history: int,
        encodings: dict[str, torch.dtype] | None,
        window: WindowRule | None = None,
        states: StateRule | None = None,
    ) -> tuple[list[LayerCosts], list[float], list[float]]:
        """Each layer's costs of restoring ``history`` tokens stored in ``encodings``, and its stored bytes per
        token by H (this rank's share of them) and by KV, as the restore treats its kind (:mod:`hcache.restore.reads`):
        a sliding-window layer restores by H or KV only the tokens it reads (``window``) and recomputes them all;
        a recurrent layer restores by H or KV alike the one state at the prefix's end, the I/O of that many bytes
        at the KV reads' measured rate and no compute past the copy to the device that I/O includes, and recomputes
        by its own forward."""
        encodings = encodings or {}
        stored = {m.value: m.bytes_per_token_layer(spec, encodings.get(m.value)) for m in (Method.H, Method.KV)}
        lossless = {m.value: m.bytes_per_token_layer(spec) for m in (Method.H, Method.KV)}
        scale = {fmt: stored[fmt] / lossless[fmt] for fmt in encodings}
        full = self.costs(history, scale)
        window = window or WindowRule(spec)
        at: dict[int, LayerCosts] = {history: full}
        reads = [window.read_tokens(layer, 0, history) for layer in range(spec.num_layers)]
        for tokens in set(reads) - set(at):
            at[tokens] = dataclasses.replace(self.costs(tokens, scale), c_token=full.c_token)
        layers = [at[tokens] for tokens in reads]
        if spec.recurrent_layers:
            io = self.costs(state_bytes(spec) / lossless[Method.KV.value]).io_kv  # a state is never encoded
            c_token = self.recurrent_forward(history)
            for layer in spec.recurrent_layers:
                layers[layer] = LayerCosts(c_token=c_token, c_h=0.0, c_kv=0.0, io_h=io, io_kv=io)
        every = (states or StateRule(spec)).every
        stored_bytes = {
            m: [m.layer_bytes_per_token(spec, layer, encodings.get(m.value), every) for layer in range(spec.num_layers)]
            for m in (Method.H, Method.KV)
        }
        return layers, [b / self.tensor_parallel for b in stored_bytes[Method.H]], stored_bytes[Method.KV]

    def check(self, spec: ModelSpec, tensor_parallel: int = 1, command: str = "hcache profile --model ...") -> None:
        """Raise :class:`ProfileMismatch` unless this profile fits ``spec`` (with TP, a rank's shard) on this
        machine at this TP degree; the message names ``command`` as the way to a fitting one."""
        if self.tensor_parallel != tensor_parallel:
            raise ProfileMismatch(
                f"profile was measured with tensor parallelism {self.tensor_parallel}, not {tensor_parallel}; "
                f"run `{command}` for this degree"
            )
        if self.version != PROFILE_VERSION:
            raise ProfileMismatch(
                f"profile is stale: measured by procedure v{self.version}, this hcache uses v{PROFILE_VERSION}; "
                f"run `{command}` again"
            )
        if self.model_shape != model_shape_key(spec):
            raise ProfileMismatch(
                f"profile was measured for {_shape(self.model)}, not for this model ({_shape(spec.describe())}); "
                f"run `{command}` for it"
            )
        if spec.recurrent_layers and C_TOKEN_RECURRENT not in self.seconds:
            raise ProfileMismatch(
                "profile was measured before hcache costed a recurrent layer apart from an attention layer; "
                f"run `{command}` again"
            )
        here = machine_name()
        if self.machine_name != here:
            raise ProfileMismatch(
                f"profile was measured on {self.machine_name!r}, this machine is {here!r}; run `{command}` here"
            )

    def save(self, path: str | Path) -> None:
        """Atomically: a server starting meanwhile reads the old file or the new one, never half of one."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(
        cls,
        path: str | Path,
        spec: ModelSpec | None = None,
        tensor_parallel: int = 1,
        command: str = "hcache profile --model ...",
    ) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
            profile = cls(**data)
            expected = set(COST_NAMES) | (set(TP_COST_NAMES) if profile.tensor_parallel > 1 else set())
            if set(profile.seconds) - {*ENCODED_COST_NAMES, C_TOKEN_RECURRENT} != expected or any(
                len(v) != len(profile.tokens) for v in profile.seconds.values()
            ):
                raise ValueError(f"expected costs {sorted(expected)} at each of {len(profile.tokens)} lengths")
        except FileNotFoundError:
            raise ProfileMismatch(f"no profile at {path}; run `{command}` to measure one") from None
        except (OSError, ValueError, TypeError) as exc:
            raise ProfileMismatch(f"{path} is not a valid hcache profile: {exc}") from exc
        if spec is not None:
            profile.check(spec, tensor_parallel, command)
        return profile

    @classmethod
    def new(
        cls,
        model_name: str,
        spec: ModelSpec,
        tokens: list[int],
        seconds: dict,
        bandwidth: dict,
        tensor_parallel: int = 1,
    ) -> "Profile":
        return cls(
            model_name,
            model_shape_key(spec),
            spec.describe(),
            machine_name(),
            machine_facts(),
            list(tokens),
            seconds,
            bandwidth,
            PROFILE_VERSION,
            __version__,
            tensor_parallel=tensor_parallel,
        )


def _shape(desc: dict) -> str:
    keys = ("model_type", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "dtype")
    return " ".join(f"{k}={desc.get(k)}" for k in keys)


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: assume proportional to length
    if x > xs[-1]:  # extrapolate along the last segment
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return max(0.0, ys[-1] + slope * (x - xs[-1]))
    if x < xs[0]:
        return ys[0] * x / xs[0]
    return float(np.interp(x, xs, ys))
