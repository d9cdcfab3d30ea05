"""Counting what a restore or a save would ask of a GPU, on a CPU, at the aten dispatch level: device ops
and host syncs, where a tensor is a *host* tensor iff its storage is hcache's host pool (the rule and why:
tests/serving/test_gpu_budgets.py)."""

import collections
import contextlib
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hcache.ops import device_copy

# ``item`` is how ``.item()``, ``int()`` and ``float()`` of a tensor dispatch under inference mode
# (``_local_scalar_dense`` outside it); ``is_nonzero`` is ``bool()``'s there.
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "equal",
    "is_nonzero",
    "allclose",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
}
HOST_READS = ("tolist", "cpu", "numpy")


class Counter(TorchDispatchMode):
    """Counts device ops by name, and host syncs with where they happened, while active (see the module doc)."""

    def __init__(self, host: torch.Tensor):
        super().__init__()
        self.host = host.untyped_storage().data_ptr()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.hostward = 0  # copies into host memory from a device tensor (each a PCIe transfer on a GPU)
        # reads of the host pool onto the device: a copy's each (one DMA), or an op's that reads the pool in
        # place (one kernel, across the bus, whatever it reads)
        self.deviceward = 0
        self._apart = 0

    @contextlib.contextmanager
    def apart(self):
        """Nothing counted meanwhile: the engine's own compute (a recompute's layers) inside what is counted."""
        self._apart += 1
        try:
            yield
        finally:
            self._apart -= 1

    def on_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.host

    def sync(self, what: str) -> None:
        import traceback

        frame = next(f for f in reversed(traceback.extract_stack()[:-2]) if "/hcache/" in f.filename)
        self.syncs[f"{what} at {os.path.basename(frame.filename)}:{frame.lineno}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._apart:
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        device = [t for t in tensors if not self.on_host(t)]
        name = func.overloadpacket.__name__
        if device and not func.is_view:
            self.ops[name] += 1
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        )
        if device and (name in SYNC_OPS or bool_index):
            self.sync(name)
        if name in ("copy_", "_foreach_copy_"):
            pairs = list(zip(args[0], args[1]) if name == "_foreach_copy_" else [(args[0], args[1])])
            hostward = sum(self.on_host(dst) and not self.on_host(src) for dst, src in pairs)
            self.hostward += hostward
            self.deviceward += sum(self.on_host(src) and not self.on_host(dst) for dst, src in pairs)
            if hostward and not kwargs.get("non_blocking", len(args) > 2 and args[2]):
                self.sync("blocking hostward copy")
        elif (
            device
            and not func.is_view
            and any(isinstance(t, torch.Tensor) and self.on_host(t) for t in torch.utils._pytree.tree_leaves(args))
        ):
            self.deviceward += 1
        return out


@contextlib.contextmanager
def counting(counter: Counter, monkeypatch):
    """``counter`` active, and ``tolist``/``cpu``/``numpy`` of device tensors counted as syncs."""
    with monkeypatch.context() as m:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def read(self, *args, _original=original, _name=name, **kwargs):
                if not counter.on_host(self):
                    counter.sync(_name)
                return _original(self, *args, **kwargs)

            m.setattr(torch.Tensor, name, read)
        with counter:
            yield counter


class FakeCuda:
    """Streams and events that count their construction and do nothing else (copies run inline), installed
    with hcache's copy paths taking their GPU branches on the CPU (:func:`~hcache.ops.device_copy.uses_streams`)."""

    def __init__(self, monkeypatch):
        self.made = collections.Counter()
        fake = self

        self.log: list[str] = []

        class Stream:
            def __init__(self, *args, **kwargs):
                fake.made["Stream"] += 1

            def wait_stream(self, other):
                fake.log.append("copies wait for compute")

            def wait_event(self, event): ...
            def synchronize(self): ...

        class Event:
            def __init__(self, *args, **kwargs):
                fake.made["Event"] += 1

            def record(self, stream=None): ...
            def synchronize(self): ...

        compute = object.__new__(Stream)  # the current stream: not made by hcache
        monkeypatch.setattr(device_copy, "uses_streams", lambda device: True)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
        pin = torch.Tensor.pin_memory
        monkeypatch.setattr(
            torch.Tensor, "pin_memory", lambda self, *a: (fake.made.update(["pin_memory"]), pin(self, *a))[1]
        )
