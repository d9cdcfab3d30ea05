"""The store stack: everything that holds or moves one engine's stored state, built once from a
:class:`~hcache.config.ResolvedConfig`.

The host tier (the host pool over the local and shared stores), the saver and the capture that feeds it,
the copier, the prefetcher and the GPU prefix cache are built here and nowhere else, and handed to whoever
serves: :class:`~hcache.serving.engine.ServingEngine` only uses them, and another engine adapter can use
the same stack without it. ``enabled=False`` builds the stack with no store (the recompute baseline); a
GPU prefix cache needs no store. The host pool and the GPU prefix cache evict by the ``eviction`` setting,
valuing each chunk at what recomputing it would cost (:func:`recompute_cost`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..config import ResolvedConfig
from ..engine.interface import Engine
from ..engine.ragged import Segment
from ..model.tensor_parallel import SINGLE, TPGroup
from ..planning.plan import Method, row_shapes
from ..storage.anchor_log import ANCHORS_FILE, AnchorLog
from ..storage.chunk import ChunkLayout
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.host_tier import HostTier
from ..storage.prefetch import Prefetcher
from ..storage.stored_state import (
    STATE,
    STATE_DTYPE,
    Encodings,
    TensorSpec,
    base_format,
    encode_rows,
    stored_names,
    stored_tensors,
    stores,
)
from ..transfer.copier import Copier
from ..transfer.saver import ChunkSaver
from .gpu_prefix_cache import GpuPrefixCache


def recompute_cost(config: ResolvedConfig) -> Callable[[int, int], float]:
    """``cost(start, tokens)``: what recomputing ``tokens`` tokens from position ``start`` takes, the value of
    keeping their state (cost-aware eviction). A later chunk costs more: it attends to a longer context.
    With a profile, seconds: each layer's growth of its forward over a history (``c_token``, or a hybrid's
    recurrent layers' ``c_token_recurrent``, interpolated by :class:`Profile`) over the tokens. Without one,
    forward FLOPs (only their ratios matter): per token and layer ``24·D²`` for the weights (12·D² parameters a
    layer, Kaplan et al. 2020) and, in an attention layer, ``4·D`` per token it attends to (a recurrent layer
    carries a state of fixed size instead)."""
    profile, spec = config.profile, config.spec
    recurrent = len(spec.recurrent_layers or ())
    attention = spec.num_layers - recurrent
    if profile is not None:

        def seconds(start: int, tokens: int) -> float:
            def grown(forward: Callable[[int], float]) -> float:
                return max(forward(start + tokens) - forward(start), 0.0)

            total = attention * grown(lambda n: profile.costs(n).c_token)
            return total + recurrent * grown(profile.recurrent_forward) if recurrent else total

        return seconds
    d = spec.hidden_size

    def flops(start: int, tokens: int) -> float:
        attended = (
            tokens * start + tokens * (tokens + 1) / 2
        )  # causal: token ``start + i`` attends to ``start + i + 1``
        return spec.num_layers * 24.0 * d * d * tokens + attention * 4.0 * d * attended

    return flops


class SaveCapture:
    """The engine's per-layer rows to the saver, in the formats saved for each layer, encoded on the rows'
    device (:func:`~hcache.storage.stored_state.encode_rows`). An engine that keeps every K/V row of a
    running sequence (vLLM's paged cache) gives ``read_kv`` instead of handing K/V over by layer."""

    def __init__(self, saver: ChunkSaver, formats: list[frozenset[str]], encodings: Encodings):
        self.saver, self.formats, self.encodings = saver, formats, encodings
        self.kv_layers = [layer for layer, saved in enumerate(formats) if Method.KV.value in saved]
        self._kv_names = stored_names(Method.KV.value, encodings)
        self._read_kv: Callable[[list[Segment], list[int]], torch.Tensor] | None = None

    def begin_batch(
        self, segments: list[Segment], read_kv: Callable[[list[Segment], list[int]], torch.Tensor] | None = None
    ) -> None:
        """``read_kv(segments, layers)``: the K/V rows of ``segments`` of ``layers``, ``[layers, T, 2, n_kv,
        head]``, which the engine still holds when this batch ends: then K/V are read once a chunk fills, not
        handed over by layer."""
        self._read_kv = read_kv if self.kv_layers else None
        self.saver.begin_batch(segments, later=self._kv_names if self._read_kv is not None else ())

    def on_layer(self, layer: int, hidden: torch.Tensor | None, kv: Callable[[], torch.Tensor] | None) -> None:
        """``hidden``: the layer's input rows, where it saves H; ``kv()``: its K/V rows, unless ``read_kv`` reads them."""
        rows = {}
        if Method.H.value in self.formats[layer]:
            rows[Method.H.value] = hidden
        if Method.KV.value in self.formats[layer] and self._read_kv is None:
            rows[Method.KV.value] = kv()  # [T, 2, n_kv, head]: the stored KV layout
        encoded = encode_rows(rows, self.encodings)
        self.saver.on_layer(
            layer, encoded, keep=[fmt for fmt, t in encoded.items() if t is not hidden]
        )  # all made here but the engine's hidden

    def on_state(self, layer: int, uid: int, chunk: int, rows: torch.Tensor) -> None:
        """A recurrent layer's state at a chunk's end, kept in the chunk where it saves anything of the layer."""
        if self.formats[layer]:
            self.saver.keep_state(uid, chunk, layer, rows)

    def end_batch(self) -> None:
        try:
            self.saver.end_batch(self._read if self._read_kv is not None else None)
        finally:
            self._read_kv = None

    def _read(self, segments: list[Segment]) -> dict[str, torch.Tensor]:
        return encode_rows({Method.KV.value: self._read_kv(segments, self.kv_layers)}, self.encodings)


class StoreStack:
    """One engine's store stack (one rank's, with tensor parallelism: ``tp``). ``fingerprint``: the whole
    model's; the stack's, which its chunks carry and its keys are rooted in, is this rank's.

    Parts that the settings leave out are None: ``store``, ``saver``, ``copier``, ``prefetcher`` and
    ``anchors`` (which roots conversations were saved under, for miss reasons) without a store, ``capture`` when nothing is saved, ``gpu_cache`` unless ``gpu_cache=True``.
    ``shareable_pool``: the host pool on memory another process may map (a CPU's load process,
    :mod:`hcache.paged.copy_process`)."""

    def __init__(
        self,
        config: ResolvedConfig,
        engine: Engine,
        fingerprint: str,
        tp: TPGroup = SINGLE,
        shareable_pool: bool = False,
    ):
        config.check_engine(engine.spec)
        self.config, self.tp = config, tp
        self.fingerprint = tp.fingerprint(fingerprint)
        self.store: HostTier | None = None
        self.saver: ChunkSaver | None = None
        self.capture: SaveCapture | None = None
        self.copier: Copier | None = None
        self.prefetcher: Prefetcher | None = None
        self.anchors: AnchorLog | None = None
        self.window = config.window_rule(
            engine.spec, engine.block_size
        )  # which chunks a sliding-window layer saves and restores
        self.states = config.state_rule(engine.spec)  # which chunks keep a recurrent layer's state
        eviction, cost = config.settings.eviction, recompute_cost(config)
        if config.stored:
            spec, formats = engine.spec, list(config.save_formats)
            shapes = row_shapes(spec)
            # A recurrent layer that saves anything saves its state, which stands for every format of it.
            recurrent = [layer for layer, saved in enumerate(formats) if saved and spec.is_recurrent(layer)]
            formats = [frozenset() if spec.is_recurrent(layer) else saved for layer, saved in enumerate(formats)]
            tensors = stored_tensors(shapes, spec.torch_dtype, formats, config.encodings)
            tensors += [TensorSpec(layer, STATE, shapes[STATE], STATE_DTYPE) for layer in recurrent]
            config.store.check(ChunkLayout.plan(tensors, self.fingerprint).nbytes)
            self.copier = Copier(engine.device)
            self.store = config.store.open_store(
                config.store_dirs(tp.rank),
                {"fingerprint": self.fingerprint, "dtype": engine.spec.dtype},
                pin=engine.device.type == "cuda",
                shareable=shareable_pool,
                readers=config.settings.readers,
                eviction=eviction,
            )
            self.saver = ChunkSaver(
                self.store,
                self.fingerprint,
                tensors,
                stores=lambda c, layer, f, end: (
                    self.states.saves(c, end)
                    if f == STATE
                    else stores(tp.rank, tp.world_size, c, base_format(f)) and self.window.saves(layer, c, end)
                ),
                value=lambda chunk: cost(chunk * CHUNK_TOKENS, CHUNK_TOKENS),
            )
            if any(formats) or recurrent:
                saved = [frozenset({STATE}) if layer in recurrent else f for layer, f in enumerate(formats)]
                self.capture = SaveCapture(self.saver, saved, config.encodings)
            self.prefetcher = Prefetcher(self.store)
            dirs = config.store_dirs(tp.rank)
            others = [
                d / ANCHORS_FILE for d in config.other_layouts()
            ]  # to tell a store of another tensor-parallel size
            self.anchors = AnchorLog(Path(dirs[0]) / ANCHORS_FILE if dirs else None, consult=others)
        drop = self.saver.drop_partial if self.saver is not None else (lambda partial: None)
        self.gpu_cache = (
            GpuPrefixCache(engine, drop, eviction=eviction, value=cost) if config.settings.gpu_cache else None
        )

    def close(self) -> None:
        """Drain the saver, write every saved chunk back to its stores and stop the store's threads."""
        if self.saver is not None:
            self.saver.shutdown()
        if self.store is not None:
            self.store.close()
