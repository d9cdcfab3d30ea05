"""The two device-copy primitives every copy path shares: whether a device orders copies by streams and
events, and one batched gather of rows onto a device. In one module, so the CPU suite can make every path
take its GPU branch by replacing :func:`uses_streams` here."""
from __future__ import annotations

import torch


def uses_streams(device: torch.device) -> bool:
    """Whether copies to and from ``device`` run on side streams ordered by events: a GPU's. The one test
    of it in hcache's copy paths, so the CPU suite can drive those paths with counting fake streams."""
    return device.type == "cuda"


def gather(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The parts' rows, in order, as one new tensor on ``device``: one batched call, one copy per part."""
    lengths = [p.shape[0] for p in parts]
    out = torch.empty((sum(lengths), *parts[0].shape[1:]), dtype=parts[0].dtype, device=device)
    torch._foreach_copy_(list(out.split(lengths)), parts, non_blocking=True)
    return out
