"""The start-up self-check, and the rule by which a restore is judged against recompute.

Before an engine serves (:func:`~hcache.serving.factory.serving_engine`), :func:`self_check` saves a short
random history on it into a throwaway store (a temporary directory, removed after), restores it by each
stored method the plan may use (:func:`~hcache.resolve.self_check_methods`), and compares each restored cache and next token with
the engine's own recompute of the same tokens, by the rule ``hcache check`` uses (:func:`layer_excess`,
:class:`Comparison`). A method that fails is disabled for the process
(:func:`~hcache.resolve.disable_methods`): one warning says why, and the metric
``hcache_self_check_disabled{method}`` is 1. ``self_check="strict"`` refuses to start instead
(:class:`SelfCheckFailed`), and ``"off"`` skips the check. RE is not checked: it is the engine's own
forward, the recompute the others are compared with.

The rule per engine: on the reference engine every layer's K and V within float rounding of the forward's
(1e-5 in float32, two ulps of the value in half precision: the projection GEMM may block rows differently);
on FastGen, RE and KV layers bit for bit, H's V bit for bit and H's K within the bound of FastGen's
fast-math RoPE (:mod:`hcache.ops.rope_bound`); a recurrent layer's state (kept in float32 whatever the
model's dtype, never encoded) within 1e-5 of the forward's, absolute and relative; and the greedy next token
equal. State stored in 8 bits
(``stored_dtype``) is lossy: each layer's K and V within a relative RMS error of :data:`LOSSY_BOUND` of the
forward's (a recurrent layer's state too, which went on over tokens computed from lossy K/V), the restore
reported lossy, and its tokens may differ.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from dataclasses import dataclass

import torch

from ..config import HCacheConfig, ResolvedConfig
from ..engine.interface import Engine
from ..errors import HCacheError
from ..model.spec import ModelSpec
from ..model.tensor_parallel import SINGLE, TPGroup
from ..ops.rope_bound import rope_bound
from ..planning.plan import Method, RestorePlan
from ..resolve import disable_methods, resolve, self_check_methods
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.store_config import StoreConfig
from .engine import ServingEngine
from .store_stack import StoreStack

log = logging.getLogger(__name__)

LOSSY_BOUND = 0.05  # fp8 H restores K and V within about 0.025, int8 KV within 0.01
HISTORY_TOKENS = CHUNK_TOKENS + 1  # a chunk restored; the last token prefilled after it gives the next token
KV = tuple[torch.Tensor, torch.Tensor]


class SelfCheckFailed(HCacheError):
    """``self_check="strict"`` and a restore method the plan may use does not match recompute here."""


@dataclass(frozen=True)
class Comparison:
    """One restored sequence against the engine's recompute of the same tokens."""

    restored_tokens: int
    expected_tokens: int
    fallback: str | None  # why the restore used stored state only in part
    tokens_equal: bool  # the greedy tokens after the restore are the recompute's
    lossy: bool  # the restore said it read state stored in 8 bits
    stored_lossy: bool  # it was stored so
    errors: tuple[float, ...]  # per layer, how far past its bound K/V lie (<= 0 within it)

    @property
    def worst_excess(self) -> float:
        return max(self.errors)

    @property
    def ok(self) -> bool:
        return (
            self.restored_tokens == self.expected_tokens
            and (self.tokens_equal or self.stored_lossy)
            and self.lossy == self.stored_lossy
            and self.worst_excess <= 0
        )

    def why(self) -> str:
        """What is wrong, for a log line ("" when :attr:`ok`)."""
        if self.restored_tokens != self.expected_tokens:
            return f"restored {self.restored_tokens} of {self.expected_tokens} tokens ({self.fallback or 'no fallback given'})"
        if self.worst_excess > 0:
            layer = self.errors.index(self.worst_excess)
            return f"layer {layer}'s K/V lie {self.worst_excess:.3g} past their bound"
        if self.lossy != self.stored_lossy:
            return f"the restore {'said' if self.lossy else 'did not say'} it was lossy"
        return "" if self.ok else "the next token differs from recompute's"


def layer_state(engine: Engine, uid: int, layer: int, n: int) -> KV | torch.Tensor:
    """What a restore writes of a layer of sequence ``uid``: its first ``n`` positions' K/V, or a recurrent
    layer's state (as a chunk stores it)."""
    return engine.state(uid, layer) if engine.spec.is_recurrent(layer) else engine.kv(uid, layer, n)


def layer_excess(
    kind: str,
    method: Method | str,
    got: KV | torch.Tensor,
    want: KV | torch.Tensor,
    spec: ModelSpec,
    lossy: bool = False,
) -> float:
    """How far past its bound one layer's restored K/V or state (``got``, :func:`layer_state`) lie from the
    forward's (``want``), by the rule of the module doc: <= 0 within it, inf where it must be bit for bit and
    is not."""
    pairs = [(got.cpu(), want.cpu())] if isinstance(got, torch.Tensor) else list(zip(got, want))
    pairs = [(g.cpu().float(), w.cpu().float()) for g, w in pairs]
    if lossy:
        return max(((g - w).norm() / w.norm()).item() - LOSSY_BOUND for g, w in pairs)
    if isinstance(got, torch.Tensor):  # a recurrent layer's state
        return max(((g - w).abs() - 1e-5 * (1 + w.abs())).max().item() for g, w in pairs)
    (k, v), (want_k, want_v) = (tuple(t.cpu() for t in pair) for pair in (got, want))
    if kind == "fastgen":
        if not torch.equal(v, want_v) or (Method(method) is not Method.H and not torch.equal(k, want_k)):
            return math.inf
        if Method(method) is not Method.H:
            return 0.0
        return (
            ((k.float() - want_k.float()).abs() - rope_bound(want_k, torch.arange(len(k)), spec.rope.rotary_dim))
            .max()
            .item()
        )
    tolerance = (
        (lambda want: 1e-5)
        if spec.dtype == "float32"
        else (lambda want: 2 * torch.finfo(want.dtype).eps * want.float().abs())
    )
    return max(((g.float() - w.float()).abs() - tolerance(w)).max().item() for g, w in ((k, want_k), (v, want_v)))


def self_check(config: ResolvedConfig, engine: Engine, fingerprint: str, tp: TPGroup = SINGLE) -> ResolvedConfig:
    """``config`` once each method its plan may use has been checked on ``engine`` (see the module doc)."""
    mode = config.settings.self_check
    methods = sorted(self_check_methods(config)) if config.stored and mode != "off" else []
    if not methods:
        return config
    start = time.perf_counter()
    results = _compare(config, engine, fingerprint, tp, methods)
    ok = {m: bool(tp.min(int(c.ok))) for m, c in results.items()}  # every rank disables alike
    failed = {m: results[m].why() or "it failed on another tensor-parallel rank" for m in methods if not ok[m]}
    if failed and mode == "strict":
        raise SelfCheckFailed(
            "hcache self-check: "
            + "; ".join(
                f"restores by {m.value} do not match recompute on this engine ({why})" for m, why in failed.items()
            )
            + "; refusing to start (self_check='on' would serve without them, 'off' skips the check)"
        )
    checked = disable_methods(config, failed, [m for m in methods if ok[m]])
    for m, why in failed.items():
        log.warning(
            "hcache self-check: restores by %s do not match recompute on this engine (%s); %s is disabled for this "
            "process, plan now %s",
            m.value,
            why,
            m.value,
            checked.plan or "the profile's without it",
        )
    log.info(
        "hcache self-check: %s checked against recompute in %.2f s",
        "+".join(m.value for m in methods),
        time.perf_counter() - start,
    )
    return checked


def _compare(
    config: ResolvedConfig, engine: Engine, fingerprint: str, tp: TPGroup, methods: list[Method]
) -> dict[Method, Comparison]:
    """Save :data:`HISTORY_TOKENS` random tokens (a hybrid's: up to its first state, and one) on ``engine`` into a throwaway store, keep the cache the
    forward built, and restore the history by each method in turn."""
    spec, kind, lossy = engine.spec, config.engine, config.encodings
    # A hybrid's restore ends where its recurrent layers' state is kept: at the first chunk that keeps one.
    history = config.settings.state_every * CHUNK_TOKENS + 1 if spec.recurrent_layers else HISTORY_TOKENS
    tokens = torch.randint(0, spec.vocab_size, (history,), generator=torch.Generator().manual_seed(0)).tolist()
    n = (history - 1) // CHUNK_TOKENS * CHUNK_TOKENS
    chunk_bytes = CHUNK_TOKENS * spec.num_layers * sum(m.bytes_per_token_layer(spec) for m in (Method.H, Method.KV))
    results = {}
    with tempfile.TemporaryDirectory(prefix="hcache-self-check-") as tmp:
        # its own store, saving every format, with none of the served store's tiers, logs, metrics or events
        settings = HCacheConfig.of(
            config.settings,
            store_dirs=[tmp],
            save="all",
            plan=None,
            profile=None,
            readers=0,
            gpu_cache=False,
            namespace=None,
            request_log=None,
            metrics_port=None,
            kv_events=None,
            store=StoreConfig(host_bytes=8 * chunk_bytes, direct_io=False, fsync=False, writers=1),
        )
        check = resolve(settings, config.spec, config.model_name, tensor_parallel=config.tensor_parallel, engine=kind)
        with ServingEngine(engine, StoreStack(check, engine, fingerprint, tp)) as serving:
            serving.open(0, restore=False)
            want_token = int(serving.put([0], [tokens])[0].argmax())
            want = [_clone(layer_state(engine, 0, layer, n)) for layer in range(spec.num_layers)]
            serving.flush(0)  # its chunks are published
            for uid, method in enumerate(methods, 1):
                serving.open(uid, plan=RestorePlan.uniform(spec.num_layers, method))
                try:
                    token = int(serving.put([uid], [tokens])[0].argmax())
                    record = serving.record(uid)
                    stored_lossy = method.value in lossy
                    errors = tuple(
                        layer_excess(kind, method, layer_state(engine, uid, layer, n), want[layer], spec, stored_lossy)
                        for layer in range(spec.num_layers)
                    )
                    results[method] = Comparison(
                        record.restored_tokens,
                        n,
                        record.fallback,
                        token == want_token,
                        record.lossy,
                        stored_lossy,
                        errors,
                    )
                except Exception as exc:  # a restore that raises fails its method
                    results[method] = Comparison(0, n, f"{type(exc).__name__}: {exc}", False, False, False, (math.inf,))
                finally:
                    serving.flush(uid)
    return results


def _clone(state: KV | torch.Tensor) -> KV | torch.Tensor:
    return state.clone() if isinstance(state, torch.Tensor) else tuple(t.clone() for t in state)
