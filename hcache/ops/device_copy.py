"""The device-copy primitives every copy path shares: whether a device orders copies by streams and events,
one batched gather of rows onto a device, and a GPU's view of pinned host memory. In one module, so the CPU
suite can make every path take its GPU branch by replacing :func:`uses_streams` here."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91  # CUdevice_attribute


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


def host_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``host``'s whole storage as a uint8 tensor on GPU ``device``, over the same pinned and mapped pages
    (zero-copy, through unified addressing): a kernel reads them across the bus itself, so one gather reads
    the rows of many pinned slots in one launch where copying them takes a DMA each (LMCache's GPU connector
    reads host memory so). None off a GPU, for memory not pinned, or where the device cannot address
    registered memory by its host pointer."""
    if device.type != "cuda" or not host.is_pinned():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _addresses_host_pointers(index):
        return None
    storage = host.untyped_storage()
    interface = {"shape": (storage.nbytes(),), "typestr": "|u1", "data": (storage.data_ptr(), False), "version": 3}
    alias = torch.as_tensor(_CudaArray(interface, storage), device=device)
    return alias if alias.device == torch.device("cuda", index) else None


class _CudaArray:
    """Memory a GPU addresses, as ``torch.as_tensor`` takes it; it keeps the host storage alive."""

    def __init__(self, interface: dict, storage: torch.UntypedStorage):
        self.__cuda_array_interface__, self.storage = interface, storage


@functools.cache
def _addresses_host_pointers(index: int) -> bool:
    """Whether GPU ``index`` reads registered host memory at its host address (x86 hosts' GPUs do)."""
    value = ctypes.c_int()
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return driver.cuDeviceGetAttribute(ctypes.byref(value), _CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, index) == 0 and (
        value.value == 1
    )
