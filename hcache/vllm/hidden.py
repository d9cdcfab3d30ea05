"""Hidden states (H) in vLLM: each layer's input to its QKV projection, captured as the forward computes it,
and K/V rebuilt from it with the layer's own weights and RoPE.

vLLM's connector API hands the connector each layer's paged KV cache, not the model: not a layer's input,
nor the weights that rebuild K/V from it. hcache takes the model from the model runner that registers the
caches with the connector (:func:`registering_model`), and checks that it holds the very attention layers
vLLM configured, so a vLLM that calls the connector from elsewhere is refused at start rather than served
wrong. Each attention layer's parent module must project with a fused ``qkv_proj`` and rotate with a
``rotary_emb``, as vLLM's Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 do (Qwen3 and Gemma 3 norm each K head
with its ``k_norm`` first, and so does the rebuild; Gemma 3's sliding and full layers each rotate by their own
``rotary_emb``, so by their own base). K/V are rebuilt by that ``qkv_proj`` module itself,
Q's rows too: vLLM hands its weights to its own kernels in their layouts (on a CPU it packs them for
oneDNN and drops the plain weight; quantized layers keep them quantized), so its module is the one GEMM
that has them, and it rounds as the forward does.

The capture is a forward pre-hook on each ``qkv_proj``: it keeps the rows of this step's computed tokens,
found by their cache slots in the forward's slot mapping (:mod:`hcache.vllm.batch_rows`), so the forward's
batch order does not matter; whether they were all found (:attr:`HiddenLayers.held`) goes to the saver
with them, which saves nothing of a step where they were not. Hooks run only in eager mode: with
torch.compile or CUDA graphs they would not, so the settings refuse H there (:mod:`hcache.vllm.settings`).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidRequestError
from ..model.spec import ModelSpec
from .batch_rows import batch_rows

log = logging.getLogger(__name__)


def registering_model(attention_layers: dict, depth: int = 6) -> nn.Module:
    """The model whose caches are being registered: the ``get_model()`` of the model runner up the call stack
    of ``register_kv_caches``, if it holds every module of ``attention_layers`` (layer name -> vLLM's
    Attention); else :class:`InvalidRequestError`."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        get_model = getattr(frame.f_locals.get("self"), "get_model", None)
        if callable(get_model):
            model = get_model()
            if isinstance(model, nn.Module) and all(
                _holds(model, name, module) for name, module in attention_layers.items()
            ):
                return model
        frame = frame.f_back
    raise InvalidRequestError(
        "hcache's vLLM connector restores hidden states (H) through vLLM's model, which it finds from the model runner "
        "that registers the KV caches; this vLLM registers them from elsewhere. Give plan 'KV'"
    )


def _holds(model: nn.Module, name: str, module: nn.Module) -> bool:
    try:
        return model.get_submodule(name) is module
    except AttributeError:
        return False


@dataclass(frozen=True)
class _Layer:
    qkv: nn.Module
    rotary: nn.Module
    split: tuple[int, int, int]  # Q's, K's and V's columns of the projection's output
    k_norm: nn.Module | None  # the norm of each K head before RoPE, where the family has one (Qwen3's)


class HiddenLayers:
    """Each attention layer's QKV projection and RoPE, and the capture of its input. ``layers``: layer
    index -> the attention layer's name in ``model``."""

    def __init__(self, spec: ModelSpec, model: nn.Module, layers: dict[int, str], capture: frozenset[int]):
        self._layers: dict[int, _Layer] = {}
        self._slots: torch.Tensor | None = None  # this step's computed tokens' cache slots
        self._rows: torch.Tensor | None = None  # their rows in the forward's batch, found by its first layer
        self.held: torch.Tensor | None = None  # on the device: whether ``_rows`` hold every one of them
        self._slot_layer = next(iter(layers.values()))  # every layer's tokens take the same slots
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self._head_size = spec.head_size
        for index, name in layers.items():
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            qkv, rotary = getattr(parent, "qkv_proj", None), getattr(parent, "rotary_emb", None)
            if qkv is None or rotary is None:
                raise InvalidRequestError(
                    f"hcache's vLLM connector rebuilds K/V from hidden states (H) with a fused qkv_proj and a rotary_emb "
                    f"beside the attention; vLLM's {type(parent).__name__} has not both. Give plan 'KV'"
                )
            k_norm = getattr(parent, "k_norm", None) if spec.qk_norm else None
            if spec.qk_norm and k_norm is None:
                raise InvalidRequestError(
                    f"{spec.model_type} norms K before RoPE, and vLLM's {type(parent).__name__} has no k_norm beside its "
                    "attention for hcache to rebuild K from hidden states (H) with. Give plan 'KV'"
                )
            self._layers[index] = _Layer(
                qkv, rotary, (spec.num_heads * spec.head_size, spec.kv_dim, spec.kv_dim), k_norm
            )
            if index in capture:
                self._hooks.append(qkv.register_forward_pre_hook(self._hook(index)))

    def _hook(self, index: int):
        def keep(_module, args):
            if self._slots is None:
                return
            if self._rows is None:
                self._rows = self._find_rows(args[0].device)
            if self._rows is not None:
                self._captured[index] = args[0].index_select(0, self._rows)  # a copy: vLLM may reuse its buffer

        return keep

    def select(self, slots: torch.Tensor | None) -> None:
        """Capture, in the coming forward, the rows of the tokens written to cache ``slots`` (kernel block ×
        its tokens + offset, as vLLM's slot mapping counts them; None: none), in that order."""
        self._slots, self._rows, self.held, self._captured = slots, None, None, {}

    def _find_rows(self, device: torch.device) -> torch.Tensor | None:
        """The selected tokens' rows in the forward's batch, from its slot mapping, which vLLM sets for the
        forward (before it: the batch's order is the model runner's, not the scheduler's)."""
        from vllm.forward_context import get_forward_context

        mapping = get_forward_context().slot_mapping
        slots = mapping.get(self._slot_layer) if isinstance(mapping, dict) else None
        if slots is None:  # a micro-batched forward: the saver finds its H layers missing and saves none of it
            log.warning(
                "hcache: this forward has no slot mapping for %s; its hidden states are not saved", self._slot_layer
            )
            return None
        rows, self.held = batch_rows(slots, self._slots)
        return rows.to(device)

    def captured(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s input rows of the selected tokens ``[T, D]``, once its projection ran."""
        return self._captured.pop(layer, None)

    @torch.no_grad()
    def rebuild(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """K/V rows ``[T, 2, H, C]`` of tokens at ``positions`` from their hidden states ``[T, D]``: the layer's
        own projection (its Q columns dropped), then K rotated by the layer's own RoPE, as vLLM's forward does."""
        part = self._layers[layer]
        out, _ = part.qkv.forward(hidden)  # not through __call__: the capture hook is for the forward's own rows
        _, k, v = out.split(part.split, dim=-1)
        if part.k_norm is not None:  # by head, as the forward norms K
            k = part.k_norm(k.unflatten(-1, (-1, self._head_size))).flatten(-2)
        k, _ = part.rotary(positions, k.contiguous(), None)  # K rotated as vLLM rotates a query: the same rule per head
        return torch.stack((k, v), dim=1).unflatten(-1, (-1, self._head_size))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
