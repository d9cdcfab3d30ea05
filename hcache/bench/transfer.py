"""The data path alone, against a plain copy of the same bytes, side by side in one run.

- ``kv_restore_vs_copy``: a history held in the host pool restored by the KV plan into the engine's paged
  cache (lookups, references, one copy per chunk and layer, releases), over one torch copy of the same
  bytes from host memory to the device: a pinned host-to-device copy on a GPU, a memcpy on a CPU.
- ``saver_ingest_vs_copy``: a prefill's rows of every layer (hidden states and K/V) handed to the saver
  until every chunk is published, that is restorable from the pool, over the same copy of those bytes.
- ``h_vs_kv`` and ``h_vs_recompute``: restore speed of H over KV and over RE; ``h_vs_bound``: the H restore's
  time over ``max(H bytes / copy bandwidth, the K/V rebuild's time on rows already on the device)``.

Each figure is the median over ``--repeats`` rounds, and every round times all of them in turn, so drift
in the machine's speed touches them alike. The model: :mod:`hcache.bench._shaped`.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from ..engine.ragged import Segment
from ..model.spec import ModelSpec
from ..planning.plan import RestorePlan
from ..serving.restore import restore_prefix
from ..serving.runtime import HCacheRuntime
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain, chunk_keys, root_key
from ..storage.store_config import StoreConfig
from ..planning.plan import row_shapes
from ..transfer.saver import ChunkSaver
from . import _shaped

_NAMESPACE = "hcache-bench-transfer"  # the ingested chunks' keys, apart from the history's


add_arguments = _shaped.add_arguments


def run(args: argparse.Namespace) -> dict:
    shape = _shaped.shaped(args)
    loaded, history, device, dtype = shape.loaded, shape.history, shape.device, shape.dtype
    spec = loaded.spec
    kv_bytes = history * spec.kv_bytes_per_token
    h_bytes = history * spec.num_layers * spec.hidden_bytes_per_token_layer
    prompt = torch.randint(0, spec.vocab_size, (history + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    plans = {name: RestorePlan.parse(name, spec.num_layers) for name in ("KV", "H", "RE")}
    host_bytes = 2 * (kv_bytes + h_bytes) + (64 << 20)
    with (
        tempfile.TemporaryDirectory(prefix="hcache-bench-transfer-") as tmp,
        HCacheRuntime(
            loaded,
            tmp,
            save="all",
            num_blocks=2 * history // CHUNK_TOKENS + 4,
            device=args.device,
            store=StoreConfig(host_bytes=host_bytes, fsync=False),
        ) as runtime,
    ):
        runtime.generate(prompt, 1, restore=False)  # the history's chunks, every format, now in the host pool
        runtime.store.flush()
        engine, tier, copier = runtime.engine, runtime.store, runtime.stack.copier
        keys = chunk_keys(prompt[:history], root_key(runtime.fingerprint))
        src = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
        dst = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
        gen = torch.Generator().manual_seed(1)
        hidden = [
            torch.randn(history, spec.hidden_size, generator=gen).to(device, dtype) for _ in range(spec.num_layers)
        ]
        kv_rows = [
            torch.randn(history, *row_shapes(spec)["KV"], generator=gen).to(device, dtype)
            for _ in range(spec.num_layers)
        ]

        def restore(plan: RestorePlan) -> None:
            outcome = restore_prefix(engine, tier, 1, prompt, keys, runtime.fingerprint, plan, copier, limit=history)
            assert outcome.tokens == history and outcome.fallback is None, outcome

        def rebuild() -> None:  # H's compute alone: the K/V GEMM, RoPE and scatter of rows already on the device
            engine.begin_restore(1, history)
            for layer, rows in enumerate(hidden):
                engine.restore_from_hidden(1, layer, rows)

        measures = {
            "copy": lambda: dst.copy_(src, non_blocking=True),
            **{name: (lambda p=plan: restore(p)) for name, plan in plans.items()},
            "rebuild": rebuild,
            "ingest": lambda: _ingest(tier, runtime.fingerprint, spec, hidden, kv_rows),
        }

        def after(name: str) -> None:
            engine.flush(1)
            if name == "ingest":
                _forget_ingested(tier, runtime.fingerprint, history)

        t = _shaped.timed_rounds(measures, args.repeats, device, "transfer rounds", after)
    ingest_bytes = kv_bytes + h_bytes
    copy_bw = kv_bytes / t["copy"]
    result = {
        "shape": args.shape,
        "layers": spec.num_layers,
        "history": history,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "copy_gb_s": copy_bw / 1e9,
        "kv_restore_gb_s": kv_bytes / t["KV"] / 1e9,
        "kv_restore_vs_copy": t["copy"] / t["KV"],
        "saver_ingest_gb_s": ingest_bytes / t["ingest"] / 1e9,
        "saver_ingest_vs_copy": (ingest_bytes / copy_bw) / t["ingest"],
        "restore_s": {name: t[name] for name in plans},
        "h_vs_kv": t["KV"] / t["H"],
        "h_vs_recompute": t["RE"] / t["H"],
        "h_vs_bound": t["H"] / max(h_bytes / copy_bw, t["rebuild"]),
        "repeats": args.repeats,
    }
    print(
        f"{args.shape} x {spec.num_layers} layers, {history}-token history, {device} {result['dtype']}\n"
        f"copy of the same bytes: {result['copy_gb_s']:.2f} GB/s\n"
        f"KV restore from the host pool: {result['kv_restore_gb_s']:.2f} GB/s = {result['kv_restore_vs_copy']:.2f} of the copy\n"
        f"saver ingest until restorable: {result['saver_ingest_gb_s']:.2f} GB/s = {result['saver_ingest_vs_copy']:.2f} of the copy\n"
        f"H restore: {result['h_vs_kv']:.2f}x KV's speed, {result['h_vs_recompute']:.2f}x recompute's, "
        f"{result['h_vs_bound']:.2f}x its bound\n"
        "absolute figures mean something only on a GPU; compare the ratios, measured side by side"
    )
    return result


def _ingest(tier, fingerprint: str, spec: ModelSpec, hidden: list[torch.Tensor], kv: list[torch.Tensor]) -> None:
    """A prefill's rows through the saver (both stages), until its chunks are published."""
    shapes = row_shapes(spec)
    tensors = [(layer, fmt, shapes[fmt], hidden[0].dtype) for layer in range(spec.num_layers) for fmt in ("H", "KV")]
    saver = ChunkSaver(tier, fingerprint, tensors)
    history = len(hidden[0])
    chain = KeyChain(root_key(fingerprint, _NAMESPACE))
    saver.open(0, chain)
    chain.extend(list(range(history)))
    saver.begin_batch([Segment(0, 0, history, 0)])
    for layer in range(spec.num_layers):
        saver.on_layer(layer, {"H": hidden[layer], "KV": kv[layer]})
    saver.end_batch()
    saver.close(0)
    saver.shutdown()


def _forget_ingested(tier, fingerprint: str, history: int) -> None:
    """Drop what :func:`_ingest` saved, untimed, so every round ingests into the same free pool."""
    tier.flush()
    for key in chunk_keys(list(range(history)), root_key(fingerprint, _NAMESPACE)):
        tier.discard(key)
