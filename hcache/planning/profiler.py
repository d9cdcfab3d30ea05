"""``hcache profile``: measure a model's per-layer restore costs on this machine (§4.1.2's offline profiling).

Every cost is measured through the same code a restore runs, so the scheduler plans with what restore
will actually take:
- ``io_h`` / ``io_kv``: a layer's rows loaded by the host tier's readers from chunk files in the store's
  own directories into the host pool (one O_DIRECT request per chunk where the filesystem allows it, so
  from the disk, not the page cache), verified, and copied to the device, averaged over several layers per
  chunk;
- ``c_h``: the engine's ``restore_from_hidden`` (K/V GEMM, RoPE, scatter);
- ``c_kv``: the engine's ``restore_kv`` (scatter);
- ``c_h8`` / ``c_kv8``: the same from rows stored in 8 bits (``stored_dtype="8bit"``: fp8 H, int8 KV),
  dequantisation included; the I/O of 8-bit rows is the lossless I/O scaled to their bytes;
- ``c_token``: the engine's forward of an attention layer over the whole history, attention included;
- ``c_token_recurrent``: a hybrid's, of a recurrent layer (its mixer's, a Mamba or gated-delta-net forward).

Costs are measured on the first layer of each kind: the restores of the first attention layer, and the forward
of the first layer of each kind (beyond the first layer, through the reference engine's ``forward_layer``: a
hybrid's, which FastGen does not serve).

With tensor parallelism every rank runs the profiler at once on its shard, and measures its own costs:
its heads' GEMMs, the TP forward, its share of the hidden-state reads (one chunk in TP), and
- ``ag_h``: the all-gather that assembles a layer's hidden states from the ranks.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from contextlib import ExitStack
from typing import Callable

import torch
from tqdm import tqdm

from ..engine.reference import ReferenceEngine
from ..engine.interface import Engine
from ..errors import StorageError
from ..model.loader import LoadedModel
from ..model.tensor_parallel import SINGLE, TPGroup, shard_model
from ..ops.quant import dequantise, quantise
from ..storage.chunk import Chunk, encode
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.disk_store import DiskChunkStore
from ..storage.host_pool import PAGE, HostPool
from ..storage.host_tier import DEFAULT_READERS, HostTier
from ..storage.stored_state import shared_chunks, stored_encodings
from ..transfer.copier import Copier
from .plan import Method
from .profile import C_TOKEN_RECURRENT, COST_NAMES, ENCODED_COST_NAMES, TP_COST_NAMES, Profile

DEFAULT_TOKENS = (256, 1024, 4096, 16384)
SHORT_TOKENS = DEFAULT_TOKENS[:3]  # the profile measured on first use: a minute, not several, on a CPU
_IO_LAYERS = 4  # layers per chunk file in the I/O measurement: reads of several layers overlap, as in a restore
_FINGERPRINT = "hcache-profile"


def default_tokens(max_positions: int, short: bool = False) -> list[int]:
    """The full grid runs to the context limit; the short one stops at 4K (longer histories extrapolate)."""
    if short:
        return sorted({min(t, max_positions) for t in SHORT_TOKENS})
    lengths = [t for t in DEFAULT_TOKENS if t <= max_positions]
    return lengths if lengths and lengths[-1] == max_positions else [*lengths, max_positions]


@torch.no_grad()
def measure_profile(
    loaded: LoadedModel,
    tokens: list[int],
    repeats: int = 3,
    readers: int = DEFAULT_READERS,
    store_dirs: list[str] | None = None,
    tp: TPGroup = SINGLE,
) -> Profile:
    """Measure every cost at each history length in ``tokens``, on the device the model is on. I/O is
    measured in scratch directories inside ``store_dirs`` (the store's disks; default: the temp dir).
    With ``tp`` of several ranks, ``loaded.model`` is sharded in place for this rank."""
    model, spec = shard_model(loaded.model, loaded.spec, tp)
    tokens = profile_tokens(tokens, spec.max_positions, repeats)
    engine = ReferenceEngine(model, spec, num_blocks=2 * -(-max(tokens) // 64) + 2)
    return measure_engine(engine, loaded.name, tokens, repeats, readers, store_dirs, tp)


def profile_tokens(tokens: list[int], max_positions: int, repeats: int) -> list[int]:
    """The history lengths to measure, rounded down to whole chunks; raises ValueError for a bad request."""
    bad = [t for t in tokens if not CHUNK_TOKENS <= t <= max_positions]
    if bad or repeats < 1:
        raise ValueError(f"history lengths must lie in [{CHUNK_TOKENS}, {max_positions}] (got {bad}) and repeats ≥ 1")
    return sorted({t // CHUNK_TOKENS * CHUNK_TOKENS for t in tokens})


@torch.no_grad()
def measure_engine(
    engine: Engine,
    model_name: str,
    tokens: list[int],
    repeats: int = 3,
    readers: int = DEFAULT_READERS,
    store_dirs: list[str] | None = None,
    tp: TPGroup = SINGLE,
) -> Profile:
    """:func:`measure_profile` through any engine (FastGen's, for ``hcache profile --engine fastgen``), at
    history lengths already checked by :func:`profile_tokens`."""
    spec = engine.spec
    dtype = spec.torch_dtype
    layer = next(i for i in range(spec.num_layers) if not spec.is_recurrent(i))  # a hybrid's first may be recurrent
    forwards = {"c_token": layer}  # cost name -> the layer whose forward it times
    recurrent = next((i for i in range(spec.num_layers) if spec.is_recurrent(i)), None)
    if recurrent is not None:
        forwards[C_TOKEN_RECURRENT] = recurrent
    tp_names = TP_COST_NAMES if tp.world_size > 1 else ()
    names = tuple(dict.fromkeys((*COST_NAMES, *ENCODED_COST_NAMES, *tp_names, *forwards)))
    encodings = stored_encodings("8bit")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    gen = torch.Generator().manual_seed(0)
    copier = Copier(engine.device)
    with tqdm(total=len(tokens) * len(names), desc=f"profiling {model_name}", unit="cost") as bar:
        for n in tokens:
            hidden = torch.randn(n, spec.hidden_size, generator=gen).to(engine.device, dtype)
            kv = torch.randn(n, 2, spec.num_kv_heads, spec.head_size, generator=gen).to(engine.device, dtype)
            ids = torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()
            own_hidden = hidden[
                : len(shared_chunks(tp.rank, tp.world_size, n // CHUNK_TOKENS)) * CHUNK_TOKENS
            ]  # this rank's rows
            hidden8, kv8 = quantise(hidden, encodings[Method.H.value]), quantise(kv, encodings[Method.KV.value])
            measures: dict[str, Callable[[], object]] = {
                name: functools.partial(_forward, engine, ids, at) for name, at in forwards.items()
            }
            measures |= {
                "c_h": lambda: engine.restore_from_hidden(0, layer, hidden),
                "c_kv": lambda: engine.restore_kv(0, layer, kv),
                "c_h8": lambda: engine.restore_from_hidden(0, layer, dequantise(hidden8, dtype)),
                "c_kv8": lambda: engine.restore_kv(0, layer, kv8),
            }
            if tp.world_size > 1:
                measures["ag_h"] = lambda: tp.gather_in_turn(own_hidden, n // CHUNK_TOKENS, CHUNK_TOKENS)
            engine.begin_restore(0, n)
            for name, fn in measures.items():
                bar.set_postfix(tokens=n, cost=name)
                seconds[name].append(_median_time(fn, repeats, engine.device))
                bar.update()
            engine.flush(0)
            for fmt, rows in ((Method.H.value, own_hidden), (Method.KV.value, kv)):
                bar.set_postfix(tokens=n, cost=f"io_{fmt.lower()}")
                io = _io_time(fmt, rows, readers, copier, repeats, store_dirs)
                seconds[f"io_{fmt.lower()}"].append(io)
                bar.update()
    n = tokens[-1]
    bandwidth = {
        "io_h_bytes_per_s": own_hidden.shape[0] * spec.hidden_bytes_per_token_layer / seconds["io_h"][-1],
        "io_kv_bytes_per_s": n * spec.kv_bytes_per_token_layer / seconds["io_kv"][-1],
    }
    return Profile.new(model_name, spec, tokens, seconds, bandwidth, tp.world_size)


def _forward(engine: Engine, ids: list[int], layer: int) -> None:
    """RE of ``layer`` alone over ``ids``: the first layer through any engine's RE; a later one (a hybrid's
    first of its kind) through the reference engine's ``forward_layer``."""
    if layer == 0:
        engine.recompute_layers(0, ids, 1)
    else:
        engine.forward_layer(0, ids, layer)


def _median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _io_time(
    fmt: str, rows: torch.Tensor, readers: int, copier: Copier, repeats: int, store_dirs: list[str] | None
) -> float:
    """Seconds per layer to bring ``rows`` (one layer's worth) from chunk files to the device, through the
    host pool, as a restore of chunks not in memory does."""
    with ExitStack() as scratch:
        roots = [
            scratch.enter_context(tempfile.TemporaryDirectory(prefix="hcache-profile-", dir=d))
            for d in (store_dirs or [None])
        ]
        disk = DiskChunkStore(roots, fsync=False)  # what is read is measured, not how safely it was written
        keys = []
        for j in range(rows.shape[0] // CHUNK_TOKENS):
            key = f"{j:032x}"
            part = rows[j * CHUNK_TOKENS : (j + 1) * CHUNK_TOKENS].cpu()
            data = encode(
                Chunk(key, [0] * CHUNK_TOKENS, _FINGERPRINT, {(layer, fmt): part for layer in range(_IO_LAYERS)})
            )
            disk.put(key, data)
            keys.append(key)
        tier = HostTier([disk], HostPool(disk.used_bytes + (len(keys) + 1) * PAGE, pin=copier.cuda), readers=readers)
        scratch.callback(tier.close)

        def read_all() -> None:
            tier.drop_resident()  # from the disk every time
            images = [f.result() for f in [tier.fetch(k) for k in keys]]
            try:
                if None in images:
                    raise StorageError(f"profiling store {roots} lost a chunk it had just written")
                for layer in range(_IO_LAYERS if images else 0):  # a TP rank may hold no chunk's H
                    with copier.side_stream():
                        copier.gather([im.tensor(layer, fmt) for im in images])
            finally:
                copier.drain()
                for im in images:
                    if im is not None:
                        tier.release(im)

        return _median_time(read_all, repeats, rows.device) / _IO_LAYERS
