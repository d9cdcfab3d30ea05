"""Restore ops: the RoPE-and-scatter and dequantise-and-scatter kernels' bandwidth against the device's copy peak, the torch reference and FastGen.

Per model shape and token count it times, on one layer's paged cache, with the K/V of a restore laid out
as the K/V GEMM leaves them (strided views of one ``[T, 2·kv_dim]`` output):
- the Triton kernel, and its achieved bandwidth as a fraction of a device-to-device copy's (the target is
  at least 70%);
- the torch reference (:func:`~hcache.ops.rope.apply_rope` then :func:`~hcache.ops.paged_kv.write_kv`);
- FastGen's ``linear_blocked_kv_rotary`` (``BlockedRotaryEmbeddings``), when DeepSpeed's ragged ops build.

Bandwidth counts the bytes a kernel must move: K and V read, K and V written, plus what each reads besides
(the kernel: half a cos and a sin row and a slot per token; FastGen: Q read and written, as it rotates Q
in place). The kernel runs FastGen's RoPE rule (float32 cos/sin, :mod:`hcache.ops.rope`) where the shape's
RoPE is unscaled, as on FastGen's engine. The kernel's output is checked against the reference, bit for bit, before it is timed.

The same slots are then filled from K/V stored in 8 bits (``stored_dtype``: int8 codes, a float16 scale
per head) by the dequantise-and-scatter kernel (:mod:`hcache.ops.dequant_scatter_kernel`): its bytes are
the codes and scales read and the cache written (``dequant`` in each case).
Kernel timings need a GPU: on a CPU only the torch references are timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from ..model.spec import ModelSpec, RopeSpec
from ..ops import rope_cos_sin, rotate_and_write, slot_mapping
from ..ops.dequant_scatter import write_dequantised
from ..ops.quant import quantise

# (n_kv_heads, head_size, rope parameters) of the shapes the paper and the mission name
SHAPES: dict[str, tuple[int, int, dict]] = {
    "llama2-7b": (32, 128, {"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-8b": (
        8,
        128,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
COPY_BYTES = 1 << 30  # the copy-peak buffer: far larger than any cache level
SEQUENCE_TOKENS = 2048  # the batch is a ragged set of sequences of up to this many tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per measurement, median reported (50 on a GPU, 5 on a CPU)",
    )


def _rope(n_kv: int, head_size: int, params: dict) -> RopeSpec:
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama",
        hidden_size=4 * n_kv * head_size,
        num_attention_heads=4 * n_kv,
        num_key_value_heads=n_kv,
        rope_parameters=params,
        max_position_embeddings=131072,
    )
    return ModelSpec.from_config(config).rope


def _median_ms(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_peak_gbps(device: torch.device, repeats: int) -> float:
    """Device-to-device copy bandwidth, read plus write bytes."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), repeats, device)
    return 2 * COPY_BYTES / ms / 1e6


def _restore_batch(tokens: int, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Slots and positions of sequences restored from position 0 into shuffled blocks, and the block count."""
    lengths = [min(SEQUENCE_TOKENS, tokens - s) for s in range(0, tokens, SEQUENCE_TOKENS)]
    num_blocks = sum(-(-n // block_size) for n in lengths)
    blocks = torch.randperm(num_blocks, device=device)
    slots, positions, used = [], [], 0
    for n in lengths:
        table = blocks[used : used + -(-n // block_size)]
        used += len(table)
        pos = torch.arange(n, device=device)
        slots.append(slot_mapping(table, pos, block_size))
        positions.append(pos)
    return torch.cat(slots), torch.cat(positions), num_blocks


def _fastgen(
    n_kv: int, head_size: int, rope: RopeSpec, dtype: torch.dtype, tokens: int, block_size: int, device: torch.device
) -> Callable[[], None]:
    """FastGen's fused rotary + blocked-KV write over the same tokens, as one sequence (Q heads = KV heads),
    set up as FastGen's engine sets it up: a ``DSStateManager`` over one KV cache config (a tuple of them:
    one per allocation group), and a finalized ``RaggedBatchWrapper`` of the sequence."""
    from deepspeed.inference.v2.kernels.ragged_ops import BlockedRotaryEmbeddings
    from deepspeed.inference.v2.ragged import (
        AllocationMode,
        DSStateManager,
        DSStateManagerConfig,
        KVCacheConfig,
        MemoryConfig,
        RaggedBatchWrapper,
    )

    num_blocks = -(-tokens // block_size)
    kv_config = KVCacheConfig(
        block_size=block_size,
        num_allocation_groups=1,
        cache_shape=(1, n_kv, head_size),
        cache_dtype=dtype,
        max_blocks_per_allocation_group=num_blocks,
    )
    config = DSStateManagerConfig(
        max_tracked_sequences=1,
        max_ragged_sequence_count=1,
        max_ragged_batch_size=tokens,
        max_context=max(tokens, 8192),
        memory_config=MemoryConfig(mode=AllocationMode.ALLOCATE, size=num_blocks),
    )
    batch, manager = RaggedBatchWrapper(config), DSStateManager(config, (kv_config,))
    seq = manager.get_or_create_sequence(0)
    seq.extend_kv_cache(manager.allocate_blocks(num_blocks))
    batch.clear()
    batch.insert_sequence(seq, torch.zeros(tokens, dtype=torch.int64))
    seq.pre_forward(tokens)
    batch.finalize()
    kernel = BlockedRotaryEmbeddings(head_size, n_kv, n_kv, dtype, rope.rotary_dim, rope.theta)
    qkv = torch.randn(tokens, 3 * n_kv * head_size, dtype=dtype, device=device)
    # the closure holds the manager: the batch's kv_ptrs point into its block-id tensor
    return lambda: kernel(manager.get_cache(0), qkv, batch)


def _case(name: str, tokens: int, args: argparse.Namespace, device: torch.device, peak: float | None) -> dict:
    n_kv, head_size, params = SHAPES[name]
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rope = _rope(n_kv, head_size, params)
    slots, positions, num_blocks = _restore_batch(tokens, args.block_size, device)
    kv_dim = n_kv * head_size
    k, v = (
        x.view(tokens, n_kv, head_size)
        for x in torch.randn(tokens, 2 * kv_dim, device=device, dtype=dtype).split(kv_dim, -1)
    )
    rule = "fastgen" if rope.rope_type == "default" else "hf"  # FastGen's engine rule; it has no scaled RoPE
    cos_sin = rope_cos_sin(rope, positions, dtype, rule)  # once per restore, shared by every layer: not timed
    caches = {
        b: torch.zeros(num_blocks, args.block_size, 2, n_kv, head_size, dtype=dtype, device=device)
        for b in ("torch", "triton")
    }

    def run(backend: str) -> Callable[[], None]:
        return lambda: rotate_and_write(caches[backend], slots, k, v, cos_sin, backend=backend)

    kv_bytes = 2 * 2 * tokens * kv_dim * itemsize  # K and V, read once and written once
    result = {
        "shape": name,
        "n_kv_heads": n_kv,
        "head_size": head_size,
        "rope_type": rope.rope_type,
        "dtype": args.dtype,
        "rope_rule": rule,
        "tokens": tokens,
    }
    result["torch_ms"] = _median_ms(run("torch"), args.repeats, device)
    result["dequant"] = _dequant_case(
        torch.stack((k, v), 1), slots, {b: torch.zeros_like(c) for b, c in caches.items()}, args.repeats, device, peak
    )
    if device.type != "cuda":
        return {
            **result,
            "kernel_ms": None,
            "kernel_gbps": None,
            "fraction_of_copy_peak": None,
            "kernel_speedup_over_torch": None,
            "fastgen": "needs a GPU",
        }

    run("triton")()
    result["matches_reference"] = torch.equal(caches["triton"], caches["torch"])
    kernel_bytes = (
        kv_bytes
        + 2 * tokens * (rope.rotary_dim // 2) * cos_sin[0].element_size()
        + slots.numel() * slots.element_size()
    )
    result["kernel_ms"] = _median_ms(run("triton"), args.repeats, device)
    result["kernel_gbps"] = kernel_bytes / result["kernel_ms"] / 1e6
    result["fraction_of_copy_peak"] = result["kernel_gbps"] / peak
    result["kernel_speedup_over_torch"] = result["torch_ms"] / result["kernel_ms"]
    try:
        fastgen_ms = _median_ms(
            _fastgen(n_kv, head_size, rope, dtype, tokens, args.block_size, device), args.repeats, device
        )
        q_bytes = 2 * tokens * kv_dim * itemsize
        result["fastgen"] = {
            "ms": fastgen_ms,
            "gbps": (kv_bytes + q_bytes) / fastgen_ms / 1e6,
            "kernel_speedup": fastgen_ms / result["kernel_ms"],
        }
    except Exception as exc:  # DeepSpeed absent, or its ops do not build here
        result["fastgen"] = f"unavailable: {type(exc).__name__}: {exc}"
    return result


def _dequant_case(
    kv: torch.Tensor, slots: torch.Tensor, caches: dict, repeats: int, device: torch.device, peak: float | None
) -> dict:
    """The dequantise-and-scatter kernel against its torch reference, on int8 codes of ``kv``."""
    rows = quantise(kv, torch.int8)

    def run(backend: str) -> Callable[[], None]:
        return lambda: write_dequantised(caches[backend], slots, rows, backend=backend)

    result = {"torch_ms": _median_ms(run("torch"), repeats, device)}
    if device.type != "cuda":
        return {**result, "kernel_ms": None, "kernel_gbps": None, "fraction_of_copy_peak": None}
    run("triton")()
    result["matches_reference"] = torch.equal(caches["triton"], caches["torch"])
    moved = (
        rows.codes.numel()
        + rows.scale.numel() * rows.scale.element_size()
        + kv.numel() * kv.element_size()
        + slots.numel() * 8
    )
    result["kernel_ms"] = _median_ms(run("triton"), repeats, device)
    result["kernel_gbps"] = moved / result["kernel_ms"] / 1e6
    result["fraction_of_copy_peak"] = result["kernel_gbps"] / peak
    return result


def _fmt(value: float | None, width: int, spec: str) -> str:
    return "-".rjust(width) if value is None else format(value, f"{width}{spec}")


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.repeats is None:
        args.repeats = 50 if device.type == "cuda" else 5
    peak = copy_peak_gbps(device, args.repeats) if device.type == "cuda" else None
    cases = [_case(name, tokens, args, device, peak) for name in args.shapes for tokens in args.tokens]

    if peak is not None:
        print(f"device copy peak: {peak:.0f} GB/s ({torch.cuda.get_device_name()})")
    print(
        f"{'shape':<10} {'tokens':>6} {'kernel ms':>9} {'GB/s':>6} {'of peak':>7} {'torch ms':>9} {'speedup':>7}  fastgen (kernel vs FastGen)"
    )
    for c in cases:
        fastgen = c["fastgen"]
        if isinstance(fastgen, dict):
            fastgen = (
                f"{fastgen['ms']:.3f} ms, {fastgen['gbps']:.0f} GB/s, kernel {fastgen['kernel_speedup']:.2f}x faster"
            )
        print(
            f"{c['shape']:<10} {c['tokens']:>6} {_fmt(c['kernel_ms'], 9, '.3f')} {_fmt(c['kernel_gbps'], 6, '.0f')} "
            f"{_fmt(c['fraction_of_copy_peak'], 7, '.0%')} {c['torch_ms']:>9.3f} {_fmt(c['kernel_speedup_over_torch'], 7, '.2f')}  {fastgen}"
        )
        d = c["dequant"]
        print(
            f"{'  int8 KV':<10} {c['tokens']:>6} {_fmt(d['kernel_ms'], 9, '.3f')} {_fmt(d['kernel_gbps'], 6, '.0f')} "
            f"{_fmt(d['fraction_of_copy_peak'], 7, '.0%')} {d['torch_ms']:>9.3f}  (dequantise and scatter)"
        )
    result = {"device": str(device), "copy_peak_gbps": peak, "target_fraction_of_copy_peak": 0.7, "cases": cases}
    if device.type != "cuda":
        result["note"] = (
            "no GPU: kernel bandwidth, the copy peak and FastGen need one; only the torch reference "
            "was timed, on the CPU. Triton's interpreter checks the kernel's logic, not its speed."
        )
        print(result["note"])
    else:
        mismatched = [
            f"{c['shape']}/{c['tokens']}"
            for c in cases
            if not (c["matches_reference"] and c["dequant"]["matches_reference"])
        ]
        if mismatched:
            print(f"kernel output differs from the torch reference: {', '.join(mismatched)}")
    return result
