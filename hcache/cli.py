"""The ``hcache`` command."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from . import bench, check
from .defaults import DEFAULT_MODEL, DEFAULT_READERS
from .errors import HCacheError
from .fleet import command as fleet_command
from .mii import serve_command
from .storage import command as store_command
from .version import __version__

VERBOSE_HELP = "log restore decisions and fallbacks (and the libraries' own info messages)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hcache", description="Fast LLM state restoration from hidden states.")
    parser.add_argument("--version", action="version", version=f"hcache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="multi-turn chat; each turn restored by every method and checked")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default), a HF model directory")
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--store", default=None, help="chunk store directory (default: a temporary one)")
    demo.add_argument("--json", dest="json_path", default=None, help="also write the figures to this file")
    demo.add_argument("--stored-dtype", default="auto", help="auto (lossless; default), int8, fp8, 8bit or H=fp8,KV=int8: replies restored from 8-bit state may differ")
    demo.add_argument("--repeats", type=int, default=3, help="timed runs per method and turn, interleaved; the median is shown (default 3)")

    prepare = sub.add_parser("prepare", help="convert the embedded default model once, so later loads are fast")
    prepare.add_argument("--fastgen", action="store_true",
                         help="instead, build DeepSpeed-FastGen's ops once (a GPU and nvcc, or prebuilt ops)")
    profile = sub.add_parser("profile", help="measure per-layer restore costs of a model on this machine")
    profile.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default), a HF model directory, 'random:<type>'")
    profile.add_argument("--engine", choices=["reference", "fastgen"], default="reference",
                         help="measure through this engine: fastgen (a GPU) times FastGen's own kernels, as hcache serves there")
    profile.add_argument("--device", default=None, help="cuda when a GPU is present, else cpu")
    profile.add_argument("--dtype", default=None, help="float16, bfloat16 or float32 (default: float16 on a GPU)")
    profile.add_argument("--tokens", default=None, help="history lengths to measure, e.g. 256,1024,4096 (default: up to 16K)")
    profile.add_argument("--short", action="store_true", help="measure 256, 1K and 4K tokens only, as on first use of plan auto")
    profile.add_argument("--repeats", type=int, default=3, help="timed runs per cost; the median is kept")
    profile.add_argument("--readers", type=int, default=DEFAULT_READERS, help="reader threads, as in the runtime")
    profile.add_argument("--store-dir", action="append", default=None, help="measure I/O on this store directory (repeat for each SSD; default: the temp dir)")
    profile.add_argument("--out", default=None, help="output path (default: $HCACHE_HOME/profiles/<machine>-<model>.json, where plan auto looks)")
    bench.add_parsers(sub)
    serve_command.add_parser(sub)
    fleet_command.add_parser(sub)
    store_command.add_parser(sub)
    check.add_parser(sub)
    _verbose_after_subcommands(parser)
    return parser


def _verbose_after_subcommands(parser: argparse.ArgumentParser) -> None:
    """``-v`` after a subcommand too (``hcache demo -v``), not only before it. Its default is suppressed
    there, so a ``-v`` given before the subcommand is not reset by the subcommand's parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
                _verbose_after_subcommands(subparser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # this process and those it starts (they inherit the environment)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
    try:
        if args.command == "demo":
            from .demo import run_demo

            return 0 if run_demo(args.model, args.turns, args.max_new_tokens, args.store, args.json_path, args.stored_dtype, args.repeats) else 1
        command = " ".join(["hcache", *(sys.argv[1:] if argv is None else argv)])
        if args.command == "profile":
            return _profile(args, command)
        if args.command == "bench":
            return bench.run(args, command)
        if args.command == "serve":
            return serve_command.run(args)
        if args.command == "fleet":
            return fleet_command.run(args)
        if args.command == "store":
            return store_command.run(args)
        if args.command == "check":
            return check.run(args, command)
        if args.command == "prepare" and args.fastgen:
            return _prepare_fastgen()
        if args.command == "prepare":
            from .model.loader import load_model

            loaded = load_model(DEFAULT_MODEL)
            print(f"default model ready: {loaded.spec.model_type}, {loaded.spec.num_layers} layers")
            return 0
    except (HCacheError, ValueError) as exc:
        print(f"hcache: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _prepare_fastgen() -> int:
    try:
        from .engine.fastgen import build_fastgen_ops

        names = build_fastgen_ops()
    except ImportError as exc:
        print(f"hcache: error: FastGen needs DeepSpeed (pip install 'deepspeed==0.19.*'): {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # no GPU, an untested DeepSpeed, no nvcc, or the build failed
        print(f"hcache: error: {exc}", file=sys.stderr)
        return 2
    print(f"FastGen's ops ready: {', '.join(names)}")
    return 0


def _profile_fastgen(args: argparse.Namespace) -> tuple:
    """The profile measured through a FastGen engine over the model's checkpoint (a ``random:<shape>`` is
    saved first, in ``--dtype``: FastGen loads checkpoints itself)."""
    import tempfile

    import torch

    from .engine.fastgen import build_fastgen_engine
    from .errors import InvalidRequestError
    from .model.loader import model_dir, model_dtype, random_model
    from .planning.profiler import default_tokens, measure_engine, profile_tokens

    if not torch.cuda.is_available() or (args.device or "cuda").split(":")[0] != "cuda":
        raise InvalidRequestError("--engine fastgen needs a CUDA GPU (FastGen's kernels are CUDA-only); "
                                  "profile the reference engine with --engine reference")
    with tempfile.TemporaryDirectory(prefix="hcache-profile-model-") as tmp:
        if args.model.startswith("random:"):
            path = Path(tmp)
            model = random_model(args.model.removeprefix("random:"), dtype=model_dtype(args.dtype, "cuda"), device="cuda")
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


def _profile(args: argparse.Namespace, command: str) -> int:
    import torch

    from .model.loader import load_model, model_dtype
    from .storage.stored_state import stored_encodings
    from .planning.profile import default_profile_path
    from .planning.profiler import default_tokens, measure_profile

    if args.tokens and args.short:
        raise ValueError("--tokens and --short both choose the history lengths: give one")
    if args.engine == "fastgen":
        profile, spec = _profile_fastgen(args)
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load_model(args.model, dtype=model_dtype(args.dtype, device), device=device)
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else default_tokens(loaded.spec.max_positions, args.short)
        profile, spec = measure_profile(loaded, tokens, args.repeats, args.readers, args.store_dir), loaded.spec
    out = args.out or default_profile_path(args.model)
    profile.command = command
    profile.save(out)
    print(f"wrote {out}")
    for n in profile.tokens:
        costs = profile.costs(n)
        ms = ", ".join(f"{name} {getattr(costs, name) * 1e3:.2f}" for name in ("c_token", "c_h", "c_kv", "io_h", "io_kv"))
        print(f"  {n:>6} tokens: ms/layer {ms}; plan {profile.plan(spec, n)} ({profile.plan(spec, n, stored_encodings('8bit'))} with stored_dtype 8bit)")
    return 0
