"""A CPU load's KV writes, in a process of its own.

On a CPU, a load's gathers and cache writes are the CPU's own work (no DMA engine does them), and on a
thread of the engine's process that work shares the GIL with the forward's Python: every torch call the
thread makes hands the GIL back, and takes it again from the forward's thread, which then waits (spot
checks on a 2-vCPU VM: some 45 waits a 4K-token load, about 90 µs each). A process of its own has a GIL
of its own. It maps the same memory, not a copy: the host pool's arena (a memfd,
:class:`~hcache.storage.host_pool.HostPool`'s ``shareable``) and the paged caches, which :func:`share`
moves onto memfds in place when the process starts: the tensors the engine registered, which its
attention layers hold (another tensor on a cache's old storage would keep the old pages; vLLM keeps none). The loader's thread sends it a load's KV layers as plain data
(:meth:`~hcache.paged.target.PagedTarget.message`) and waits on a socket, holding nothing, while it
rebuilds the load's H layers itself (they need the model's weights). The process is a fresh interpreter
(``python -m hcache.paged.copy_process``), not a fork: the engine's process has threads, OpenMP's among
them, that a forked child would inherit in whatever state they were. It ends when the engine closes the
socket, or dies with it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import torch

from ..machine import helper_threads
from ..storage.shared_memory import mapped, memfd


_OPENMP_BINDINGS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
MOVE_BYTES = 64 << 20  # a cache is moved this much at a time, each piece's old pages handed back once copied
START_S = 120.0  # a process not started by then (a fresh interpreter importing torch) is taken for hung
REPLY_S = 120.0  # and one that has not written a load by then


class ProcessGone(RuntimeError):
    """The load process exited, or its socket closed: the load it had is not known to have been written."""


_libc = ctypes.CDLL(None, use_errno=True)


def _discard(address: int, nbytes: int) -> None:
    """Hand back the whole pages of ``[address, address + nbytes)`` (they read as zeros after)."""
    page = mmap.PAGESIZE
    begin, end = -(-address // page) * page, (address + nbytes) // page * page
    if end > begin and _libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


def _moved(old: torch.UntypedStorage) -> tuple[int, torch.Tensor]:
    """A memfd holding ``old``'s bytes, and its mapping: copied a piece at a time, each piece's old pages
    handed back once copied, so the move needs a piece more than the cache, not twice it (a CPU engine's
    cache is sized to the memory it has). Nothing reads ``old`` after: it is a cache registered before
    any request has run, whose tensors are then moved."""
    nbytes = old.nbytes()
    fd = memfd(nbytes, "hcache-paged-cache")
    try:
        new, source = mapped(fd, nbytes), torch.empty(0, dtype=torch.uint8).set_(old)
        for begin in range(0, nbytes, MOVE_BYTES):
            end = min(begin + MOVE_BYTES, nbytes)
            new[begin:end].copy_(source[begin:end])
            _discard(source.data_ptr() + begin, end - begin)
    except BaseException:
        os.close(fd)
        raise
    return fd, new


@torch.inference_mode()  # an engine's caches may be inference tensors, which only inference mode may ``set_``
def share(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int]], list[tuple]]:
    """Move the storage of each of ``tensors`` onto a memfd, in place (those sharing one storage still
    share one), its contents kept; the old storage's pages are handed back (a tensor not given that views it
    reads zeros). Returns each storage's ``(fd, nbytes)`` and each tensor's
    ``(storage, element offset, shape, stride, dtype)``, from which another process maps them
    (:func:`_tensors`)."""
    storages: dict[int, tuple[int, torch.Tensor]] = {}
    views = []
    try:
        for tensor in tensors:
            old = tensor.untyped_storage()
            if old.data_ptr() not in storages:
                storages[old.data_ptr()] = _moved(old)
            index = list(storages).index(old.data_ptr())
            views.append((index, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype))
    except BaseException:
        for fd, _ in storages.values():
            os.close(fd)
        raise
    moved = list(storages.values())
    for tensor, (index, offset, shape, stride, _) in zip(tensors, views):
        tensor.set_(moved[index][1].untyped_storage(), offset, shape, stride)
    return [(fd, new.numel()) for fd, new in moved], views


def _tensors(storages: list[tuple[int, int]], views: list[tuple]) -> list[torch.Tensor]:
    maps = [mapped(fd, nbytes) for fd, nbytes in storages]
    return [
        torch.empty(0, dtype=dtype).set_(maps[index].untyped_storage(), offset, shape, stride)
        for index, offset, shape, stride, dtype in views
    ]


class CopyProcess:
    """The load process for ``layers`` (:class:`~hcache.paged.target.PagedLayer`; their caches are
    moved onto memfds here) over the host pool on memfd ``pool_fd`` of ``pool_bytes``. ``depth``: the
    staging buffers it keeps (a pipeline's depth). One load at a time: :meth:`submit`, then :meth:`wait`."""

    def __init__(self, layers: list, pool_fd: int, pool_bytes: int, kernel_block: int, depth: int):
        storages, views = share([layer.cache for layer in layers])
        self._child: subprocess.Popen | None = None
        try:
            ours, theirs = socket.socketpair()
            self._conn = Connection(ours.detach())
            try:
                fds = [theirs.fileno(), pool_fd, *(fd for fd, _ in storages)]
                # one thread, bound by :func:`helper_threads.bind_process` alone: not by the engine's OpenMP binding, which vLLM passes its worker
                env = {**{k: v for k, v in os.environ.items() if k not in _OPENMP_BINDINGS}, "OMP_NUM_THREADS": "1"}
                self._child = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno())],
                    pass_fds=fds,
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            finally:
                theirs.close()
            helper_threads.bind_process(self._child.pid)
            layouts = {id(layer.layout): (layer.layout.offsets.numpy(), layer.layout.block_stride) for layer in layers}
            self._send(
                {
                    "pool": (pool_fd, pool_bytes),
                    "storages": storages,
                    "kernel_block": kernel_block,
                    "depth": depth,
                    "layouts": layouts,
                    "layers": [
                        (layer.index, view, id(layer.layout), layer.group) for layer, view in zip(layers, views)
                    ],
                }
            )
            self.wait(START_S)  # mapped and ready, or why not
        except BaseException:
            self.close()
            raise
        finally:
            for fd, _ in storages:
                os.close(fd)  # the mappings keep the memory

    def submit(self, message: dict) -> None:
        self._send(message)

    def wait(self, timeout: float | None = None) -> None:
        """Until the process has done what it was sent; its error raised here as a RuntimeError, or
        :class:`ProcessGone` (a process silent for ``timeout`` seconds, :data:`REPLY_S` by default, is
        killed first: nothing it does after the load is reported)."""
        timeout = REPLY_S if timeout is None else timeout
        try:
            if not self._conn.poll(timeout):
                self._child.kill()
                raise ProcessGone(f"the load process did not answer in {timeout:g} s; killed")
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
        if getattr(self, "_conn", None) is not None:
            self._conn.close()  # the process ends at the socket's end
        if self._child is None:
            return
        try:
            self._child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()


def _serve(conn: Connection) -> None:
    from ..transfer.scratch import Scratch
    from ..ops.paged_layout import PagedLayout
    from .target import PagedLayer, PagedTarget

    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # a Ctrl-C to the engine's process group: the engine ends it, after its load
    torch.set_num_threads(1)
    setup = conn.recv()
    try:
        arena = mapped(*setup["pool"])
        caches = _tensors(setup["storages"], [view for _, view, _, _ in setup["layers"]])
        for fd in [setup["pool"][0], *(fd for fd, _ in setup["storages"])]:
            os.close(fd)  # the mappings keep the memory
        layouts = {
            key: PagedLayout(torch.from_numpy(offsets), stride) for key, (offsets, stride) in setup["layouts"].items()
        }
        layers = {
            index: PagedLayer(index, cache, layouts[layout], group)
            for (index, _, layout, group), cache in zip(setup["layers"], caches)
        }
        scratch, kernel_block = Scratch(setup["depth"]), setup["kernel_block"]
    except Exception as e:  # noqa: BLE001  told to the engine, which loads on its own thread then
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send(None)
    with torch.inference_mode():
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the engine closed the socket, or died
                return
            try:
                target, rows, jobs = PagedTarget.received(message, arena, layers, kernel_block, scratch)
                scratch.rewind()
                for job in jobs:
                    target.write_kv(job, rows)
                conn.send(None)
            except Exception as e:  # noqa: BLE001  the load's blocks are then load errors, recomputed
                conn.send(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
