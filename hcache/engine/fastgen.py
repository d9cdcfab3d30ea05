"""DeepSpeed-FastGen adapter: hcache's :class:`~hcache.engine.interface.Engine` over an ``InferenceEngineV2``.

FastGen runs the model; this adapter adds what hcache needs around it, without editing DeepSpeed:

- **capture**: during a ``put``, the model's per-layer method, its ``qkv`` and its ``attn`` modules are
  wrapped, so each layer's normalised input (the ``qkv`` GEMM's input: FastGen fuses the input norm into the
  previous layer's end) reaches the capture right after the layer's attention has written K/V, while the
  norm's reused output buffer still holds it. The wrappers exist only for the duration of that ``put``.
- **restore**: blocks come from FastGen's own state manager and descriptors; the K/V GEMM reads the K and V
  rows of FastGen's fused ``qkv_w`` (and ``qkv_b``); RoPE and scatter use :func:`hcache.ops.rotate_and_write`
  with FastGen's RoPE rule (:mod:`hcache.ops.rope`: its kernel's rounding, not transformers') on FastGen's cache tensor, whose per-layer layout ``[num_blocks, block_size, 2, n_kv_heads, head_size]``
  is hcache's. Recompute runs FastGen's own embedding and first layers over a ragged batch built as ``put``
  builds it.

FastGen's kernels are CUDA-only: :func:`build_fastgen_engine` refuses to start without a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import CacheFullError, InvalidRequestError, UnsupportedModelError
from ..model.spec import ModelSpec
from ..ops import KVProjection, device_copy, read_kv, slot_mapping
from ..ops.paged_kv import block_positions, gather_kv
from ..ops.paged_layout import PagedLayout
from ..ops.quant import QuantRows
from ..ops.rope import layer_tables
from .capture import LayerCapture
from .ragged import Segment
from .restore_state import RestoreState

# model_types whose FastGen implementation this adapter has read: dense, rotate-half RoPE, fused [q; k; v].
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2")
# The model_types DeepSpeed 0.19's FastGen implements at all (its engine_factory; tests/engine checks it):
# named in a refusal, so a user knows whether the gap is hcache's adapter or DeepSpeed.
DEEPSPEED_MODEL_TYPES = (
    "exaone4",
    "exaone4_5",
    "falcon",
    "llama",
    "mistral",
    "mixtral",
    "opt",
    "phi",
    "phi3",
    "qwen",
    "qwen2",
    "qwen2_moe",
)
TESTED_DEEPSPEED = (0, 19)  # the adapter wraps FastGen internals: accept 0.19.x only


def check_model_type(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        where = (
            "DeepSpeed's FastGen implements it, but "
            if model_type in DEEPSPEED_MODEL_TYPES
            else (
                f"DeepSpeed 0.19's FastGen has no implementation of it (it implements {', '.join(DEEPSPEED_MODEL_TYPES)}), and "
            )
        )
        raise UnsupportedModelError(
            f"model_type {model_type!r} cannot run on FastGen: {where}hcache's FastGen adapter serves "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}; engine='auto' or 'reference' serves it on the reference engine"
        )


def check_deepspeed_version(version: str) -> None:
    from packaging.version import Version

    if Version(version).release[:2] != TESTED_DEEPSPEED:
        raise RuntimeError(
            f"hcache's FastGen adapter is tested with deepspeed>=0.19,<0.20 (it wraps FastGen's model "
            f"internals); found deepspeed {version}. Install deepspeed==0.19.*"
        )


def check_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "FastGen needs a CUDA GPU (its ragged kernels are CUDA-only) and none is available; "
            "use the reference engine (hcache.engine.reference.ReferenceEngine) on a CPU"
        )


# DeepSpeed's op builders for FastGen's dense models: core GEMM/norm/activation ops, the ragged kernels
# (attention, rotary KV write, embedding, logits gather) and the ragged batch's host buffers. The cutlass
# builder serves only MoE and quantized GEMMs.
FASTGEN_OP_BUILDERS = ("InferenceCoreBuilder", "RaggedOpsBuilder", "RaggedUtilsBuilder")


def build_fastgen_ops() -> list[str]:
    """Compile FastGen's ops once, or load them where DeepSpeed was installed with them prebuilt, so that a
    first request does not wait for the just-in-time build (minutes). Returns the ops' names."""
    import deepspeed
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops import op_builder
    from torch.utils.cpp_extension import CUDA_HOME

    check_deepspeed_version(deepspeed.__version__)
    check_cuda()
    builders = [getattr(op_builder, name)() for name in FASTGEN_OP_BUILDERS]
    to_compile = [b.name for b in builders if not installed_ops.get(b.name, False)]
    if to_compile and CUDA_HOME is None:
        raise RuntimeError(
            f"DeepSpeed has no prebuilt {', '.join(to_compile)} and no CUDA toolkit (nvcc) was found to compile "
            f"them: install the CUDA toolkit matching torch's CUDA {torch.version.cuda} and set CUDA_HOME, or "
            "install DeepSpeed with its ops prebuilt (DS_BUILD_OPS=1)"
        )
    for builder in builders:
        builder.load()
    return [b.name for b in builders]


def build_fastgen_engine(path: str, engine_config: Any = None, **build_kwargs: Any) -> "FastGenEngine":
    """Check the model, deepspeed and the GPU, then ``build_hf_engine(path, engine_config)`` and wrap it.

    ``engine_config``: a ``RaggedInferenceEngineConfig`` or a dict of one (FastGen's defaults if ``None``).
    """
    import deepspeed
    from deepspeed.inference.v2 import RaggedInferenceEngineConfig, build_hf_engine
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    check_model_type(hf_config.model_type)
    check_deepspeed_version(deepspeed.__version__)
    if engine_config is None or isinstance(engine_config, dict):
        engine_config = RaggedInferenceEngineConfig(**(engine_config or {}))
    if engine_config.tensor_parallel.tp_size > 1:
        raise NotImplementedError(
            f"tensor parallel FastGen (tp_size={engine_config.tensor_parallel.tp_size}) is not supported by "
            "this adapter yet; use tp_size=1"
        )
    check_cuda()
    return FastGenEngine(build_hf_engine(path, engine_config, **build_kwargs), hf_config)


def _host_blocks(desc: Any) -> list[int]:
    """A sequence's blocks from its descriptor's host shadow (``all_block_ids()`` is the device copy: reading
    it back would sync). FastGen's dense models have one allocation group."""
    return desc.kv_cache_ids(on_device=False)[0][: desc.cur_allocated_blocks].tolist()


class FastGenEngine:
    """hcache's engine protocol over a DeepSpeed ``InferenceEngineV2`` with tensor parallel degree 1."""

    def __init__(self, engine: Any, hf_config: Any):
        self._engine = engine
        self.config = engine._config
        self._model = engine._model
        self._state = engine._state_manager
        cache = self._state.get_cache(0)
        self.device, self.dtype = cache.device, cache.dtype
        self.block_size = self._model.attn.kv_block_size
        self.spec = ModelSpec.from_config(hf_config, dtype=self.dtype)
        check_model_type(self.spec.model_type)
        self._check_dims(cache)
        # mistral names its per-layer method differently from llama, qwen2 and phi3
        self._layer_method = next(
            n for n in ("_forward_transformer_layer", "_forward_transformer") if hasattr(self._model, n)
        )
        self._kv_proj = [self._layer_kv_projection(i) for i in range(self.spec.num_layers)]
        self._layout = PagedLayout.blocked(cache)  # every layer's cache is shaped alike
        self._restoring: dict[int, RestoreState] = {}
        # Marks the uploads of the ragged batch's pinned host buffers that recompute queued last: those
        # buffers are rewritten by the next batch's finalize (see recompute_layers).
        self._uploaded = torch.cuda.Event() if device_copy.uses_streams(self.device) else None
        self._upload_pending = False

    def _check_dims(self, cache: torch.Tensor) -> None:
        spec, model = self.spec, self._model
        pos = model.positional_embedding_config
        rotary_dim = (pos.rotate_dim or spec.head_size) if pos is not None else None
        ours = (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_size)
        theirs = (model.num_layers, model.model_dim, model.n_heads_q_local, model.n_heads_kv_local, model.head_size)
        if ours != theirs or tuple(cache.shape[2:]) != (2, spec.num_kv_heads, spec.head_size):
            raise UnsupportedModelError(
                f"FastGen's model (layers, hidden, heads, kv heads, head size) = {theirs}, KV cache "
                f"{tuple(cache.shape)}, disagree with the HF config's {ours}"
            )
        rope = spec.rope
        if (
            rope is None
            or rope.rope_type != "default"
            or rope.rotary_dim != rotary_dim
            or rope.theta != float(pos.theta_base)
        ):
            raise UnsupportedModelError(
                f"FastGen rotates {rotary_dim} channels with theta {getattr(pos, 'theta_base', None)}; the HF "
                f"config asks for {rope}: a restore would not match FastGen's forward"
            )

    def _layer_kv_projection(self, layer: int) -> KVProjection:
        params = self._model._transformer[layer]
        q_dim = self.spec.num_heads * self.spec.head_size
        rows = slice(q_dim, q_dim + 2 * self.spec.kv_dim)  # fused qkv_w is [q; k; v] x D (UnfusedQKVParameter)
        bias = getattr(params, "qkv_b", None)
        # our own GEMM, never FastGen's linear modules, whose one output buffer a forward may be using
        return KVProjection(self.spec, params.qkv_w[rows], None if bias is None else bias[rows])

    # ---- FastGen's scheduling interface -------------------------------------------------------------
    @property
    def free_blocks(self) -> torch.Tensor:
        return self._engine.free_blocks

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int) -> tuple[int, int]:
        return self._engine.query(uid, max_request_tokens, max_request_blocks)

    def get_remaining_block_capacity(self, uid: int) -> int:
        return self._engine.get_remaining_block_capacity(uid)

    def flush(self, uid: int) -> None:
        self._restoring.pop(uid, None)
        if self._state.get_sequence(uid) is not None:  # FastGen warns of an unknown one (detached, say)
            self._engine.flush(uid)

    # ---- forward ------------------------------------------------------------------------------------
    def seen_tokens(self, uid: int) -> int:
        desc = self._state.get_sequence(uid)
        return 0 if desc is None else desc.seen_tokens

    @torch.no_grad()
    def step(self, requests: list[tuple[int, list[int]]], capture: LayerCapture | None = None) -> torch.Tensor:
        self._check_fits(requests)
        uids = [uid for uid, _ in requests]
        tokens = [torch.tensor(t, dtype=torch.int64) for _, t in requests]
        self._reuse_batch_buffers()
        if capture is None:
            return self._engine.put(uids, tokens, do_checks=False)
        segments, row = [], 0
        for uid, t in requests:
            segments.append(Segment(uid, self.seen_tokens(uid), len(t), row))
            row += len(t)
        capture.begin_batch(segments)
        with self._capturing(capture, segments):
            logits = self._engine.put(uids, tokens, do_checks=False)
        capture.end_batch()
        return logits

    def _check_fits(self, requests: list[tuple[int, list[int]]]) -> None:
        """What ``put``'s own checks would check. Those (``do_checks=True``) pass ``free_blocks``, a list,
        where FastGen's ``get_kv_requirements`` compares an int, and raise TypeError (deepspeed 0.19.8); MII
        skips them. Unchecked, FastGen allocates fewer blocks than the tokens need and writes past them."""
        total = sum(len(t) for _, t in requests)
        if total > self.config.state_manager.max_ragged_batch_size:
            raise InvalidRequestError(
                f"{total} tokens in one step, over FastGen's max_ragged_batch_size of {self.config.state_manager.max_ragged_batch_size}"
            )
        for uid, tokens in requests:
            if not tokens:
                raise InvalidRequestError(f"sequence {uid}: no tokens to process")
        self._check_blocks([(uid, len(t)) for uid, t in requests])

    def _check_blocks(self, requests: list[tuple[int, int]]) -> None:
        """Raise :class:`CacheFullError` unless ``(uid, new tokens)`` all fit in the free blocks together."""
        from deepspeed.inference.v2.ragged import PlaceholderSequenceDescriptor

        free = min(self.free_blocks)
        for uid, n in requests:
            desc = self._state.get_sequence(uid) or PlaceholderSequenceDescriptor()
            fits, blocks = self._model.get_kv_requirements(desc, n, free)
            if fits < n:
                raise CacheFullError(f"sequence {uid}: only {fits} of {n} new tokens fit in the free KV blocks")
            free -= blocks

    @contextmanager
    def _capturing(self, capture: LayerCapture, segments: list[Segment]):
        """Wrap the model's layer method, ``qkv`` and ``attn`` for one ``put``; restore them however it ends.

        ``on_layer`` runs right after ``attn`` (K/V are in the cache) and before ``attn_out`` and the MLP
        norm, which overwrites the buffer ``hidden`` is a view of. A capture must take what it keeps before
        the compute stream's next kernel: the saver copies the rows on the compute stream itself, inside
        ``on_layer`` (then moves the copy to host on its own stream), so the adapter adds no synchronisation
        of its own.
        """
        model = self._model
        layer_fn, qkv_fn, attn_fn = getattr(model, self._layer_method), model.qkv.forward, model.attn.forward
        current: dict[str, Any] = {}

        def layer(layer_idx, *args, **kwargs):
            current["layer"] = layer_idx
            return layer_fn(layer_idx, *args, **kwargs)

        def qkv(hidden_states, *args, **kwargs):
            current["hidden"] = hidden_states
            return qkv_fn(hidden_states, *args, **kwargs)

        def attn(q_k_v, kv_cache, *args, **kwargs):
            out = attn_fn(q_k_v, kv_cache, *args, **kwargs)
            capture.on_layer(
                current["layer"], current["hidden"], functools.partial(self._read_batch_kv, kv_cache, segments, current)
            )
            return out

        setattr(model, self._layer_method, layer)
        model.qkv.forward, model.attn.forward = qkv, attn
        try:
            yield
        finally:  # instance attributes shadowed the class's methods: deleting them restores the originals
            delattr(model, self._layer_method)
            del model.qkv.forward, model.attn.forward

    def _read_batch_kv(self, kv_cache: torch.Tensor, segments: list[Segment], current: dict[str, Any]) -> torch.Tensor:
        if "slots" not in current:  # once per batch: blocks are allocated by the time a layer runs
            current["slots"] = torch.cat([self._slots(s.uid, s.start, s.length) for s in segments])
        return read_kv(kv_cache, current["slots"])

    def _slots(self, uid: int, start: int, length: int) -> torch.Tensor:
        table = self._state.get_sequence(uid).all_block_ids().to(self.device, torch.long)
        return slot_mapping(table, torch.arange(start, start + length, device=self.device), self.block_size)

    # ---- restore primitives -------------------------------------------------------------------------
    def begin_restore(self, uid: int, num_tokens: int) -> None:
        """Track ``uid`` and allocate its blocks for ``num_tokens`` past its seen tokens, as ``put`` would."""
        if uid in self._restoring:
            raise InvalidRequestError(f"sequence {uid} is already being restored")
        base = self.seen_tokens(uid)
        if base + num_tokens > self.spec.max_positions:
            raise InvalidRequestError(
                f"sequence {uid} would hold {base + num_tokens} tokens, over the model's limit of {self.spec.max_positions}"
            )
        self._check_blocks([(uid, num_tokens)])
        desc = self._state.get_or_create_sequence(uid)
        self._model.maybe_allocate_kv(desc, num_tokens)
        positions = torch.arange(base, base + num_tokens, device=self.device)
        tables = layer_tables(self.spec, positions, self.dtype, rule="fastgen")  # as FastGen's forward rotates
        tokens = block_positions([(_host_blocks(desc), base, base + num_tokens)], self.block_size, self.block_size)
        self._restoring[uid] = RestoreState(base, num_tokens, tables, self._layout, tokens)

    @torch.no_grad()
    def restore_from_hidden(self, uid: int, layer: int, hidden: torch.Tensor, start: int = 0) -> None:
        k, v = self._kv_proj[layer](hidden.to(self.device, self.dtype, non_blocking=True))
        self._restoring[uid].write_projected(layer, self._state.get_cache(layer), k, v, start)

    @torch.no_grad()
    def restore_kv(
        self, uid: int, layer: int, kv: torch.Tensor | QuantRows | Sequence[torch.Tensor | QuantRows], start: int = 0
    ) -> None:
        self._restoring[uid].write_kv(self._state.get_cache(layer), kv, start)

    @torch.no_grad()
    def recompute_layers(self, uid: int, tokens: list[int], num_layers: int) -> None:
        """RE: FastGen's embedding and first ``num_layers`` layers over ``tokens``, in batches of at most
        ``max_ragged_batch_size`` (the size of every module's buffers).

        Each batch is inserted as ``put`` inserts a sequence, but through a placeholder descriptor that
        says where the batch starts: the real descriptor's ``seen_tokens`` grows only at :meth:`end_restore`,
        so this can run any number of times (the profiler times it) before the restore ends.

        Every batch reuses the ragged batch's pinned host buffers: ``finalize`` rewrites them on the host,
        then queues their copies to the device, and ``prepare_batch`` does the same with the attention
        atoms. Nothing syncs between batches, so the next batch's host writes wait on an event recorded
        after this batch's uploads were queued (not on the forward: the host stays one batch ahead).
        """
        from deepspeed.inference.v2.ragged import PlaceholderSequenceDescriptor

        r = self._restoring[uid]
        if len(tokens) > r.num_tokens:
            raise InvalidRequestError(
                f"sequence {uid}: {len(tokens)} tokens to recompute, {r.num_tokens} being restored"
            )
        if num_layers == 0:
            return
        model, batch, desc = self._model, self._engine._batch, self._state.get_sequence(uid)
        layer = getattr(model, self._layer_method)
        max_rows = self.config.state_manager.max_ragged_batch_size
        for off in range(0, len(tokens), max_rows):
            view = PlaceholderSequenceDescriptor(r.base + off, desc.cur_allocated_blocks, desc.kv_blocks_ptr)
            self._reuse_batch_buffers()
            batch.clear()
            batch.insert_sequence(view, torch.tensor(tokens[off : off + max_rows], dtype=torch.int64))
            batch.finalize()
            model.prepare_batch(batch)
            if self._uploaded is not None:
                self._uploaded.record()
                self._upload_pending = True
            residual = model._forward_embed(batch)
            residual, hidden = model.norm(residual, None, model._transformer[0].attn_norm_gamma, beta=None)
            for i in range(num_layers):
                residual, hidden = layer(i, residual, hidden, batch)

    def _reuse_batch_buffers(self) -> None:
        """Before the ragged batch's host buffers are rewritten: wait until recompute's last uploads of them
        have run (a ``put`` after a restore rewrites them too). FastGen's own puts are ordered by their
        callers, who read each put's logits back before the next."""
        if self._upload_pending:
            self._uploaded.synchronize()
            self._upload_pending = False

    def end_restore(self, uid: int, tokens: list[int]) -> None:
        """Count ``tokens`` as seen, with the descriptor calls ``put`` makes around a forward. A restore that
        found a bad chunk ends short of what it began for: the blocks past it stay allocated, and the
        prefill that follows overwrites what was written there."""
        r = self._restoring.pop(uid)
        if len(tokens) > r.num_tokens:
            raise InvalidRequestError(
                f"sequence {uid}: restore began for {r.num_tokens} tokens, ended with {len(tokens)}"
            )
        desc = self._state.get_sequence(uid)
        desc.pre_forward(len(tokens))
        desc.post_forward()

    # ---- blocks held for no sequence (the GPU prefix cache's) ------------------------------------------
    def detach(self, uid: int) -> list[int]:
        """What FastGen's ``flush_sequence`` does, but the blocks are not given back to its allocator."""
        self._restoring.pop(uid, None)
        desc = self._state.get_sequence(uid)
        if desc is None:
            return []
        blocks = _host_blocks(desc)
        self._state._tracking_allocator.free(desc.tracking_id)
        del self._state._seqs[uid]
        return blocks

    def release_blocks(self, blocks: list[int]) -> None:
        self._state._kv_cache.free(blocks)

    @torch.no_grad()
    def restore_from_slots(self, uid: int, slots: torch.Tensor) -> None:
        self._restoring[uid].copy_from_slots(self._caches(), slots)

    def kv(self, uid: int, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K and V of a sequence, gathered from its blocks (for checks, not the serving path)."""
        desc = self._state.get_sequence(uid)
        return gather_kv(
            self._state.get_cache(layer),
            desc.all_block_ids().to(self.device, torch.long),
            desc.seen_tokens if length is None else length,
        )

    def _caches(self) -> list[torch.Tensor]:
        return [self._state.get_cache(layer) for layer in range(self.spec.num_layers)]
