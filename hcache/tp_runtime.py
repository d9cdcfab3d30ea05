"""One rank of a tensor-parallel hcache runtime, on the reference engine.

Every rank of a :class:`~hcache.tensor_parallel.TPGroup` builds one of these over the same model and
calls :meth:`TensorParallelRuntime.generate` with the same prompt at the same time: the forward, the
restore and the agreement on the restored prefix are collective. Each rank has its own store (its own
key chain and fingerprint), saves only what it owns and reads only what it saved.

This is the minimum a runtime needs for TP, kept apart from :class:`~hcache.runtime.HCacheRuntime` until
that gains a ``tensor_parallel`` argument: shard the model, suffix the fingerprint, pass ``stores`` to the
saver and ``tp`` to :func:`~hcache.restore.restore_prefix`.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .engine import ReferenceEngine
from .errors import InvalidRequestError
from .fingerprint import model_fingerprint
from .layer_prefetch import DEFAULT_READERS, ReaderPool
from .model_loader import LoadedModel
from .plan import Method, RestorePlan
from .restore import restore_prefix
from .runtime import RequestResult, _SaveCapture
from .storage.chunk_key import CHUNK_TOKENS, chunk_keys, root_key
from .storage.saver import ChunkSaver
from .storage.store_config import StoreConfig
from .tensor_parallel import TPGroup, shard_model


class TensorParallelRuntime:
    """``loaded.model`` is sharded in place for ``tp.rank``. ``save``: ``"all"`` (both formats for every
    layer) or ``"plan"`` (the formats ``plan`` restores from). ``readers``: threads that read stored layers
    ahead (0: inline). Generation is greedy."""

    def __init__(
        self,
        loaded: LoadedModel,
        store_dir: str | Path,
        tp: TPGroup,
        *,
        plan: str = "H",
        save: str = "plan",
        num_blocks: int = 64,
        store: StoreConfig = StoreConfig(),
        readers: int = DEFAULT_READERS,
    ):
        if save not in ("all", "plan"):
            raise InvalidRequestError(f"save must be 'all' or 'plan', not {save!r}")
        self.tp = tp
        full_fingerprint = model_fingerprint(loaded.model, loaded.spec)  # before sharding: the same on all ranks
        model, self.spec = shard_model(loaded.model, loaded.spec, tp)
        self.engine = ReferenceEngine(model, self.spec, num_blocks=num_blocks)
        self.fingerprint = tp.fingerprint(full_fingerprint)
        self.plan = RestorePlan.parse(plan, self.spec.num_layers)
        formats = {Method.H.value, Method.KV.value} if save == "all" else None
        self.store = store.open_store(store_dir, {"fingerprint": self.fingerprint, "dtype": self.spec.dtype})
        self.saver = ChunkSaver(self.store, self.fingerprint, threads=store.saver_threads, stores=tp.stores)
        self._capture = _SaveCapture(
            self.saver, [frozenset(formats or {m.stored_format} - {None}) for m in self.plan.layers]
        )
        self.reader_pool = ReaderPool(readers) if readers else None
        self._uid = 0

    def close(self) -> None:
        self.saver.shutdown()
        if self.reader_pool is not None:
            self.reader_pool.close()

    @torch.no_grad()
    def generate(
        self, prompt: list[int], max_new_tokens: int, *, plan: str | None = None, restore: bool = True
    ) -> RequestResult:
        plan_ = self.plan if plan is None else RestorePlan.parse(plan, self.spec.num_layers)
        self._uid += 1
        uid, start = self._uid, time.perf_counter()
        root = root_key(self.fingerprint)
        keys = chunk_keys(prompt[:-1], root) if restore else []  # the last token is prefilled for its logits
        try:
            outcome = restore_prefix(
                self.engine, self.store, uid, prompt, keys, self.fingerprint, plan_, self.reader_pool, self.tp
            )
            restore_s = time.perf_counter() - start
            n_chunks = outcome.tokens // CHUNK_TOKENS
            self.saver.open(uid, keys[n_chunks - 1] if n_chunks else root)
            tokens, output, ttft = prompt[outcome.tokens :], [], 0.0
            while len(output) < max_new_tokens:
                self.saver.add_tokens(uid, tokens)
                tokens = [int(self.engine.step([(uid, tokens)], self._capture)[0].argmax())]
                output.append(tokens[0])
                ttft = ttft or time.perf_counter() - start
        finally:
            self.saver.close(uid)
            self.engine.flush(uid)
        return RequestResult(
            output, len(prompt), outcome.tokens, str(plan_), ttft, outcome.bytes_read, outcome.fallback, restore_s
        )
