"""The hcache runtime: serve prompts, restoring their stored history instead of recomputing it.

For each request: look up the longest stored prefix of the prompt, restore it by a plan (or a forced
method), prefill the rest, generate, and save the new state of the prompt and of the generated tokens.
Like the paper's design, by default no KV stays on the device between requests: history lives in the
store, and every request restores it. With ``gpu_cache=True`` finished requests' KV stays in spare blocks
of the engine's cache, and a returning prefix is copied from there (:mod:`hcache.serving.gpu_prefix_cache`).
"""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import HCacheConfig
from ..engine.reference import ReferenceEngine
from ..errors import InvalidRequestError
from ..model.fingerprint import model_fingerprint
from ..model.loader import DEFAULT_MODEL, LoadedModel, load_model
from ..model.tensor_parallel import SINGLE, TPGroup, shard_model
from ..planning.plan import RestorePlan
from ..resolve import resolve
from .engine import ServingEngine
from ..restore.records import SequenceRecord
from .factory import serving_engine


@dataclass
class RequestResult(SequenceRecord):
    """A request's reply and timings, beside what its sequence cost (the fields of :class:`SequenceRecord`)."""

    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    tbt_s: list[float] = field(default_factory=list)  # time between consecutive output tokens


class HCacheRuntime:
    """Serve prompts on the reference engine with hcache's restore and save: a greedy decode loop over a
    :class:`~hcache.serving.engine.ServingEngine`. The keyword arguments are settings of
    :class:`~hcache.config.HCacheConfig` (``plan``, ``save``, ``profile``, ``store``, ``readers``...),
    checked before the model loads and resolved once for the model here. ``store_dir``: one directory or
    a list (one per SSD); ``None``: no local disk (then ``store.shared`` must name a shared store).
    ``measure_profile=False``: with ``plan="auto"`` and no profile for this machine, serve the default plan
    instead of measuring a short profile on first use. ``gpu_cache``: keep finished requests' KV in the
    spare blocks of the engine's ``num_blocks``. Saving runs in background threads; :meth:`close` (or
    leaving a ``with`` block) drains them. Counters: ``metrics`` (:mod:`hcache.serving.metrics`).

    ``tensor_parallel``: this process's rank of a tensor-parallel group; the model is sharded in place for
    it, and every rank must make the same calls at once (the forward and restore are collective).
    """

    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        store_dir: str | Path | Sequence[str | Path] | None = "hcache-store",
        *,
        device: str = "cpu",
        tensor_parallel: TPGroup = SINGLE,
        **settings,
    ):
        settings = HCacheConfig.of(store_dirs=store_dir, device=device, **settings)
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device)
        fingerprint = model_fingerprint(self.loaded.model, self.loaded.spec)  # of the whole model, on every rank
        model_shard, self.spec = shard_model(self.loaded.model, self.loaded.spec, tensor_parallel)
        config = resolve(
            settings,
            self.spec,
            self.loaded.name,
            tensor_parallel=tensor_parallel.world_size,
            measure=lambda: self.loaded,
            engine="reference",
        )
        self.engine = ReferenceEngine(model_shard, self.spec, num_blocks=settings.num_blocks)
        self.serving: ServingEngine = serving_engine(
            config, self.engine, fingerprint, tensor_parallel
        )  # after the self-check
        self.config, self.stack = self.serving.config, self.serving.stack
        self.metrics = self.serving.metrics
        self._uids = itertools.count()
        self._busy = threading.Lock()  # held by the generate call in progress
        eos = getattr(getattr(self.loaded.model, "generation_config", None), "eos_token_id", None)
        self.default_stop_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

    # The stack and the resolved config own these; the runtime only shows them.
    store = property(lambda self: self.stack.store, doc="The host tier over the stores (None: no store).")
    saver = property(lambda self: self.stack.saver)
    gpu_cache = property(lambda self: self.stack.gpu_cache)
    fingerprint = property(lambda self: self.stack.fingerprint, doc="The fingerprint this rank's chunks carry.")
    plan = property(lambda self: self.config.plan, doc="The fixed plan, or None for the profile's per history length.")
    profile = property(lambda self: self.config.profile)
    save_formats = property(lambda self: list(self.config.save_formats))

    def resolve_plan(self, plan: str | RestorePlan | None) -> RestorePlan | None:
        """A request's plan: a fixed plan, or None for the profile's plan per history length."""
        return self.config.policy.request_plan(plan)

    def close(self) -> None:
        """Wait for the saver to publish everything captured, and stop the saver and reader threads. The
        runtime serves no more requests after this."""
        self.stack.close()

    def __enter__(self) -> "HCacheRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def drop_device_cache(self) -> None:
        """Free every sequence's device KV and the GPU prefix cache; the next request must restore from the store."""
        self.engine.flush_all()
        if self.gpu_cache is not None:
            self.gpu_cache.clear()

    def prefetch(self, prompt: list[int], namespace: str | None = None) -> int:
        """Look-ahead for a request that waits to run: start reading its stored chunks into the host pool
        while other requests run; how many loads started."""
        return self.serving.prefetch(self._validate(prompt, 0), namespace)

    def generate(self, prompt: list[int], max_new_tokens: int = 32, **kwargs) -> RequestResult:
        return self.generate_batch([prompt], max_new_tokens, **kwargs)[0]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 32,
        *,
        plan: str | RestorePlan | None = None,
        restore: bool = True,
        namespace: str | None = None,
        stop_token_ids: set[int] | frozenset[int] | None = None,
    ) -> list[RequestResult]:
        """Greedy generation for a batch of prompts. ``restore=False`` ignores stored state (full recompute).

        One call at a time: a call made while another is running on this runtime (from another thread) raises
        :class:`~hcache.errors.InvalidRequestError` at once, touching nothing. The engine's KV cache, the
        key chains and the saver belong to one request loop; to serve concurrent clients, batch their
        prompts into one call, or serve through :mod:`hcache.mii`, whose loop batches them."""
        if not self._busy.acquire(blocking=False):
            raise InvalidRequestError(
                "this HCacheRuntime is already serving a generate() call from another thread; a runtime serves "
                "one call at a time (batch the prompts into one generate_batch call, or serve with hcache.mii)"
            )
        try:
            return self._generate_batch(prompts, max_new_tokens, plan, restore, namespace, stop_token_ids)
        finally:
            self._busy.release()

    def _generate_batch(self, prompts, max_new_tokens, plan, restore, namespace, stop_token_ids) -> list[RequestResult]:
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts is a list of prompts, not {type(prompts).__name__}")
        given, max_new_tokens = max_new_tokens, _integer(max_new_tokens)
        if max_new_tokens is None or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer of at least 1, not {given!r}")
        prompts = [self._validate(prompt, max_new_tokens) for prompt in prompts]
        plan = self.resolve_plan(plan) if plan is not None else None
        if not isinstance(restore, bool):
            raise InvalidRequestError(f"restore is True or False, not {restore!r:.80}")
        stops = self.default_stop_ids if stop_token_ids is None else _token_set(stop_token_ids)
        uids = [next(self._uids) for _ in prompts]
        start = time.perf_counter()
        try:
            for uid in uids:
                self.serving.open(uid, plan=plan, restore=restore, namespace=namespace)
            outputs, ttft, tbt = self._decode(list(zip(uids, prompts)), max_new_tokens, stops, start)
            records = [self.serving.record(uid) for uid in uids]
        finally:
            for uid in uids:
                self.serving.flush(uid)
        return [
            RequestResult(output_ids=out, prompt_tokens=len(prompt), ttft_s=ttft, tbt_s=gaps, **vars(r))
            for out, prompt, r, gaps in zip(outputs, prompts, records, tbt)
        ]

    def _decode(
        self, requests: list[tuple[int, list[int]]], max_new_tokens: int, stops: frozenset[int], start: float
    ) -> tuple[list[list[int]], float, list[list[float]]]:
        """Prefill then decode greedily: each request's output ids, the time from ``start`` to the first token,
        and each request's times between consecutive tokens."""
        outputs: list[list[int]] = [[] for _ in requests]
        gaps: list[list[float]] = [[] for _ in requests]
        active = list(range(len(requests)))
        ttft, last = None, start
        while active:
            uids, tokens = zip(*(requests[i] for i in active))
            logits = self.serving.put(uids, tokens)
            next_ids = logits.argmax(dim=-1).tolist()
            now = time.perf_counter()
            if ttft is not None:
                for i in active:
                    gaps[i].append(now - last)
            ttft = now - start if ttft is None else ttft
            last = now
            still = []
            for i, tok in zip(active, next_ids):
                outputs[i].append(tok)
                if tok not in stops and len(outputs[i]) < max_new_tokens:
                    requests[i] = (requests[i][0], [tok])
                    still.append(i)
            active = still
        return outputs, ttft, gaps

    def _validate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """The prompt as plain ints, or a clear error before anything is touched."""
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                f"a prompt is a list of token ids, not {type(prompt).__name__} (a tensor or array: pass .tolist())"
            )
        if not prompt:
            raise InvalidRequestError("empty prompt: at least one token id is needed")
        ids = [_integer(t) for t in prompt]
        not_ints = [t for t, i in zip(prompt, ids) if i is None]
        if not_ints:
            raise InvalidRequestError(f"{len(not_ints)} token id(s) are not integers, e.g. {not_ints[0]!r}")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{len(bad)} token id(s) outside the vocabulary [0, {self.spec.vocab_size}), e.g. {bad[0]!r}"
            )
        if len(prompt) + max_new_tokens > self.spec.max_positions:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens plus max_new_tokens={max_new_tokens} exceeds the context "
                f"limit of {self.spec.max_positions}"
            )
        return ids


def _token_set(ids: object) -> frozenset[int]:
    """``stop_token_ids`` as a set of ints, or a clear error."""
    if not isinstance(ids, (set, frozenset, list, tuple)):
        raise InvalidRequestError(f"stop_token_ids is a set of token ids, not {type(ids).__name__}")
    ints = [_integer(t) for t in ids]
    if any(i is None or i < 0 for i in ints):
        raise InvalidRequestError(
            f"stop_token_ids holds token ids (integers of at least 0), not {sorted(ids, key=repr)!r:.80}"
        )
    return frozenset(ints)


def _integer(value: object) -> int | None:
    """``value`` as an int if it is an integer (a Python or numpy int, or a 0-d integer tensor) and not a bool."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
