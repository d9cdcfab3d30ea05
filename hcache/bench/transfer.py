"""The data path alone, against a plain copy of the same bytes, side by side in one run.

- ``kv_restore_vs_copy``: a history held in the host pool restored by the KV plan into the engine's paged
  cache (lookups, references, one copy per chunk and layer, releases), over one torch copy of the same
  bytes from host memory to the device: a pinned host-to-device copy on a GPU, a memcpy on a CPU.
- ``saver_ingest_vs_copy``: a prefill's rows of every layer (hidden states and K/V) handed to the saver
  until every chunk is published, that is restorable from the pool, over the same copy of those bytes.
- ``h_vs_kv`` and ``h_vs_recompute``: restore speed of H over KV and over RE; ``h_vs_bound``: the H restore's
  time over ``max(H bytes / copy bandwidth, the K/V rebuild's time on rows already on the device)``.

Each figure is the median over ``--repeats`` rounds, and every round times all of them in turn, so drift
in the machine's speed touches them alike. The model is a named shape with a few layers: only attention's
shapes matter to these figures, so the MLP and vocabulary are shrunk to keep host memory small.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from ..engine.ragged import Segment
from ..model.loader import LoadedModel, model_dtype, random_model
from ..model.spec import ModelSpec
from ..planning.plan import RestorePlan
from ..serving.restore import restore_prefix
from ..storage.stored_state import row_shapes
from ..serving.runtime import HCacheRuntime
from ..storage.chunk_key import CHUNK_TOKENS, KeyChain, chunk_keys, root_key
from ..storage.store_config import StoreConfig
from ..transfer.saver import ChunkSaver

_NAMESPACE = "hcache-bench-transfer"  # the ingested chunks' keys, apart from the history's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama-2-7b", help="a random shape: llama-2-7b, llama-3-8b, or a model type")
    parser.add_argument("--layers", type=int, default=4, help="layers of that shape to build")
    parser.add_argument("--history", type=int, default=4096, help="history tokens in the host pool")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: float16 on a GPU)")
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    dtype = model_dtype(args.dtype, args.device)
    history = args.history // CHUNK_TOKENS * CHUNK_TOKENS
    if history < CHUNK_TOKENS or args.layers < 1 or args.repeats < 1:
        raise ValueError("--history must be at least 64 tokens, --layers and --repeats at least 1")
    model = random_model(args.shape, dtype, device=args.device, num_hidden_layers=args.layers, intermediate_size=256, vocab_size=1024)
    spec = ModelSpec.from_config(model.config, dtype)
    if history >= spec.max_positions:
        raise ValueError(f"--history must be below the model's {spec.max_positions} positions")
    loaded = LoadedModel(f"random:{args.shape}", model, spec, None)
    device = torch.device(args.device)
    kv_bytes = history * spec.num_layers * spec.kv_bytes_per_token_layer
    h_bytes = history * spec.num_layers * spec.hidden_bytes_per_token_layer
    prompt = torch.randint(0, spec.vocab_size, (history + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    plans = {name: RestorePlan.parse(name, spec.num_layers) for name in ("KV", "H", "RE")}
    times: dict[str, list[float]] = {name: [] for name in ("copy", "KV", "H", "RE", "rebuild", "ingest")}
    host_bytes = 2 * (kv_bytes + h_bytes) + (64 << 20)
    with tempfile.TemporaryDirectory(prefix="hcache-bench-transfer-") as tmp, HCacheRuntime(
        loaded, tmp, save="all", num_blocks=2 * history // CHUNK_TOKENS + 4, device=args.device,
        store=StoreConfig(host_bytes=host_bytes, fsync=False),
    ) as runtime:  # fmt: skip
        runtime.generate(prompt, 1, restore=False)  # the history's chunks, every format, now in the host pool
        runtime.store.flush()
        engine, tier, copier = runtime.engine, runtime.store, runtime.stack.copier
        keys = chunk_keys(prompt[:history], root_key(runtime.fingerprint))
        src = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
        dst = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
        gen = torch.Generator().manual_seed(1)
        hidden = [torch.randn(history, spec.hidden_size, generator=gen).to(device, dtype) for _ in range(spec.num_layers)]
        kv_rows = [torch.randn(history, *row_shapes(spec)["KV"], generator=gen).to(device, dtype) for _ in range(spec.num_layers)]

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
        for _ in tqdm(range(args.repeats + 1), desc="transfer rounds", leave=False):  # the first warms up
            for name, fn in measures.items():
                _sync(device)
                began = time.perf_counter()
                fn()
                _sync(device)
                times[name].append(time.perf_counter() - began)
                engine.flush(1)
                if name == "ingest":
                    _forget_ingested(tier, runtime.fingerprint, history)
    t = {name: statistics.median(v[1:]) for name, v in times.items()}
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
