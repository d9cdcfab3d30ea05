"""A short identity for a model's weights and dtype, so stored state is never served to another model."""
from __future__ import annotations

import hashlib

import torch

from .model_spec import ModelSpec

_SAMPLES_PER_TENSOR = 4096


@torch.no_grad()
def model_fingerprint(model: torch.nn.Module, spec: ModelSpec) -> str:
    """BLAKE2b over the model description, every tensor's name, shape and dtype, and a strided sample of
    its values. Sampling keeps this cheap for multi-GB models on a GPU; any retrained or re-quantised
    weights change the samples."""
    h = hashlib.blake2b(spec.to_json().encode(), digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLES_PER_TENSOR)][:_SAMPLES_PER_TENSOR]
        h.update(sample.float().cpu().numpy().tobytes())
    return h.hexdigest()
