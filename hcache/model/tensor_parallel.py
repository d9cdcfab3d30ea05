"""Tensor parallelism: a rank's group and its shard of the model.

The model is split Megatron-style over HF's own modules: q/k/v and gate/up (OPT: fc1) are split by output
rows (column-parallel), so rank ``r`` holds q heads ``[r·h/tp, (r+1)·h/tp)`` and KV heads likewise; o and
down (OPT: fc2) are split by input columns (row-parallel) and their partial outputs are summed with
``all_reduce``. Embeddings, norms and the LM head are replicated. A ReferenceEngine over the shard thus
caches only the rank's KV heads, and its forward gives TP=1's logits. Which rank stores which rows is the
storage layer's rule (:func:`hcache.storage.stored_state.stores`); :meth:`TPGroup.gather_in_turn` is its collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedModelError
from .spec import ModelSpec

# Per family: the MLP's column-parallel and row-parallel linears, inside a layer.
_MLP = {
    "llama": (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
    "mistral": (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
    "qwen2": (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
    "opt": (("fc1",), "fc2"),
}


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group over ``torch.distributed`` (gloo on a CPU, NCCL on
    GPUs). ``world_size == 1`` needs no process group: every collective is then the identity."""

    rank: int = 0
    world_size: int = 1
    group: object = None  # a torch.distributed process group; None: the default one

    @classmethod
    def current(cls, group: object = None) -> "TPGroup":
        """The group of an initialised ``torch.distributed``."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    # ---- collectives ---------------------------------------------------------------------------------
    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def min(self, value: int) -> int:
        """The least ``value`` over the ranks: what every rank can agree on."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[world_size, *t.shape]``: every rank's ``t``, in rank order."""
        if self.world_size == 1:
            return t[None]
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def _device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def gather_in_turn(self, rows: torch.Tensor, n: int, block: int, first: int = 0) -> torch.Tensor:
        """All ``n`` blocks of ``block`` rows ``[n·block, D]`` in order, from each rank's rows of the blocks
        it holds in turn (block ``first + i·tp + k`` is row block ``i`` of rank ``(first + k) % tp``)."""
        if self.world_size == 1:
            return rows
        per_rank = -(-n // self.world_size) * block  # ranks hold one block more or less: pad to equal
        padded = torch.nn.functional.pad(rows, (0, 0, 0, per_rank - rows.shape[0]))
        gathered = self.all_gather(padded).view(self.world_size, -1, block, rows.shape[-1])
        in_turn = [(first + k) % self.world_size for k in range(self.world_size)]
        return gathered[in_turn].transpose(0, 1).reshape(-1, rows.shape[-1])[: n * block]

    def fingerprint(self, model_fingerprint: str) -> str:
        """The fingerprint this rank's chunks carry and its key chain is rooted in: a rank serves only
        chunks saved by the same rank of the same layout, since they hold its heads and its chunks."""
        if self.world_size == 1:
            return model_fingerprint
        return f"{model_fingerprint}{_LAYOUT}{self.world_size}.{self.rank}"


_LAYOUT = "|tp"  # what a rank's fingerprint adds to the model's


def model_fingerprint(fingerprint: str) -> str:
    """The model's fingerprint in a rank's (:meth:`TPGroup.fingerprint`): the same at every layout."""
    return fingerprint.partition(_LAYOUT)[0]


SINGLE = TPGroup()


class RowParallel(nn.Module):
    """A row-parallel linear: the rank's partial product, summed over the group."""

    def __init__(self, linear: nn.Linear, tp: TPGroup):
        super().__init__()
        self.linear, self.tp = linear, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce_(self.linear(x))


def shard_heads(spec: ModelSpec, size: int) -> ModelSpec:
    """The attention of one rank of ``size``: its share of the q heads, and of the KV heads, or one of them
    where there are fewer KV heads than ranks (each then held by ``size / num_kv_heads`` ranks, as vLLM
    and Megatron replicate them)."""
    if spec.num_heads % size or (spec.num_kv_heads % size and size % spec.num_kv_heads):
        raise UnsupportedModelError(
            f"tensor parallelism of degree {size} needs the {spec.num_heads} attention heads to divide by it, and the "
            f"{spec.num_kv_heads} KV heads to divide by it or it by them"
        )
    return dataclasses.replace(spec, num_heads=spec.num_heads // size, num_kv_heads=max(1, spec.num_kv_heads // size))


def local_spec(spec: ModelSpec, tp: TPGroup) -> ModelSpec:
    """The spec of one rank's shard made by :func:`shard_model`, which splits the KV heads, never replicates them."""
    if spec.num_kv_heads % tp.world_size:
        raise UnsupportedModelError(
            f"tensor parallelism of degree {tp.world_size} needs the {spec.num_kv_heads} KV heads to divide by it"
        )
    if spec.model_type not in _MLP or spec.k_weight.module == spec.v_weight.module:
        raise UnsupportedModelError(
            f"tensor-parallel restore supports {', '.join(sorted(_MLP))} (separate q/k/v), not {spec.model_type}"
        )
    return shard_heads(spec, tp.world_size)


@torch.no_grad()
def shard_model(model: nn.Module, spec: ModelSpec, tp: TPGroup) -> tuple[nn.Module, ModelSpec]:
    """Shard ``model`` in place for rank ``tp.rank`` (no second copy of the weights) and return it with
    its :func:`local_spec`."""
    if tp.world_size == 1:
        return model, spec
    shard_spec = local_spec(spec, tp)
    columns, row = _MLP[spec.model_type]
    q_dim, kv_dim = shard_spec.num_heads * spec.head_size, shard_spec.kv_dim
    for layer in model.get_submodule(spec.layers_prefix):
        _split_rows(layer.get_submodule(spec.q_weight.module), q_dim * tp.rank, q_dim)
        for rows in (spec.k_weight, spec.v_weight):
            _split_rows(layer.get_submodule(rows.module), kv_dim * tp.rank, kv_dim)
        for name in columns:
            module = layer.get_submodule(name)
            size, rest = divmod(module.out_features, tp.world_size)
            if rest:
                raise UnsupportedModelError(
                    f"{name} has {module.out_features} outputs, not divisible by {tp.world_size}"
                )
            _split_rows(module, size * tp.rank, size)
        for name in (spec.o_module, row):
            _make_row_parallel(layer, name, tp)
    return model, shard_spec


def _split_rows(linear: nn.Linear, start: int, size: int) -> None:
    linear.weight = nn.Parameter(linear.weight[start : start + size].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[start : start + size].clone(), requires_grad=False)
    linear.out_features = size


def _make_row_parallel(layer: nn.Module, name: str, tp: TPGroup) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    linear = getattr(parent, attr)
    size = linear.in_features // tp.world_size
    linear.weight = nn.Parameter(linear.weight[:, size * tp.rank : size * (tp.rank + 1)].clone(), requires_grad=False)
    linear.in_features = size
    if linear.bias is not None and tp.rank != 0:  # the sum over ranks adds the bias once
        linear.bias = None
    setattr(parent, attr, RowParallel(linear, tp))
