"""A CPU load's KV writes, in a process of its own.

On a CPU, a load's gathers and cache writes are the CPU's own work (no DMA engine does them), and on a
thread of the engine's process that work shares the GIL with the forward's Python: every torch call the
thread makes hands the GIL back, and takes it again from the forward's thread, which then waits (spot
checks on a 2-vCPU VM: some 45 waits a 4K-token load, about 90 µs each). A process of its own has a GIL
of its own. It maps the same memory, not a copy: the host pool's arena (a memfd,
:class:`~hcache.storage.host_pool.HostPool`'s ``shareable``) and the paged caches, which :func:`share`
moves onto memfds in place when the process starts: the tensors the engine registered, which its
attention layers hold (another tensor on a cache's old storage would keep the old pages; vLLM keeps none). The loader's thread sends it a load's KV layers as plain data
(:meth:`~hcache.paged.load_writes.LoadWrites.message`) and waits on a socket, holding nothing, while it
rebuilds the load's H layers itself (they need the model's weights). The process is a fresh interpreter
(``python -m hcache.paged.copy_process``), not a fork: the engine's process has threads, OpenMP's among
them, that a forked child would inherit in whatever state they were. It ends when the engine closes the
socket, or dies with it.
"""
from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import torch

from .. import helper_threads


_OPENMP_BINDINGS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


class ProcessGone(RuntimeError):
    """The load process exited, or its socket closed: the load it had is not known to have been written."""


def memfd_tensor(nbytes: int, name: str) -> tuple[int, torch.Tensor]:
    """``nbytes`` of fresh memory on a memfd, as a uint8 tensor, and the fd (closed on exec: a child gets it
    only where it is passed, as ``Popen``'s ``pass_fds``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd, torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)


def _mapped(fd: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)


@torch.inference_mode()  # an engine's caches may be inference tensors, which only inference mode may ``set_``
def share(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int]], list[tuple]]:
    """Move the storage of each of ``tensors`` onto a memfd, in place (those sharing one storage still
    share one; tensors not given keep the old one), its contents kept. Returns each storage's ``(fd, nbytes)`` and each tensor's
    ``(storage, element offset, shape, stride, dtype)``, from which another process maps them
    (:func:`_tensors`)."""
    storages: dict[int, tuple[int, torch.Tensor]] = {}
    views = []
    for tensor in tensors:
        old = tensor.untyped_storage()
        if old.data_ptr() not in storages:
            fd, new = memfd_tensor(old.nbytes(), "hcache-paged-cache")
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            storages[old.data_ptr()] = fd, new
        index = list(storages).index(old.data_ptr())
        views.append((index, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype))
    moved = list(storages.values())
    for tensor, (index, offset, shape, stride, _) in zip(tensors, views):
        tensor.set_(moved[index][1].untyped_storage(), offset, shape, stride)
    return [(fd, new.numel()) for fd, new in moved], views


def _tensors(storages: list[tuple[int, int]], views: list[tuple]) -> list[torch.Tensor]:
    mapped = [_mapped(fd, nbytes) for fd, nbytes in storages]
    return [torch.empty(0, dtype=dtype).set_(mapped[index].untyped_storage(), offset, shape, stride) for index, offset, shape, stride, dtype in views]


class CopyProcess:
    """The load process for ``layers`` (:class:`~hcache.paged.loader.PagedLayer`; their caches are moved
    onto memfds here) over the host pool on memfd ``pool_fd`` of ``pool_bytes``. ``depth``: the staging
    buffers it keeps (a pipeline's depth). One load at a time: :meth:`submit`, then :meth:`wait`."""

    def __init__(self, layers: list, pool_fd: int, pool_bytes: int, kernel_block: int, depth: int):
        storages, views = share([layer.cache for layer in layers])
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno(), pool_fd, *(fd for fd, _ in storages)]
        # one thread, bound by :func:`helper_threads.bind_process` alone: not by the engine's OpenMP binding, which vLLM passes its worker
        env = {**{k: v for k, v in os.environ.items() if k not in _OPENMP_BINDINGS}, "OMP_NUM_THREADS": "1"}
        try:
            self._child = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            for fd, _ in storages:
                os.close(fd)  # the mappings keep the memory
        helper_threads.bind_process(self._child.pid)
        self._conn = Connection(ours.detach())
        layouts = {id(layer.layout): (layer.layout.offsets.numpy(), layer.layout.block_stride) for layer in layers}
        self._send({"pool": (pool_fd, pool_bytes), "storages": storages, "kernel_block": kernel_block, "depth": depth, "layouts": layouts,
                    "layers": [(layer.index, view, id(layer.layout), layer.group) for layer, view in zip(layers, views)]})  # fmt: skip
        try:
            self.wait()  # mapped and ready, or why not
        except RuntimeError:
            self.close()
            raise

    def submit(self, message: dict) -> None:
        self._send(message)

    def wait(self) -> None:
        """Until the process has done what it was sent; its error raised here as a RuntimeError, or
        :class:`ProcessGone`."""
        try:
            error = self._conn.recv()
        except (EOFError, OSError) as e:
            raise ProcessGone(f"the load process is gone ({e!r})") from e
        if error is not None:
            raise RuntimeError(f"the load process failed: {error}")

    def _send(self, message: dict) -> None:
        try:
            self._conn.send(message)
        except OSError as e:
            raise ProcessGone(f"the load process is gone ({e!r})") from e

    def returncode(self) -> int | None:
        return self._child.poll()

    def close(self) -> None:
        self._conn.close()  # the process ends at the socket's end
        try:
            self._child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()


def _serve(conn: Connection) -> None:
    from ..transfer.scratch import Scratch
    from .layout import PagedLayout
    from .load_writes import LoadWrites, PagedLayer

    torch.set_num_threads(1)
    setup = conn.recv()
    try:
        arena = _mapped(*setup["pool"])
        caches = _tensors(setup["storages"], [view for _, view, _, _ in setup["layers"]])
        layouts = {key: PagedLayout(torch.from_numpy(offsets), stride) for key, (offsets, stride) in setup["layouts"].items()}
        layers = {index: PagedLayer(index, cache, layouts[layout], group) for (index, _, layout, group), cache in zip(setup["layers"], caches)}
        scratch, kernel_block = Scratch(setup["depth"]), setup["kernel_block"]
    except Exception as e:  # noqa: BLE001  told to the engine, which loads on its own thread then
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send(None)
    with torch.inference_mode():
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the engine closed the socket, or died
                return
            try:
                writes, jobs = LoadWrites.received(message, arena, layers, kernel_block, scratch)
                scratch.rewind()
                for item in jobs:
                    writes.stage(item)
                conn.send(None)
            except Exception as e:  # noqa: BLE001  the load's blocks are then load errors, recomputed
                conn.send(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
