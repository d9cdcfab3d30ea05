"""The ``hcache`` command."""
from __future__ import annotations

import argparse
import logging
import sys

from . import bench
from .errors import HCacheError
from .model_loader import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hcache", description="Fast LLM state restoration from hidden states.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log restore decisions and fallbacks")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="multi-turn chat; each turn restored by every method and checked")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default), a HF model directory")
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--store", default=None, help="chunk store directory (default: a temporary one)")
    demo.add_argument("--json", dest="json_path", default=None, help="also write the figures to this file")

    sub.add_parser("prepare", help="convert the embedded default model once, so later loads are fast")
    bench.add_parsers(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            from .demo import run_demo

            return 0 if run_demo(args.model, args.turns, args.max_new_tokens, args.store, args.json_path) else 1
        if args.command == "bench":
            return bench.run(args)
        if args.command == "prepare":
            from .model_loader import load_model

            loaded = load_model(DEFAULT_MODEL)
            print(f"default model ready: {loaded.spec.model_type}, {loaded.spec.num_layers} layers")
            return 0
    except (HCacheError, ValueError) as exc:
        print(f"hcache: error: {exc}", file=sys.stderr)
        return 2
    return 0
