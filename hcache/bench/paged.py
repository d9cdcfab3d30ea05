"""The paged loader, vLLM's connector's core (hcache/paged/loader.py), against its floors, side by side in one
run, without vLLM: ``hcache check`` runs it on a GPU at 1K, 4K and 16K tokens of a Llama-2-7B shape.

A history is saved, every format, into the host pool (by hcache's runtime over the reference engine), then
loaded, whole, into a paged cache laid out as vLLM's FlashAttention backend lays it out (16-token blocks),
as the connector's worker loads a returning request off the step:

- ``kv_load_vs_copy``: the KV load (look-ups, verification, one gather per layer from the pool, one scatter
  into the blocks), over one torch copy of the same bytes to the device (pinned host-to-device on a GPU,
  a memcpy on a CPU): 1.0 is the copy's floor.
- ``h_load_vs_bound``: the H load's time over ``max(H bytes / the copy's bandwidth, the rebuild alone)``,
  the rebuild being its K/V GEMM, RoPE and scatter on rows already on the device: 1.0 is bubble-free.
- ``h_vs_kv``: the H load's speed over the KV load's.

Each load is submitted to the loader's thread and waited for (``submit``, ``finished``), as the worker's are.
Each figure is the median over ``--repeats`` rounds, every round timing all of them in turn. The model:
:mod:`hcache.bench._shaped`. Absolute times mean something only on a GPU; compare the ratios.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from ..ops.kv_projection import KVProjection
from ..ops.rope import apply_rope, rope_cos_sin
from ..ops.paged_layout import PagedLayout
from ..paged.load_job import LoadJob
from ..paged.loader import Loader
from ..paged.target import PagedLayer
from ..planning.plan import RestorePlan
from ..restore.records import SequenceRecord
from ..serving.runtime import HCacheRuntime
from ..storage.chunk_key import CHUNK_TOKENS
from ..storage.store_config import StoreConfig
from . import _shaped

BLOCK = 16  # FlashAttention's block in vLLM


add_arguments = _shaped.add_arguments


def run(args: argparse.Namespace) -> dict:
    shape = _shaped.shaped(args)
    loaded, history, device, dtype = shape.loaded, shape.history, shape.device, shape.dtype
    model, spec = loaded.model, loaded.spec
    kv_bytes = history * spec.kv_bytes_per_token
    h_bytes = history * spec.num_layers * spec.hidden_bytes_per_token_layer
    prompt = torch.randint(0, spec.vocab_size, (history + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = history // BLOCK
    caches = [
        torch.zeros(blocks, BLOCK, spec.num_kv_heads, 2 * spec.head_size, dtype=dtype, device=device).transpose(1, 2)
        for _ in range(spec.num_layers)
    ]
    layout = PagedLayout.split_kv(caches[0])
    layers = [PagedLayer(i, cache, layout) for i, cache in enumerate(caches)]
    projections = [KVProjection.from_layer(spec, layer) for layer in model.model.layers]

    def rebuild(layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        k, v = projections[layer](hidden)
        cos, sin = rope_cos_sin(spec.rope_of(layer), positions, dtype)
        return torch.stack((apply_rope(k, cos, sin), v), dim=1)

    job = LoadJob("bench", None, prompt[:history], [list(range(blocks))], 0, history)
    host_bytes = kv_bytes + h_bytes + (64 << 20)
    with (
        tempfile.TemporaryDirectory(prefix="hcache-bench-paged-") as tmp,
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
        loaders = {
            name: Loader(runtime.stack, (BLOCK,), BLOCK, layers, rebuild, plan=RestorePlan.parse(name, spec.num_layers))
            for name in ("KV", "H")
        }
        src = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
        dst = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
        gen = torch.Generator().manual_seed(1)
        hidden = [
            torch.randn(history, spec.hidden_size, generator=gen).to(device, dtype) for _ in range(spec.num_layers)
        ]
        positions = torch.arange(history, device=device)
        elements = layout.elements(*(torch.arange(history) // BLOCK, torch.arange(history) % BLOCK))

        def load(name: str) -> None:
            """One load as the connector's worker makes it: submitted to the loader's thread, waited for."""
            record, done = SequenceRecord(), {}
            loaders[name].submit(job, record)
            while not done:
                done = loaders[name].finished(wait=60.0)
            assert done == {job.req_id: set()} and record.restored_tokens == history, (done, record)

        def rebuild_alone() -> None:
            for layer, rows in zip(layers, hidden):
                layout.write(layer.cache, elements, rebuild(layer.index, rows, positions))

        measures = {
            "copy": lambda: dst.copy_(src, non_blocking=True),
            "KV": lambda: load("KV"),
            "H": lambda: load("H"),
            "rebuild": rebuild_alone,
        }
        try:
            t = _shaped.timed_rounds(measures, args.repeats, device, "paged rounds")
        finally:
            for loader in loaders.values():
                loader.close()
    copy_bw = kv_bytes / t["copy"]
    result = {
        "shape": args.shape,
        "layers": spec.num_layers,
        "history": history,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "copy_gb_s": copy_bw / 1e9,
        "kv_load_gb_s": kv_bytes / t["KV"] / 1e9,
        "kv_load_vs_copy": t["copy"] / t["KV"],
        "h_load_vs_bound": t["H"] / max(h_bytes / copy_bw, t["rebuild"]),
        "h_vs_kv": t["KV"] / t["H"],
        "load_s": {"KV": t["KV"], "H": t["H"]},
        "repeats": args.repeats,
    }
    print(
        f"{args.shape} x {spec.num_layers} layers, {history}-token history into {BLOCK}-token FlashAttention-layout blocks, {device} {result['dtype']}\n"
        f"copy of the same bytes: {result['copy_gb_s']:.2f} GB/s\n"
        f"KV load: {result['kv_load_gb_s']:.2f} GB/s = {result['kv_load_vs_copy']:.2f} of the copy\n"
        f"H load: {result['h_load_vs_bound']:.2f}x its bound, {result['h_vs_kv']:.2f}x KV's speed\n"
        "absolute figures mean something only on a GPU; compare the ratios, measured side by side"
    )
    return result
