"""``hcache prepare``: the embedded default model converted once, so later loads are fast; with
``--fastgen``, DeepSpeed-FastGen's ops built once instead."""

from __future__ import annotations

import argparse
import sys

from ..defaults import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction) -> None:
    prepare = sub.add_parser("prepare", help="convert the embedded default model once, so later loads are fast")
    prepare.add_argument(
        "--fastgen",
        action="store_true",
        help="instead, build DeepSpeed-FastGen's ops once (a GPU and nvcc, or prebuilt ops)",
    )


def run(args: argparse.Namespace) -> int:
    if args.fastgen:
        return _prepare_fastgen()
    from ..model.loader import load_model

    loaded = load_model(DEFAULT_MODEL)
    print(f"default model ready: {loaded.spec.model_type}, {loaded.spec.num_layers} layers")
    return 0


def _prepare_fastgen() -> int:
    try:
        from .fastgen import build_fastgen_ops

        names = build_fastgen_ops()
    except ImportError as exc:
        print(f"hcache: error: FastGen needs DeepSpeed (pip install 'deepspeed==0.19.*'): {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # no GPU, an untested DeepSpeed, no nvcc, or the build failed
        print(f"hcache: error: {exc}", file=sys.stderr)
        return 2
    print(f"FastGen's ops ready: {', '.join(names)}")
    return 0
