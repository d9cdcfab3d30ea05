"""The hcache runtime: serve prompts, restoring their stored history instead of recomputing it.

For each request: look up the longest stored prefix of the prompt, restore it by a plan (or a forced
method), prefill the rest, generate, and save the new state of the prompt and of the generated tokens.
Like the paper's design, no KV stays on the device between requests: history lives in the store, and
every request restores it.
"""
from __future__ import annotations

import itertools
import logging
import operator
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .engine import ReferenceEngine
from .errors import InvalidRequestError, StorageError
from .fingerprint import model_fingerprint
from .model_loader import DEFAULT_MODEL, LoadedModel, load_model
from .layer_prefetch import DEFAULT_READERS, ReaderPool
from .plan import Method, RestorePlan, default_plan
from .profile import Profile, default_profile_path
from .ragged import Segment
from .restore import restore_prefix
from .storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from .storage.saver import ChunkSaver
from .storage.store_config import StoreConfig

log = logging.getLogger(__name__)

SAVE_POLICIES = ("plan", "all", "none")
AUTO = "auto"


@dataclass
class RequestResult:
    output_ids: list[int]
    prompt_tokens: int
    restored_tokens: int
    plan: str
    ttft_s: float
    bytes_read: int
    fallback: str | None  # why stored state was used only in part, if it was
    restore_s: float = 0.0  # time in the restore (lookup, reads, rebuild), part of ttft_s
    tbt_s: list[float] = field(default_factory=list)  # time between consecutive output tokens


class _SaveCapture:
    """Feeds the engine's per-layer rows to the saver, in the formats chosen for each layer."""

    def __init__(self, saver: ChunkSaver, formats: list[frozenset[str]]):
        self.saver, self.formats = saver, formats

    def begin_batch(self, segments: list[Segment]) -> None:
        self.saver.begin_batch(segments)

    def on_layer(self, layer: int, hidden: torch.Tensor, kv: Callable[[], torch.Tensor]) -> None:
        rows = {}
        if Method.H.value in self.formats[layer]:
            rows[Method.H.value] = hidden
        if Method.KV.value in self.formats[layer]:
            rows[Method.KV.value] = kv()  # [T, 2, n_kv, head]: the stored KV layout
        self.saver.on_layer(layer, rows)

    def end_batch(self) -> None:
        self.saver.end_batch()


class HCacheRuntime:
    """Serve prompts on the reference engine with hcache's restore and save.

    ``plan``: ``None`` for the default, ``"auto"`` for the profile's bubble-free plan at each request's
    history length, a method name, or counts such as ``"2RE+20H+8KV"``. The default is ``"auto"`` when a
    ``profile`` is given (a :class:`Profile` or a path; ``plan="auto"`` alone looks for this machine's
    profile under ``profiles/``), otherwise H for MHA models and KV where KV is no larger.

    ``save``: ``"plan"`` saves the formats the plan restores from (for ``"auto"``, those of every plan it
    picks over the context range), ``"all"`` saves hidden states and KV for every layer (so any plan can
    restore later), ``"none"`` saves nothing.

    ``readers``: threads that read stored layers ahead of the restore's compute; 0 reads each layer
    inline. Call :meth:`close` (or use the runtime as a context manager) to stop them.
    ``store_dir``: one directory or a list (one per SSD). ``store``: quota, TTL, DRAM tier and saver
    options. Saving runs in background threads; :meth:`close` (or leaving a ``with`` block) drains them.
    """

    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        store_dir: str | Path | Sequence[str | Path] = "hcache-store",
        *,
        plan: str | RestorePlan | None = None,
        save: str = "plan",
        namespace: str | None = None,
        num_blocks: int = 256,
        device: str = "cpu",
        store: StoreConfig = StoreConfig(),
        profile: str | Path | Profile | None = None,
        readers: int = DEFAULT_READERS,
    ):
        if save not in SAVE_POLICIES:
            raise InvalidRequestError(f"save must be one of {SAVE_POLICIES}, not {save!r}")
        if readers < 0:
            raise InvalidRequestError(f"readers must be 0 (read inline) or more, not {readers}")
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device)
        self.spec = self.loaded.spec
        self.engine = ReferenceEngine(self.loaded.model, self.spec, num_blocks=num_blocks)
        self.fingerprint = model_fingerprint(self.loaded.model, self.spec)
        self.profile = self._load_profile(profile, plan)
        self.plan = self.resolve_plan(plan)
        self.namespace = namespace
        self.save_formats = self._save_formats(save)
        chunk_bytes = CHUNK_TOKENS * sum(Method(f).bytes_per_token_layer(self.spec) for fs in self.save_formats for f in fs)
        if store.quota_bytes is not None and store.quota_bytes < chunk_bytes:
            raise StorageError(f"quota_bytes={store.quota_bytes} is smaller than one chunk ({chunk_bytes} bytes)")
        self.store = store.open_store(store_dir, {"fingerprint": self.fingerprint, "dtype": self.spec.dtype})
        self.saver = ChunkSaver(self.store, self.fingerprint, threads=store.saver_threads, staging_bytes=store.staging_bytes)
        self.reader_pool = ReaderPool(readers) if readers else None
        self._capture = _SaveCapture(self.saver, self.save_formats) if any(self.save_formats) else None
        self._uids = itertools.count()
        eos = getattr(getattr(self.loaded.model, "generation_config", None), "eos_token_id", None)
        self.default_stop_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

    def _load_profile(self, profile: str | Path | Profile | None, plan: object) -> Profile | None:
        if isinstance(profile, Profile):
            profile.check(self.spec)
            return profile
        if profile is None and not (isinstance(plan, str) and plan.strip().lower() == AUTO):
            return None
        return Profile.load(profile or default_profile_path(self.spec, self.loaded.name), self.spec)

    def resolve_plan(self, plan: str | RestorePlan | None) -> RestorePlan | None:
        """A fixed plan, or None for the profile's plan per history length."""
        if plan is None:
            return None if self.profile is not None else default_plan(self.spec)
        if isinstance(plan, str) and plan.strip().lower() == AUTO:
            if self.profile is None:
                raise InvalidRequestError("plan 'auto' needs a profile: pass profile=... or run `hcache profile`")
            return None
        if isinstance(plan, RestorePlan):
            if len(plan.layers) != self.spec.num_layers:
                raise InvalidRequestError(f"plan {plan} covers {len(plan.layers)} layers, the model has {self.spec.num_layers}")
            return plan
        return RestorePlan.parse(plan, self.spec.num_layers)

    def plan_for(self, plan: RestorePlan | None, history: int) -> RestorePlan:
        return plan if plan is not None else self.profile.plan(self.spec, history)

    def _save_formats(self, save: str) -> list[frozenset[str]]:
        """Per layer, the formats to save: for the auto plan, every format it restores from at any length."""
        if save == "none":
            return [frozenset()] * self.spec.num_layers
        if save == "all":
            return [frozenset((Method.H.value, Method.KV.value))] * self.spec.num_layers
        lengths = [0]
        if self.plan is None:
            lengths = sorted({*self.profile.tokens, *_powers_of_two(CHUNK_TOKENS, self.spec.max_positions)})
        formats = [set() for _ in range(self.spec.num_layers)]
        for length in lengths:
            for layer, m in enumerate(self.plan_for(self.plan, length).layers):
                formats[layer] |= {m.stored_format} - {None}
        return [frozenset(f) for f in formats]

    def close(self) -> None:
        """Wait for the saver to publish everything captured, and stop the saver and reader threads. The
        runtime serves no more requests after this."""
        self.saver.shutdown()
        if self.reader_pool is not None:
            self.reader_pool.close()
            self.reader_pool = None

    def __enter__(self) -> "HCacheRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def drop_device_cache(self) -> None:
        """Free every sequence's device KV; the next request must restore from the store."""
        self.engine.flush_all()

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
        """Greedy generation for a batch of prompts. ``restore=False`` ignores stored state (full recompute)."""
        prompts = [self._validate(prompt, max_new_tokens) for prompt in prompts]
        plan = self.plan if plan is None else self.resolve_plan(plan)
        stops = self.default_stop_ids if stop_token_ids is None else frozenset(stop_token_ids)
        root = root_key(self.fingerprint, namespace if namespace is not None else self.namespace)
        uids = [next(self._uids) for _ in prompts]
        start = time.perf_counter()
        try:
            restored, plans, restore_s = [], [], []
            for uid, prompt in zip(uids, prompts):
                restore_start = time.perf_counter()
                # The last prompt token is always prefilled: its logits give the first output token.
                keys = chunk_keys(prompt[:-1], root) if restore else []
                # Only the auto plan depends on how much is stored; a fixed plan spares the lookups.
                request_plan = plan if plan is not None else self.plan_for(None, self._stored_prefix(keys))
                outcome = restore_prefix(
                    self.engine, self.store, uid, prompt, keys, self.fingerprint, request_plan, self.reader_pool
                )
                restore_s.append(time.perf_counter() - restore_start)
                restored.append(outcome)
                plans.append(request_plan)
                if self._capture is not None:
                    n_chunks = outcome.tokens // CHUNK_TOKENS
                    self.saver.open(uid, keys[n_chunks - 1] if n_chunks else root)
            requests = [(uid, prompt[r.tokens :]) for uid, prompt, r in zip(uids, prompts, restored)]
            outputs, ttft, tbt = self._decode(requests, max_new_tokens, stops, start)
        finally:
            for uid in uids:
                self.saver.close(uid)
                self.engine.flush(uid)
        return [
            RequestResult(out, len(prompt), r.tokens, str(p), ttft, r.bytes_read, r.fallback, rs, gaps)
            for out, prompt, r, p, rs, gaps in zip(outputs, prompts, restored, plans, restore_s, tbt)
        ]

    def _stored_prefix(self, keys: list[str]) -> int:
        """Tokens covered by the leading chunks present in the store: the history a plan is chosen for."""
        n = 0
        while n < len(keys) and self.store.contains(keys[n]):
            n += 1
        return n * CHUNK_TOKENS

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
            for uid, tokens in (requests[i] for i in active):
                if self._capture is not None:
                    self.saver.add_tokens(uid, tokens)
            logits = self.engine.step([requests[i] for i in active], self._capture)
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
        if not prompt:
            raise InvalidRequestError("empty prompt: at least one token id is needed")
        if max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        ids, bad = [], []
        for t in prompt:
            try:
                ids.append(operator.index(t))
            except TypeError:
                bad.append(t)
        bad += [t for t in ids if not 0 <= t < self.spec.vocab_size]
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


def _powers_of_two(start: int, stop: int) -> list[int]:
    return [start << i for i in range(max(1, stop // start).bit_length())]
