"""The data-path benchmarks' model (``bench transfer``, ``bench paged``): a named shape with a few layers and
random weights (:func:`hcache.model.random_weights.random_model`). Only attention's shapes matter to their figures, so the MLP and vocabulary are shrunk to
keep host memory small."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..model.loader import LoadedModel, model_dtype
from ..model.random_weights import RANDOM_PREFIX, random_model
from ..model.spec import ModelSpec
from ..storage.chunk_key import CHUNK_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="llama-2-7b", help="a random shape: llama-2-7b, llama-3-8b, or a model type")
    parser.add_argument("--layers", type=int, default=4, help="layers of that shape to build")
    parser.add_argument("--history", type=int, default=4096, help="history tokens in the host pool")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: float16 on a GPU)")
    parser.add_argument("--repeats", type=int, default=5)


@dataclass
class Shaped:
    loaded: LoadedModel  # ``random:<shape>``, as the loader names it
    history: int  # whole chunks
    device: torch.device
    dtype: torch.dtype


def shaped(args: argparse.Namespace) -> Shaped:
    """The model ``args`` name, and the history rounded down to whole chunks; ValueError for arguments
    that cannot be measured."""
    dtype = model_dtype(args.dtype, args.device)
    history = args.history // CHUNK_TOKENS * CHUNK_TOKENS
    if history < CHUNK_TOKENS or args.layers < 1 or args.repeats < 1:
        raise ValueError("--history must be at least 64 tokens, --layers and --repeats at least 1")
    model = random_model(
        args.shape, dtype, device=args.device, num_hidden_layers=args.layers, intermediate_size=256, vocab_size=1024
    )
    spec = ModelSpec.from_config(model.config, dtype)
    if history >= spec.max_positions:
        raise ValueError(f"--history must be below the model's {spec.max_positions} positions")
    return Shaped(
        LoadedModel(f"{RANDOM_PREFIX}{args.shape}", model, spec, None), history, torch.device(args.device), dtype
    )


def timed_rounds(
    measures: dict, repeats: int, device: torch.device, desc: str, after=lambda name: None
) -> dict[str, float]:
    """Each of ``measures`` (name -> a call) timed once a round, in turn, for ``repeats`` rounds after one
    that warms up, the device synchronised around each call; ``after(name)`` runs untimed after each. The
    median seconds of each."""
    times: dict[str, list[float]] = {name: [] for name in measures}
    for _ in tqdm(range(repeats + 1), desc=desc, leave=False):
        for name, fn in measures.items():
            _sync(device)
            began = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - began)
            after(name)
    return {name: statistics.median(v[1:]) for name, v in times.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
