"""``hcache profile``: a model's per-layer restore costs measured on this machine, written where
``plan="auto"`` looks for them (:mod:`hcache.planning.profile`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..defaults import DEFAULT_MODEL, DEFAULT_READERS


def add_parser(sub: argparse._SubParsersAction) -> None:
    profile = sub.add_parser("profile", help="measure per-layer restore costs of a model on this machine")
    profile.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="'smollm2' (default), 'gemma3-270m', a HF model directory, 'random:<type>'",
    )
    profile.add_argument(
        "--engine",
        choices=["reference", "fastgen"],
        default="reference",
        help="measure through this engine: fastgen (a GPU) times FastGen's own kernels, as hcache serves there",
    )
    profile.add_argument("--device", default=None, help="cuda when a GPU is present, else cpu")
    profile.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: float16 on a GPU)")
    profile.add_argument(
        "--tokens", default=None, help="history lengths to measure, e.g. 256,1024,4096 (default: up to 16K)"
    )
    profile.add_argument(
        "--short", action="store_true", help="measure 256, 1K and 4K tokens only, as on first use of plan auto"
    )
    profile.add_argument("--repeats", type=int, default=3, help="timed runs per cost; the median is kept")
    profile.add_argument("--readers", type=int, default=DEFAULT_READERS, help="reader threads, as in the runtime")
    profile.add_argument(
        "--store-dir",
        action="append",
        default=None,
        help="measure I/O on this store directory (repeat for each SSD; default: the temp dir)",
    )
    profile.add_argument(
        "--out",
        default=None,
        help="output path (default: $HCACHE_HOME/profiles/<machine>-<model>.json, where plan auto looks)",
    )


def _profile_fastgen(args: argparse.Namespace) -> tuple:
    """The profile measured through a FastGen engine over the model's checkpoint (a ``random:<shape>`` is
    saved first, in ``--dtype``: FastGen loads checkpoints itself)."""
    import tempfile

    import torch

    from ..engine.fastgen import build_fastgen_engine
    from ..errors import InvalidRequestError
    from ..model.loader import model_dir, model_dtype
    from ..model.random_weights import random_model
    from .profiler import default_tokens, measure_engine, profile_tokens

    if not torch.cuda.is_available() or (args.device or "cuda").split(":")[0] != "cuda":
        raise InvalidRequestError(
            "--engine fastgen needs a CUDA GPU (FastGen's kernels are CUDA-only); "
            "profile the reference engine with --engine reference"
        )
    with tempfile.TemporaryDirectory(prefix="hcache-profile-model-") as tmp:
        if args.model.startswith("random:"):
            path = Path(tmp)
            model = random_model(
                args.model.removeprefix("random:"), dtype=model_dtype(args.dtype, "cuda"), device="cuda"
            )
            model.save_pretrained(path)
            del model
            torch.cuda.empty_cache()
        else:
            path = model_dir(args.model)
        config = json.loads((path / "config.json").read_text())
        max_positions = config["max_position_embeddings"]
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else default_tokens(max_positions, args.short)
        tokens = profile_tokens(tokens, max_positions, args.repeats)
        engine = build_fastgen_engine(str(path), {"state_manager": {"max_context": max(tokens)}})
    return measure_engine(engine, args.model, tokens, args.repeats, args.readers, args.store_dir), engine.spec


def run(args: argparse.Namespace) -> int:
    import torch

    from ..model.loader import load_model, model_dtype
    from ..storage.stored_state import stored_encodings
    from .profile import default_profile_path
    from .profiler import default_tokens, measure_profile

    if args.tokens and args.short:
        raise ValueError("--tokens and --short both choose the history lengths: give one")
    for directory in args.store_dir or ():  # before the model loads: I/O is measured in scratch directories there
        if not Path(directory).is_dir():
            raise ValueError(f"--store-dir {directory!r} is not a directory")
    if args.engine == "fastgen":
        profile, spec = _profile_fastgen(args)
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load_model(args.model, dtype=model_dtype(args.dtype, device), device=device)
        tokens = (
            [int(t) for t in args.tokens.split(",")]
            if args.tokens
            else default_tokens(loaded.spec.max_positions, args.short)
        )
        profile, spec = measure_profile(loaded, tokens, args.repeats, args.readers, args.store_dir), loaded.spec
    out = args.out or default_profile_path(args.model)
    profile.command = args.command_line
    profile.save(out)
    print(f"wrote {out}")
    for n in profile.tokens:
        costs = profile.costs(n)
        ms = ", ".join(
            f"{name} {getattr(costs, name) * 1e3:.2f}" for name in ("c_token", "c_h", "c_kv", "io_h", "io_kv")
        )
        print(
            f"  {n:>6} tokens: ms/layer {ms}; plan {profile.plan(spec, n)} "
            f"({profile.plan(spec, n, stored_encodings('8bit'))} with stored_dtype 8bit)"
        )
    return 0
