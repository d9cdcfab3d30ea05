"""hcache's settings for a vLLM engine, resolved from vLLM's own config in each of its processes alike.

The connector's settings are ``kv_connector_extra_config``: the same keys as every other entry point's
(:class:`~hcache.config.HCacheConfig`). The model's facts come from vLLM's model config, and the
fingerprint from the checkpoint vLLM loads, marked as vLLM's: another engine rounds differently, so it
does not share stored state with vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import HCacheConfig, ResolvedConfig
from ..errors import InvalidRequestError, StorageError
from ..model.fingerprint import checkpoint_fingerprint
from ..model.spec import STORED_LAYER_TYPES, MambaSpec, ModelSpec
from ..model.tensor_parallel import TPGroup, shard_heads
from ..planning.checkpoints import StateRule
from ..planning.plan import Method
from ..planning.policy import is_auto
from ..resolve import resolve
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.lookup import StoreLookup
from . import CONNECTOR, MODULE
from .events import Group

log = logging.getLogger(__name__)

# Settings of the engine hcache runs elsewhere, which vLLM decides here: refused rather than ignored.
VLLMS_OWN = (
    "engine",
    "device",
    "dtype",
    "num_blocks",
    "gpu_cache",
    "profile",
    "measure_profile",
    "self_check",
    "metrics_port",
    "metrics_host",
    "kv_events",  # vLLM's --kv-events-config, which publishes hcache's events with its own
)


def kv_transfer_config(settings: dict) -> dict:
    """vLLM's ``kv_transfer_config`` that loads hcache's connector with ``settings`` (hcache's, as a dict),
    checked now (:func:`check_settings`), before vLLM starts."""
    check_settings(settings)
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": settings,
    }


@dataclass(frozen=True)
class VllmSetup:
    """``block_sizes``: each of vLLM's KV cache groups' block, in tokens (one group, but for a model with
    layers of several types under vLLM's hybrid KV cache manager); ``groups``: each layer's group;
    ``kinds``: each group's kind and window as vLLM's KV cache events name them (None: not known);
    ``events``: vLLM publishes KV cache events (``--kv-events-config``), and hcache's with them."""

    config: ResolvedConfig
    fingerprint: str
    block_sizes: tuple[int, ...]
    groups: tuple[int, ...]
    kinds: tuple[tuple[str | None, int | None], ...]
    events: bool = False

    @property
    def window_block(self) -> int:
        """The block by which vLLM holds a sliding-window layer's positions (:mod:`hcache.planning.window`)."""
        return max(self.block_sizes)

    @property
    def event_groups(self) -> tuple[Group, ...]:
        """vLLM's KV cache groups as hcache's KV cache events name them, each with the layers a chunk must hold
        for its blocks there (:meth:`~hcache.config.ResolvedConfig.kept`)."""
        spec, config = self.config.spec, self.config
        return tuple(
            Group.of(
                g,
                size,
                kind,
                window,
                {layer: config.kept(spec, layer) for layer, group in enumerate(self.groups) if group == g},
                self.window_block,
            )
            for g, (size, (kind, window)) in enumerate(zip(self.block_sizes, self.kinds))
        )

    @property
    def states(self) -> StateRule | None:
        """Where the model's recurrent layers' state is stored, at vLLM's checkpoints (None: it has none)."""
        return self.config.state_rule(self.config.spec) if self.config.spec.recurrent_layers else None

    @property
    def rank_fingerprints(self) -> list[str]:
        """Each tensor-parallel rank's fingerprint, in which its chunks' keys are rooted."""
        size = self.config.tensor_parallel
        return [TPGroup(r, size).fingerprint(self.fingerprint) for r in range(size)]

    def store_lookup(self) -> StoreLookup:
        """The look-up of every rank's stores, for a process that does not own them (the scheduler's)."""
        dirs = [d for r in range(self.config.tensor_parallel) for d in self.config.store_dirs(r) or []]
        return self.config.settings.store.lookup(dirs or None)


def connector_settings(extra: dict | None) -> HCacheConfig:
    """hcache's settings from ``kv_connector_extra_config``; raises :class:`InvalidRequestError` for a
    misspelt or invalid key, or one that vLLM decides."""
    settings = HCacheConfig.of(extra)
    own = sorted(set(VLLMS_OWN) & settings.model_fields_set)
    if own:
        raise InvalidRequestError(
            f"hcache's vLLM connector does not take {', '.join(own)}: vLLM decides these (docs/vllm.md)"
        )
    return settings


def check_settings(extra: dict | None) -> HCacheConfig:
    """:func:`connector_settings`, and the store's directories checked as opening them would (writable,
    not held by another process, of this layout), opening nothing: for the process that starts vLLM,
    before any weights load. ``InvalidRequestError`` names what is wrong."""
    settings = connector_settings(extra)
    if settings.enabled:
        try:
            settings.store.check_dirs(settings.store_dirs or None)
        except StorageError as exc:
            raise InvalidRequestError(f"hcache's vLLM connector cannot use its store: {exc}") from None
    return settings


def check_engine(vllm_config) -> None:
    """Everything :func:`resolve_setup` refuses that ``vllm_config`` (vLLM's, before its engine starts) can
    tell, and the store's directories (:func:`check_settings`): for the process that starts vLLM, before
    any weights load. What only the KV cache groups tell is refused in the worker."""
    check_settings(vllm_config.kv_transfer_config.kv_connector_extra_config)
    _resolve(vllm_config, None)


def resolve_setup(vllm_config, kv_cache_config=None) -> VllmSetup:
    """The resolved settings, fingerprint and KV cache groups of the engine ``vllm_config`` and
    ``kv_cache_config`` (vLLM's, which the connector is given; None: one group) describe. Raises
    :class:`InvalidRequestError` for settings the connector cannot serve, naming what to change."""
    config, spec, groups = _resolve(vllm_config, kv_cache_config)
    fingerprint = hashlib.blake2b(
        f"vllm|{checkpoint_fingerprint(vllm_config.model_config.model, spec)}".encode(), digest_size=16
    ).hexdigest()
    events = vllm_config.kv_events_config is not None and vllm_config.kv_events_config.enable_kv_cache_events
    return VllmSetup(config, fingerprint, groups.block_sizes, groups.groups, groups.kinds, events)


def _resolve(vllm_config, kv_cache_config) -> tuple[ResolvedConfig, ModelSpec, _Groups]:
    """:func:`resolve_setup`'s checks and resolved settings; the model's facts as vLLM runs its layers; its
    KV cache groups."""
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_load_failure_policy != "recompute":
        raise InvalidRequestError(
            "hcache's vLLM connector needs kv_load_failure_policy='recompute' in --kv-transfer-config: a stored "
            "chunk found bad when it loads is recomputed, where vLLM's default ('fail') would fail the request"
        )
    settings = connector_settings(transfer.kv_connector_extra_config)
    model = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto" and getattr(torch, str(cache_dtype), None) != model.dtype:
        raise InvalidRequestError(
            f"hcache's vLLM connector needs vLLM's KV cache in the model's dtype, not kv_cache_dtype={cache_dtype!r}: "
            "it stores and loads K/V rows as the model computes them (stored_dtype sets how hcache stores them)"
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise InvalidRequestError(
            "hcache's vLLM connector does not serve pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}): each stage would store a part of the layers; tensor parallelism it does (docs/vllm.md)"
        )
    tp = parallel.tensor_parallel_size
    groups = _cache_groups(kv_cache_config, model.hf_config.num_hidden_layers, vllm_config.cache_config.block_size)
    state_layers = groups.state_layers
    if kv_cache_config is None:  # before the engine starts: its groups, in the worker, say which layers keep a state
        types = getattr(model.hf_config, "layer_types", None) or ()
        state_layers = tuple(i for i, kind in enumerate(types) if kind not in STORED_LAYER_TYPES)
    spec = ModelSpec.from_config(
        model.hf_config, dtype=model.dtype, any_family=True, state_layers=state_layers
    )  # KV needs no family's facts; a recurrent layer's state is described by vLLM
    spec = dataclasses.replace(spec, sliding_windows=groups.windows or spec.sliding_windows, mamba=groups.state)
    if groups.state_layers:  # vLLM's checkpoints, every ``state_every``-th of them
        settings = HCacheConfig.of(settings, state_every=settings.state_every * groups.state_block // CHUNK_TOKENS)
    if not Path(model.model).is_dir():
        raise InvalidRequestError(f"hcache's vLLM connector needs the model as a local directory, not {model.model!r}")
    eager = _eager(vllm_config.compilation_config)
    if (not eager or tp > 1) and (settings.plan is None or is_auto(settings.plan)):
        settings = HCacheConfig.of(settings, plan=Method.KV.value)  # H needs the layer inputs a compiled model hides
        log.info(
            "hcache's vLLM connector restores by KV: %s", "H needs enforce_eager=True" if not eager else _H_UNDER_TP
        )
    config = resolve(
        settings, shard_heads(spec, tp), model.model, engine="vllm", tensor_parallel=tp
    )  # refuses a plan of RE layers
    if uses_hidden_states(config) and tp > 1:
        raise InvalidRequestError(
            f"plan {str(config.plan)!r} with save={settings.save!r} uses hidden states (H) at tensor_parallel_size={tp}: "
            f"{_H_UNDER_TP}. Give plan 'KV'"
        )
    if uses_hidden_states(config) and Method.H not in methods(spec):
        raise InvalidRequestError(
            f"plan {str(config.plan or 'auto')!r} with save={settings.save!r} uses hidden states (H), which vLLM's "
            f"{spec.model_type} cannot be restored by: its K takes no RoPE, and hcache rebuilds K through the layer's "
            "rotary_emb. Give plan 'KV'"
        )
    if uses_hidden_states(config) and not eager:
        raise InvalidRequestError(
            f"plan {str(config.plan or 'auto')!r} with save={settings.save!r} restores or saves hidden states (H), which "
            "hcache's vLLM connector does only with enforce_eager=True: it reads each layer's input through a hook, "
            "which vLLM's compiled model and CUDA graphs do not run. Serve with --enforce-eager, or give plan 'KV'"
        )
    return config, spec, groups


@dataclass(frozen=True)
class _Groups:
    """vLLM's KV cache groups as hcache reads them: each group's block size, each layer's group, each group's
    kind and window as vLLM's KV cache events name them (None: not known), each layer's window (None: none
    from vLLM), and the layers whose recurrent state vLLM keeps, that state's shape (as hcache's
    :class:`~hcache.model.spec.MambaSpec` sizes it) and the block at whose boundaries vLLM checkpoints it."""

    block_sizes: tuple[int, ...]
    groups: tuple[int, ...]
    kinds: tuple[tuple[str | None, int | None], ...]
    windows: tuple[int | None, ...] | None = None
    state_layers: tuple[int, ...] = ()
    state: MambaSpec | None = None
    state_block: int = 0


def _cache_groups(kv_cache_config, num_layers: int, block_size: int) -> _Groups:
    """Each KV cache group's block size, each layer's group, and each layer's window as vLLM runs it, which
    may not be transformers' (a Qwen2 with mixed ``layer_types`` is windowed there, not in vLLM; a Llama
    with them, in vLLM only): vLLM's groups say. Without them (None), one group of ``block_size``. A Mamba
    group (Mamba-2, gated delta net) is served where vLLM checkpoints its state at block boundaries
    (``mamba_cache_mode="align"``), which hcache then stores; elsewhere vLLM has no state at a position a
    returning prompt could restore to, and the model is refused."""
    if kv_cache_config is None:
        return _Groups((block_size,), (0,) * num_layers, ((None, None),))
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import AttentionSpec, get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec

    groups, windows, recurrent, state, state_block = [0] * num_layers, [None] * num_layers, [], None, 0
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        kind = group.kv_cache_spec
        if isinstance(kind, VllmMambaSpec):
            state, state_block = _state(kind, group.layer_names), kind.block_size
        elif not isinstance(
            kind, AttentionSpec
        ):  # never a prefix without its state (MLA's latent rows are attention's)
            raise InvalidRequestError(
                f"hcache's vLLM connector stores attention K/V rows and Mamba states; vLLM keeps layers "
                f"{_names(group.layer_names)} as {type(kind).__name__}, state hcache does not store yet, "
                "and a prefix loaded without it would be wrong"
            )
        for name in group.layer_names:
            layer = extract_layer_index(name)
            groups[layer], windows[layer] = g, getattr(kind, "sliding_window", None)
            if isinstance(kind, VllmMambaSpec):
                recurrent.append(layer)
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    return _Groups(
        tuple(spec.block_size for spec in specs),
        tuple(groups),
        tuple((get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)) for spec in specs),
        tuple(windows),
        tuple(sorted(recurrent)),
        state,
        state_block,
    )


def _state(kind, names: list[str]) -> MambaSpec:
    """A vLLM Mamba group's state as hcache stores it, or why it cannot be: where vLLM checkpoints it at block
    boundaries (align mode), of a kind tried on vLLM's CPU build (``STATE_KINDS``). Its two tensors (a
    convolution's inputs and the recurrent state, ``[a, b]`` and ``[c, d, e]`` a block) are sized as a
    :class:`MambaSpec` ``(b, a, c, d, e)``: a chunk stores the state's values in vLLM's order."""
    if kind.mamba_cache_mode != "align":
        raise InvalidRequestError(
            f"hcache's vLLM connector stores a recurrent layer's state where vLLM checkpoints it, at block boundaries "
            f"(mamba_cache_mode='align', which enable_prefix_caching=True sets); layers {_names(names)} run with "
            f"mamba_cache_mode={kind.mamba_cache_mode!r}, which keeps none, and a prefix loaded without it would be wrong"
        )
    if kind.mamba_type.name not in STATE_KINDS:
        raise InvalidRequestError(
            f"hcache's vLLM connector stores the state of {', '.join(STATE_KINDS.values())} layers; vLLM's "
            f"{kind.mamba_type.name} layers {_names(names)} are refused: Mamba-2's align mode fails in vLLM 0.32's "
            "CPU build (IndexError in mamba_mixer2), so no checkpoint of theirs was ever tried (docs/vllm.md)"
        )
    (a, b), (c, d, e) = kind.shapes
    if kind.block_size % CHUNK_TOKENS:
        raise InvalidRequestError(
            f"hcache's vLLM connector stores a recurrent state at the end of a {CHUNK_TOKENS}-token chunk; vLLM "
            f"checkpoints layers {_names(names)} every {kind.block_size} tokens, at no chunk's end"
        )
    return MambaSpec(conv_dim=b, conv_kernel=a, heads=c, head_dim=d, state_size=e)


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


# vLLM's Mamba kinds whose align-mode checkpoints hcache stores (vLLM's backend name: the layers' kind)
STATE_KINDS = {"GDN_ATTN": "gated delta net"}

# Each rank of vLLM's tensor parallelism reads its store alone, with no collective off vLLM's step: H would
# have each rank read the layer's whole input (hidden_size a token) where KV reads the rank's heads
# (2 * kv_dim / size), never fewer bytes from size 2 on.
_H_UNDER_TP = "each rank would read the whole hidden state, never fewer bytes than its own K/V heads (docs/vllm.md)"


def methods(spec: ModelSpec) -> tuple[Method, ...]:
    """The methods hcache's connector restores ``spec`` by in vLLM: KV, any family vLLM serves with attention
    alone (MLA's latent rows too); H too where hcache knows the family's weights and its K rotates by RoPE (the
    rebuild runs the layer's own ``qkv_proj`` and ``rotary_emb``), but for a family whose ``qkv_proj`` also
    yields Q's output gate (Qwen3-Next: the rebuild splits Q, K and V without it) or a hybrid (H was never
    run beside vLLM's recurrent state); never RE (vLLM computes every layer of a token it does not load).
    docs/models.md's table follows this."""
    rebuilds = spec.restores_hidden and spec.rope is not None and not spec.output_gate and not spec.recurrent_layers
    return (Method.H, Method.KV) if rebuilds else (Method.KV,)


def uses_hidden_states(config: ResolvedConfig) -> bool:
    """Whether ``config`` saves or restores hidden states on some layer."""
    planned = config.plan is not None and Method.H in config.plan.layers  # a fixed plan may restore H it does not save
    return planned or any(Method.H.value in formats for formats in config.save_formats)


def _eager(compilation) -> bool:
    """Whether vLLM runs the model as written (enforce_eager): no torch.compile graph, no CUDA graph."""
    from vllm.config import CompilationMode, CUDAGraphMode

    return compilation.mode == CompilationMode.NONE and compilation.cudagraph_mode == CUDAGraphMode.NONE
