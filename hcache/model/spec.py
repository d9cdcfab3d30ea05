"""Engine-neutral description of a decoder-only model, derived from its HF config.

Everything hcache sizes, stores or restores is derived from a :class:`ModelSpec`: the per-token bytes of
hidden states and of KV, the positional scheme the restore must re-apply, and where each layer's K/V
projection rows live. Engine adapters (the reference engine, FastGen) read weights by these names, so a
family is described once, here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import UnsupportedModelError
from .families import FAMILIES, SUPPORTED_MODEL_TYPES, Family


@dataclass(frozen=True)
class WeightRows:
    """Rows ``[start, stop)`` of the weight (and bias) of the linear module at ``module`` inside a layer.

    ``stop is None`` means all rows: the module projects only this tensor. Fused projections (Phi-3's
    ``qkv_proj``) name the same module for Q, K and V with different row ranges.
    """

    module: str
    start: int = 0
    stop: int | None = None


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding, in the half-split (Llama/NeoX) layout.

    ``inv_freq`` comes from transformers' own RoPE initialisers, so scaled variants (linear, llama3) match
    the reference implementation bit for bit. Only the first ``rotary_dim`` channels of a head rotate.
    """

    theta: float
    rope_type: str
    rotary_dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0


@dataclass(frozen=True)
class MambaSpec:
    """A recurrent layer's state, the same in each of a model's recurrent layers: the convolution's last inputs
    ``[conv_dim, conv_kernel]`` and the recurrent state ``[heads, head_dim, state_size]``: a Mamba-2 mixer's SSM
    state, or a gated delta net's ``[value heads, key head dim, value head dim]`` (both kinds keep their state in
    transformers' ``LinearAttentionLayer``, so one shape describes both)."""

    conv_dim: int
    conv_kernel: int
    heads: int
    head_dim: int
    state_size: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.state_size)

    @property
    def numel(self) -> int:
        return self.conv_dim * self.conv_kernel + self.heads * self.head_dim * self.state_size


# Facts learnt after the first families: absent from the identity of a spec that lacks them (:meth:`ModelSpec.to_json`).
_LATER_FACTS = (
    "qk_norm",
    "sandwich",
    "attention_scale",
    "attention_softcap",
    "final_softcap",
    "sliding_rope",
    "kv_lora_rank",
    "recurrent_layers",
    "mamba",
    "embedding_multiplier",
    "residual_multiplier",
    "logits_scaling",
    "output_gate",
)
STORED_LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer types whose state is K/V


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_positions: int
    dtype: str
    qkv_bias: bool
    layers_prefix: str
    capture_module: str | None  # None: a family whose weights hcache does not know, described for KV alone
    q_weight: WeightRows | None
    k_weight: WeightRows | None
    v_weight: WeightRows | None
    o_module: str | None
    rope: RopeSpec | None
    learned_position_offset: int | None  # OPT: position ids are shifted by this before the lookup
    sliding_windows: tuple[int | None, ...] = field(default=())
    qk_norm: tuple[str, str] | None = None  # modules of the per-head norms of Q and K, applied before RoPE
    sliding_rope: RopeSpec | None = None  # sliding-window layers' RoPE, where it is not ``rope`` (Gemma 3's local base)
    # Facts of the forward alone (Gemma's), which a restore does not apply: it rebuilds K/V only.
    sandwich: tuple[str, str, str] | None = None  # norms of attention's output, the MLP's input and its output
    attention_scale: float | None = None  # scores' scale when not 1/sqrt(head_size) (``query_pre_attn_scalar``)
    attention_softcap: float | None = None  # scores soft-capped as ``cap·tanh(s/cap)`` before the mask
    final_softcap: float | None = None  # the logits' soft cap
    # MLA (DeepSeek-V2): the latent's width. Its cache holds one row a token, the latent then K's RoPE part, as one
    # KV head of ``head_size`` with no K/V split (:attr:`kv_parts`).
    kv_lora_rank: int | None = None
    # Hybrids (Granite 4's Mamba-2, Qwen3-Next's gated delta nets): the layers whose state is recurrent, not K/V,
    # and that state's shape
    recurrent_layers: tuple[int, ...] | None = None
    mamba: MambaSpec | None = None
    # Granite's scales: of the embeddings, of each block's output added to the residual, and the logits' divisor
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    output_gate: bool | None = None  # Qwen3-Next: Q's projection yields each head's query, then its output's gate

    # ---- sizes: everything else in hcache sizes from these two -------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` (a name, so that a spec travels as JSON) as torch's."""
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def kv_parts(self) -> int:
        """Rows a KV head caches a token: K and V (2), or an MLA latent row (1)."""
        return 1 if self.kv_lora_rank else 2

    @property
    def hidden_bytes_per_token_layer(self) -> int:
        return self.hidden_size * self.itemsize

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return self.kv_parts * self.kv_dim * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """A token's K/V over every layer: what a KV cache holding all of them takes a token."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def restores_hidden(self) -> bool:
        """Whether hcache knows where this family's layer input and K/V projection live, which H needs to
        rebuild K/V; KV needs neither (:meth:`from_config` with ``any_family``)."""
        return self.capture_module is not None

    def window(self, layer: int) -> int | None:
        """How many positions back a query of ``layer`` attends (itself included): ``None`` for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def rope_of(self, layer: int) -> RopeSpec | None:
        """The RoPE ``layer`` rotates Q and K by: Gemma 3's sliding and full layers take two bases."""
        return self.sliding_rope if self.sliding_rope is not None and self.window(layer) is not None else self.rope

    def is_recurrent(self, layer: int) -> bool:
        """Whether ``layer`` carries a recurrent state (a Mamba or gated-delta-net layer) instead of K/V."""
        return self.recurrent_layers is not None and layer in self.recurrent_layers

    def layer_type(self, layer: int) -> str:
        """The layer's type, by which hcache's accounting and docs group layers (transformers' names for
        attention)."""
        if self.is_recurrent(layer):  # vLLM may keep the state of a family hcache has no facts of
            family = FAMILIES.get(self.model_type)
            return family.recurrent_kind if family is not None else "recurrent"
        return "full_attention" if self.window(layer) is None else "sliding_attention"

    def attended_from(self, layer: int, length: int) -> int:
        """The first position that any query from position ``length`` on attends in ``layer``: 0 with full
        attention, ``length - window`` with a window. One earlier than transformers' mask needs (a query at
        ``p`` attends ``p - window < k <= p``), so an engine that counts the window one wider is served too."""
        window = self.window(layer)
        return 0 if window is None else max(0, length - window)

    @property
    def kv_to_hidden_ratio(self) -> float:
        """``r = 2·n_kv·head_size / D``: 2 for MHA; below 1, KV offload moves fewer bytes than hidden states."""
        return self.kv_bytes_per_token_layer / self.hidden_bytes_per_token_layer

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        for rope in ("rope", "sliding_rope"):
            if d[rope] is not None:
                d[rope].pop("inv_freq")
        d.update(
            hidden_bytes_per_token_layer=self.hidden_bytes_per_token_layer,
            kv_bytes_per_token_layer=self.kv_bytes_per_token_layer,
            kv_to_hidden_ratio=round(self.kv_to_hidden_ratio, 4),
        )
        return d

    def to_json(self) -> str:
        """The spec's identity (fingerprints and profiles are keyed by it). A fact a family lacks is left
        out, so the families that lack it keep the identity they had before hcache knew of it."""
        d = asdict(self)
        for fact in _LATER_FACTS:
            if d[fact] is None:
                del d[fact]
        return json.dumps(d, sort_keys=True)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config: Any,
        dtype: torch.dtype | str | None = None,
        any_family: bool = False,
        state_layers: tuple[int, ...] = (),
    ) -> ModelSpec:
        """Describe the model behind a ``transformers`` config. ``any_family``: a family hcache does not know
        is described by its attention's shape alone, for an engine that stores and loads its K/V rows as it
        computes them (vLLM), and restores nothing by H (:attr:`restores_hidden`). ``state_layers``: the
        layers whose recurrent state such an engine keeps and describes itself (vLLM's Mamba groups), whatever
        their type; their state's shape (``mamba``) is the engine's to give. Raises :class:`UnsupportedModelError`."""
        model_type = getattr(config, "model_type", None)
        family = FAMILIES.get(model_type)
        layer_types = tuple(getattr(config, "layer_types", None) or ())
        recurrent = family.recurrent if family is not None and not any_family else None
        others = sorted(
            {t for i, t in enumerate(layer_types) if i not in state_layers} - {*STORED_LAYER_TYPES, recurrent}
        )
        if others:  # before the family: this is why such a model is not served, whatever its family
            served = (
                f", which hcache's own engines keep for {model_type}" if family is not None and family.recurrent else ""
            )
            raise UnsupportedModelError(
                f"model_type {model_type!r} has {', '.join(others)} layers beside attention: hcache stores and restores "
                f"attention K/V ({', '.join(STORED_LAYER_TYPES)} layers) and has no rule for the state other layers "
                f"carry (a Mamba or linear-attention layer's recurrent state{served}), and K/V restored without that "
                "state would be wrong"
            )
        recurrent_layers = state_layers or tuple(i for i, t in enumerate(layer_types) if t == recurrent)
        latent = getattr(config, "kv_lora_rank", None) if family is None else None
        if latent and not any_family:
            raise UnsupportedModelError(
                f"model_type {model_type!r} caches attention as multi-head latent rows (MLA, kv_lora_rank={latent}), "
                "which hcache's own engines do not run (in vLLM, hcache stores and loads them by KV)"
            )
        if family is None and not any_family:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by hcache's own engines; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(in vLLM, hcache stores and loads any other family's K/V)"
            )
        if model_type == "opt" and not config.do_layer_norm_before:
            raise UnsupportedModelError(
                "OPT with do_layer_norm_before=False (OPT-350m) normalises after attention, so no normalised "
                "layer input exists to save; use another OPT size"
            )
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_size = getattr(config, "head_dim", None) or hidden // heads
        if latent:  # one row a token and layer: the latent, then the RoPE part of K that all heads share
            kv_heads, head_size = 1, latent + config.qk_rope_head_dim
        q_dim, kv_dim = heads * head_size, kv_heads * head_size
        fused_rows = {"q": (0, q_dim), "k": (q_dim, q_dim + kv_dim), "v": (q_dim + kv_dim, q_dim + 2 * kv_dim)}

        def rows(entry: tuple[str, str]) -> WeightRows | None:
            if family is None:
                return None
            module, part = entry
            return WeightRows(module, *fused_rows[part]) if part else WeightRows(module)

        if dtype is None:
            dtype = getattr(config, "dtype", None) or torch.float32
        dtype_name = str(dtype).removeprefix("torch.")
        if not isinstance(getattr(torch, dtype_name, None), torch.dtype):
            raise UnsupportedModelError(f"unknown dtype {dtype!r}")

        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_size=head_size,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            dtype=dtype_name,
            qkv_bias=_qkv_bias(config, model_type),
            layers_prefix=family.layers if family else "",
            capture_module=family.capture if family else None,
            q_weight=rows(family.q) if family else None,
            k_weight=rows(family.k) if family else None,
            v_weight=rows(family.v) if family else None,
            o_module=family.o if family else None,
            rope=_rope(config, head_size, "full_attention") if _rotates(config, family) else None,
            learned_position_offset=2 if family and family.positions == "learned" else None,
            sliding_windows=_sliding_windows(config, family.windows if family else "layer_types"),
            qk_norm=family.qk_norm if family else None,
            sandwich=family.sandwich if family else None,
            attention_scale=_attention_scale(config, head_size),
            attention_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            sliding_rope=_sliding_rope(config, head_size) if _rotates(config, family) else None,
            kv_lora_rank=latent or None,
            recurrent_layers=recurrent_layers or None,
            mamba=_RECURRENT_STATES[family.recurrent_kind](config) if recurrent_layers and not state_layers else None,
            embedding_multiplier=_scale(config, "embedding_multiplier"),
            residual_multiplier=_scale(config, "residual_multiplier"),
            logits_scaling=_scale(config, "logits_scaling"),
            output_gate=True if family and family.output_gate else None,
        )


def _rotates(config: Any, family: Family | None) -> bool:
    """Whether the family's attention rotates Q and K by RoPE (Granite 4's may take no positions at all)."""
    return (
        family is not None
        and family.positions == "rope"
        and getattr(config, "position_embedding_type", "rope") == "rope"
    )


def _scale(config: Any, name: str) -> float | None:
    """One of Granite's scales, where it is not 1 (the identity a family without it keeps)."""
    value = getattr(config, name, None)
    return None if value is None or value == 1 else float(value)


def _mamba(config: Any) -> MambaSpec:
    intermediate = int(config.mamba_expand * config.hidden_size)
    return MambaSpec(
        conv_dim=intermediate + 2 * config.mamba_n_groups * config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        state_size=config.mamba_d_state,
    )


def _gated_delta_net(config: Any) -> MambaSpec:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    return MambaSpec(
        conv_dim=2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        heads=config.linear_num_value_heads,
        head_dim=config.linear_key_head_dim,
        state_size=config.linear_value_head_dim,
    )


_RECURRENT_STATES = {"mamba": _mamba, "gated_delta_net": _gated_delta_net}  # each kind's state, from the config


def _qkv_bias(config: Any, model_type: str) -> bool:
    if model_type == "qwen2":
        return True
    if model_type == "opt":
        return bool(getattr(config, "enable_bias", True))
    return bool(getattr(config, "attention_bias", False))


def _attention_scale(config: Any, head_size: int) -> float | None:
    multiplier = getattr(config, "attention_multiplier", None)  # Granite's: the scale itself
    if multiplier is not None:
        return None if multiplier == head_size**-0.5 else float(multiplier)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return None if scalar is None or scalar == head_size else float(scalar) ** -0.5


def _by_layer_type(config: Any) -> bool:
    """Whether the config gives RoPE's parameters per layer type (Gemma 3: local and global bases)."""
    params = getattr(config, "rope_parameters", None) or {}
    return set(params) <= set(STORED_LAYER_TYPES) and bool(params)


def _sliding_rope(config: Any, head_size: int) -> RopeSpec | None:
    if not _by_layer_type(config) or "sliding_attention" not in config.rope_parameters:
        return None
    rope = _rope(config, head_size, "sliding_attention")
    return None if rope == _rope(config, head_size, "full_attention") else rope


def _rope(config: Any, head_size: int, layer_type: str) -> RopeSpec:
    """The RoPE of ``layer_type``'s layers (the same for every layer type, bar a config that sets them apart)."""
    per_type = _by_layer_type(config)
    params = dict((config.rope_parameters[layer_type] if per_type else getattr(config, "rope_parameters", None)) or {})
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type == "default":
        rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        scaling = 1.0
    elif rope_type in ("linear", "llama3"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, **({"layer_type": layer_type} if per_type else {}))
    else:
        # dynamic/yarn/longrope change frequencies with sequence length; a restore at fixed positions
        # would then disagree with the forward that produced the state.
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3")
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        rotary_dim=2 * len(inv_freq),
        inv_freq=tuple(float(f) for f in inv_freq),
        attention_scaling=float(scaling),
    )


def _sliding_windows(config: Any, rule: str) -> tuple[int | None, ...]:
    """Each layer's window as transformers' forward of the family applies it (vLLM may apply another: its
    connector takes the windows from vLLM's KV cache groups instead)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if not window or rule == "none":
        return (None,) * n
    if layer_types and rule == "layer_types":
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * n
