"""The two device-copy primitives every copy path shares: whether a device orders copies by streams and
events, and one batched gather of rows onto a device. In one module, so the CPU suite can make every path
take its GPU branch by replacing :func:`uses_streams` here."""

from __future__ import annotations

from collections.abc import Callable

import torch


def uses_streams(device: torch.device) -> bool:
    """Whether copies to and from ``device`` run on side streams ordered by events: a GPU's. The one test
    of it in hcache's copy paths, so the CPU suite can drive those paths with counting fake streams."""
    return device.type == "cuda"


def gather(parts: list[torch.Tensor], device: torch.device, empty: Callable | None = None) -> torch.Tensor:
    """The parts' rows, in order, as one tensor on ``device``: one call, a batched copy to a GPU (one DMA a
    part, from pinned memory), a concatenation on a CPU (one op, where every op a helper thread calls
    hands the GIL to the engine's thread and waits to take it back).
    ``empty(shape, dtype)``: where to put them (a new tensor, by default)."""
    shape, dtype = (sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype
    if not uses_streams(device):
        return torch.cat(parts) if empty is None else torch.cat(parts, out=empty(shape, dtype))
    out = torch.empty(shape, dtype=dtype, device=device) if empty is None else empty(shape, dtype)
    torch._foreach_copy_(list(out.split([p.shape[0] for p in parts])), parts, non_blocking=True)
    return out
