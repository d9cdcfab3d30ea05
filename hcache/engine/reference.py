"""Reference engine: HF transformers' modules driven over a ragged batch and a paged KV cache.

It runs on the CPU (and on a GPU when present) and serves as hcache's ground truth: the projection GEMMs,
norms and MLPs are transformers' own modules; the attention reads the paged cache, and K/V are written
with the same ops the restore path uses (:mod:`hcache.ops`). A restore fills the cache layer by layer
with three primitives: :meth:`recompute_layers` (RE), :meth:`restore_from_hidden` (H) and
:meth:`restore_kv` (KV).
"""

from __future__ import annotations

import functools
from collections import abc
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidRequestError
from ..model.families import FAMILIES
from ..model.spec import ModelSpec
from ..ops import KVProjection, apply_rope, gather_kv, read_kv, rotate_and_write
from ..ops.kv_projection import linear_rows
from ..ops.paged_kv import block_positions, flat_slots
from ..ops.paged_layout import PagedLayout
from ..ops.quant import QuantRows
from ..ops.rope import layer_tables
from ..storage.chunk_key import CHUNK_TOKENS
from .blocked_kv_cache import BlockedKVCache
from .capture import LayerCapture
from .ragged import Segment
from .recurrent_state import RecurrentState
from .restore_state import RestoreState

SCORES = 1 << 28  # attention scores one SDPA call may hold: 512 MiB in float16


@dataclass
class Sequence:
    uid: int
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache, in order
    blocks: list[int] = field(default_factory=list)


class _Decoder:
    """The family-specific glue around a layer's attention: embedding, MLP block and LM head."""

    def __init__(self, model: nn.Module, spec: ModelSpec):
        self.spec = spec
        self.batched_mlp = FAMILIES[spec.model_type].batched_mlp
        self.lm_head = model.get_output_embeddings()
        self.layers = model.get_submodule(spec.layers_prefix)
        if spec.model_type == "opt":
            dec = model.get_submodule("model.decoder")
            self.embed_tokens, self.final_norm = dec.embed_tokens, dec.final_layer_norm
            self.project_in, self.project_out = dec.project_in, dec.project_out
            self.position_table = dec.embed_positions.weight
        else:
            self.embed_tokens, self.final_norm = model.model.embed_tokens, model.model.norm
            self.project_in = self.project_out = self.position_table = None

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        if self.spec.embedding_multiplier is not None:
            x = x * self.spec.embedding_multiplier
        if self.project_in is not None:
            x = self.project_in(x)
        if self.position_table is not None:
            x = x + F.embedding(positions + self.spec.learned_position_offset, self.position_table)
        return x

    def attention_block(self, layer: nn.Module, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention's output projection (and, in Gemma, its norm)."""
        out = layer.get_submodule(self.spec.o_module)(attention)
        if self.spec.sandwich:
            out = layer.get_submodule(self.spec.sandwich[0])(out)
        return self.residual(x, out)

    def residual(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        scale = self.spec.residual_multiplier
        return x + (out if scale is None else out * scale)

    def mlp_block(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.spec.model_type == "granitemoehybrid":  # shared MLP, plus the experts where it has them
            h = layer.post_attention_layernorm(x)
            out = layer.shared_mlp(h)
            if layer.has_experts:
                out = out + layer.block_sparse_moe(h[None])[0]
            return self.residual(x, out)
        if self.batched_mlp:
            return x + layer.mlp(layer.post_attention_layernorm(x)[None])[0]
        if self.spec.model_type == "opt":
            return x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
        if self.spec.sandwich:
            _, before, after = self.spec.sandwich
            return x + layer.get_submodule(after)(layer.mlp(layer.get_submodule(before)(x)))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        logits = self.lm_head(x)
        if self.spec.logits_scaling is not None:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class ReferenceEngine:
    """Ragged-batch forward over a :class:`BlockedKVCache`, plus the three restore primitives; serves
    :class:`~hcache.engine.interface.Engine`."""

    BLOCK_SIZE = 64

    def __init__(self, model: nn.Module, spec: ModelSpec, num_blocks: int = 128, block_size: int = BLOCK_SIZE):
        self.model = model.eval()
        self.spec = spec
        self.device = next(model.parameters()).device
        self.dtype = spec.torch_dtype
        self.cache = BlockedKVCache(spec, num_blocks, block_size, self.device)
        self.block_size = block_size
        self._layout = PagedLayout.blocked(self.cache.layers[0])  # every layer's cache is shaped alike
        self.decoder = _Decoder(model, spec)
        attention = [(i, layer) for i, layer in enumerate(self.decoder.layers) if not spec.is_recurrent(i)]
        self.kv_proj = {i: KVProjection.from_layer(spec, layer) for i, layer in attention}
        self.q_rows = {
            i: linear_rows(layer.get_submodule(spec.q_weight.module), spec.q_weight) for i, layer in attention
        }
        self.mixer = FAMILIES[spec.model_type].mixer if spec.recurrent_layers else None  # a recurrent layer's module
        self.sequences: dict[int, Sequence] = {}
        self.states: dict[int, RecurrentState] = {}  # each sequence's recurrent layers' state, where the model has them
        self._restoring: dict[int, RestoreState] = {}

    # ---- sequences ---------------------------------------------------------------------------------
    def sequence(self, uid: int) -> Sequence:
        if uid not in self.sequences:
            self.sequences[uid] = Sequence(uid)
        return self.sequences[uid]

    def seen_tokens(self, uid: int) -> int:
        seq = self.sequences.get(uid)
        return len(seq.tokens) if seq is not None else 0

    @property
    def free_blocks(self) -> torch.Tensor:
        return torch.tensor([self.cache.free_blocks])  # one KV-cache group

    def query(self, uid: int, max_request_tokens: int, max_request_blocks: int) -> tuple[int, int]:
        """How many of ``max_request_tokens`` more tokens fit in ``max_request_blocks`` more blocks, and the
        blocks they need (FastGen's ``get_kv_requirements``)."""
        seq = self.sequences.get(uid)
        seen, allocated = (len(seq.tokens), len(seq.blocks)) if seq is not None else (0, 0)
        needed = self.cache.blocks_for(seen + max_request_tokens) - allocated
        if needed <= max_request_blocks:
            return max_request_tokens, max(needed, 0)
        return (max_request_blocks + allocated) * self.block_size - seen, max_request_blocks

    def get_remaining_block_capacity(self, uid: int) -> int:
        seq = self.sequences.get(uid)
        return len(seq.blocks) * self.block_size - len(seq.tokens) if seq is not None else 0

    def flush(self, uid: int) -> None:
        """Drop a sequence and free its KV blocks and its recurrent state."""
        self._restoring.pop(uid, None)
        self.states.pop(uid, None)
        seq = self.sequences.pop(uid, None)
        if seq is not None:
            self.cache.free(seq.blocks)

    def flush_all(self) -> None:
        for uid in list(self.sequences):
            self.flush(uid)

    def _reserve(self, seq: Sequence, total_tokens: int) -> None:
        if total_tokens > self.spec.max_positions:
            raise InvalidRequestError(
                f"sequence {seq.uid} would hold {total_tokens} tokens, "
                f"over the model's limit of {self.spec.max_positions}"
            )
        missing = self.cache.blocks_for(total_tokens) - len(seq.blocks)
        if missing > 0:
            seq.blocks.extend(self.cache.allocate(missing))

    def _slots(self, seq: Sequence, start: int, length: int) -> torch.Tensor:
        return flat_slots(seq.blocks, start, start + length, self.cache.block_size, self.device)

    # ---- forward -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, requests: list[tuple[int, list[int]]], capture: LayerCapture | None = None) -> torch.Tensor:
        """Append each request's tokens to its sequence (prefill or decode) and return next-token logits
        ``[len(requests), vocab]`` for the last token of each."""
        hidden, segments = self._forward(requests, self.spec.num_layers, capture)
        for uid, tokens in requests:
            self.sequences[uid].tokens.extend(tokens)
        last_rows = torch.tensor([s.row + s.length - 1 for s in segments], device=self.device)
        return self.decoder.logits(hidden[last_rows]).float()

    @torch.no_grad()
    def score(self, uid: int, tokens: list[int], last: int) -> torch.Tensor:
        """Append ``tokens`` to sequence ``uid``, as ``step`` does, and return the next-token logits
        ``[last, vocab]`` after each of its last ``last`` tokens: a text scored position by position
        (teacher forcing), where serving needs only the last position's."""
        if not 1 <= last <= len(tokens):
            raise InvalidRequestError(f"sequence {uid}: cannot score the last {last} of {len(tokens)} tokens")
        hidden, _ = self._forward([(uid, tokens)], self.spec.num_layers, None)
        self.sequences[uid].tokens.extend(tokens)
        return self.decoder.logits(hidden[len(tokens) - last :]).float()

    def _forward(
        self, requests: list[tuple[int, list[int]]], num_layers: int, capture: LayerCapture | None, first: int = 0
    ) -> tuple[torch.Tensor, list[Segment]]:
        """Layers ``first``..``num_layers - 1`` over the requests' tokens, from their embedding."""
        segments, ids, positions, slots = [], [], [], []
        row = 0
        for uid, tokens in requests:
            if not tokens:
                raise InvalidRequestError(f"sequence {uid}: no tokens to process")
            seq = self.sequence(uid)
            start = len(seq.tokens)
            self._reserve(seq, start + len(tokens))
            segments.append(Segment(uid, start, len(tokens), row))
            ids.extend(tokens)
            positions.append(torch.arange(start, start + len(tokens), device=self.device))
            slots.append(self._slots(seq, start, len(tokens)))
            row += len(tokens)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t, slots_t = torch.cat(positions), torch.cat(slots)
        tables = layer_tables(self.spec, pos_t, self.dtype)

        if capture is not None:
            capture.begin_batch(segments)
        x = self.decoder.embed(ids_t, pos_t)
        gated = bool(self.spec.output_gate)
        for i in range(first, num_layers):
            layer = self.decoder.layers[i]
            h = layer.get_submodule(self.spec.capture_module)(x)
            if self.spec.is_recurrent(i):
                x = self.decoder.residual(x, self._recurrent(i, layer.get_submodule(self.mixer), h, segments, capture))
                x = self.decoder.mlp_block(layer, x)
                continue
            k, v = self.kv_proj[i](h)
            rotate_and_write(self.cache.layers[i], slots_t, k, v, tables[i])
            if capture is not None:
                capture.on_layer(i, h, functools.partial(read_kv, self.cache.layers[i], slots_t))
            q = F.linear(h, *self.q_rows[i]).view(-1, self.spec.num_heads, (2 if gated else 1) * self.spec.head_size)
            q, gate = q.split(self.spec.head_size, dim=-1) if gated else (q, None)
            if self.spec.qk_norm:
                q = layer.get_submodule(self.spec.qk_norm[0])(q)
            if tables[i] is not None:
                q = apply_rope(q, *tables[i])
            attention = self._attention(i, q, segments)
            if gate is not None:  # Qwen3-Next's gated attention, as transformers' forward applies it
                attention = attention * torch.sigmoid(gate.reshape(attention.shape))
            x = self.decoder.attention_block(layer, x, attention)
            x = self.decoder.mlp_block(layer, x)
        if capture is not None:
            capture.end_batch()
        return x, segments

    def _recurrent(
        self, layer: int, mixer: nn.Module, h: torch.Tensor, segments: list[Segment], capture: LayerCapture | None
    ) -> torch.Tensor:
        """A recurrent layer (transformers' Mamba-2 or gated-delta-net mixer) over each segment, continuing its
        sequence's state, in pieces that end at chunk ends: a forward computes the same state there whatever its
        batch, and hands it to ``capture`` for the chunk."""
        out = torch.empty_like(h)
        for s in segments:
            state = self.states.setdefault(s.uid, RecurrentState())
            a, end = s.start, s.start + s.length
            while a < end:
                b = min(end, (a // CHUNK_TOKENS + 1) * CHUNK_TOKENS)
                rows = slice(s.row + a - s.start, s.row + b - s.start)
                out[rows] = mixer(h[None, rows], cache_params=state)[0]
                if capture is not None and b % CHUNK_TOKENS == 0:
                    capture.on_state(layer, s.uid, b // CHUNK_TOKENS - 1, state.rows(layer))
                a = b
        return out

    def _attention(self, layer: int, q: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.spec.num_heads * self.spec.head_size, dtype=q.dtype, device=q.device)
        window = self.spec.window(layer)
        for s in segments:
            total = s.start + s.length
            # A sliding-window layer reads its window only: a restore leaves the positions before it unwritten.
            lo = 0 if window is None else max(0, s.start - window + 1)
            table = torch.tensor(self.sequences[s.uid].blocks, dtype=torch.long, device=self.device)
            k, v = (t[lo:] for t in gather_kv(self.cache.layers[layer], table, total))
            q_pos = torch.arange(s.start, total, device=q.device)[:, None]
            k_pos = torch.arange(lo, total, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            # With a mask, SDPA may hold every head's queries-by-keys scores at once (its math path, which
            # CUDA takes under enable_gqa: 16 GiB for a 16K-token prefill of 32 heads): queries are taken in
            # tiles whose scores fit SCORES elements.
            tile = max(1, SCORES // (self.spec.num_heads * k.shape[0]))
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            if self.spec.attention_softcap is not None:  # the written-out path: each query head's own K/V
                groups = q.shape[1] // k.shape[0]
                k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
            for a in range(0, s.length, tile):
                b = min(s.length, a + tile)
                o = self._scores(q[s.row + a : s.row + b].transpose(0, 1), k, v, mask[a:b])
                out[s.row + a : s.row + b] = o.transpose(0, 1).reshape(b - a, -1)
        return out

    def _scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[H, Tq, C]`` over ``k``/``v`` ``[H_kv, Tk, C]`` (``[H, Tk, C]`` when soft-capped).
        Soft-capped scores (Gemma 2) take the written-out path, as transformers' eager attention: SDPA has no
        cap."""
        cap, scale = self.spec.attention_softcap, self.spec.attention_scale
        if cap is None:  # batched (4-D): the CPU takes its flash kernel only so, 3-4x the math path's speed
            return F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
            )[0]
        scores = q @ k.transpose(1, 2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        scores = (torch.tanh(scores / cap) * cap).masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    # ---- restore primitives ------------------------------------------------------------------------
    def begin_restore(self, uid: int, num_tokens: int) -> None:
        """Reserve blocks for ``num_tokens`` more tokens of the sequence, and compute once the slots every
        layer's restore shares and each distinct RoPE's tables (:func:`~hcache.ops.rope.layer_tables`)."""
        seq = self.sequence(uid)
        start = len(seq.tokens)
        self._reserve(seq, start + num_tokens)
        positions = torch.arange(start, start + num_tokens, device=self.device)
        tokens = block_positions([(seq.blocks, start, start + num_tokens)], self.block_size, self.block_size)
        self._restoring[uid] = RestoreState(
            start, num_tokens, layer_tables(self.spec, positions, self.dtype), self._layout, tokens
        )

    @torch.no_grad()
    def restore_state(self, uid: int, layer: int, rows: torch.Tensor) -> None:
        """A recurrent layer's state at the restore's end, from the rows a chunk stores it in."""
        state = self.states.setdefault(uid, RecurrentState())
        state.load(layer, rows.to(self.device), self.spec.mamba, self.dtype)

    def end_restore(self, uid: int, tokens: list[int]) -> None:
        """Mark ``tokens`` as present in every layer of the cache, once all layers are restored."""
        self._restoring.pop(uid, None)
        self.sequences[uid].tokens.extend(tokens)

    @torch.no_grad()
    def recompute_layers(self, uid: int, tokens: list[int], num_layers: int) -> None:
        """RE: run the first ``num_layers`` layers over ``tokens``, after what the sequence holds, filling
        their K/V."""
        if num_layers > 0:
            self._forward([(uid, tokens)], num_layers, None)

    @torch.no_grad()
    def forward_layer(self, uid: int, tokens: list[int], layer: int) -> None:
        """``layer``'s forward alone over ``tokens``, from their embedding: what RE costs of that layer, which the
        profiler times on a hybrid's first layer of each kind (:func:`~hcache.planning.profiler.measure_engine`)."""
        self._forward([(uid, tokens)], layer + 1, None, first=layer)

    @torch.no_grad()
    def restore_from_hidden(self, uid: int, layer: int, hidden: torch.Tensor, start: int = 0) -> None:
        """H: K/V GEMM over the saved normalised input, RoPE at absolute positions, scatter into the cache."""
        k, v = self.kv_proj[layer](hidden.to(self.device, self.dtype))
        self._restoring[uid].write_projected(layer, self.cache.layers[layer], k, v, start)

    @torch.no_grad()
    def restore_kv(
        self,
        uid: int,
        layer: int,
        kv: torch.Tensor | QuantRows | abc.Sequence[torch.Tensor | QuantRows],
        start: int = 0,
    ) -> None:
        self._restoring[uid].write_kv(self.cache.layers[layer], kv, start)

    # ---- blocks held for no sequence (the GPU prefix cache's) --------------------------------------
    def detach(self, uid: int) -> list[int]:
        self._restoring.pop(uid, None)
        self.states.pop(uid, None)
        seq = self.sequences.pop(uid, None)
        return seq.blocks if seq is not None else []

    def release_blocks(self, blocks: list[int]) -> None:
        self.cache.free(blocks)

    @torch.no_grad()
    def restore_from_slots(self, uid: int, slots: torch.Tensor) -> None:
        self._restoring[uid].copy_from_slots(self.cache.layers, slots)

    def state(self, uid: int, layer: int) -> torch.Tensor:
        """A recurrent layer's state of a sequence now, as a chunk stores it."""
        return self.states[uid].rows(layer)

    def kv(self, uid: int, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K and V of a sequence, gathered from its blocks."""
        seq = self.sequences[uid]
        table = torch.tensor(seq.blocks, dtype=torch.long, device=self.device)
        return gather_kv(self.cache.layers[layer], table, len(seq.tokens) if length is None else length)
