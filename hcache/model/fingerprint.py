"""A short identity for a model's weights and dtype, so stored state is never served to another model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..errors import ModelNotFoundError
from .spec import ModelSpec

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


def checkpoint_fingerprint(path: str | Path, spec: ModelSpec) -> str:
    """:func:`model_fingerprint`'s counterpart for an engine that loads the weights itself (FastGen), over
    the checkpoint's safetensors files: every tensor's name, shape and dtype, and its first row. Engines
    round differently, so state saved by one is not served to the other: their fingerprints differ."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors checkpoint in {path}: hcache fingerprints the weights it serves")
    h = hashlib.blake2b(f"checkpoint|{spec.to_json()}".encode(), digest_size=16)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                part = f.get_slice(name)
                shape = part.get_shape()
                h.update(f"{name}|{tuple(shape)}|{part.get_dtype()}".encode())
                first = part[:1] if len(shape) > 1 else part[:_SAMPLES_PER_TENSOR]
                h.update(first.float().numpy().tobytes())
    return h.hexdigest()
