"""``hcache demo``: the command line of :mod:`hcache.demo.chat`, which it imports only when run (it imports
torch, and ``hcache --help`` should not)."""

from __future__ import annotations

import argparse

from ..defaults import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="multi-turn chat; each turn restored by every method and checked")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2' (default), a HF model directory")
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--store", default=None, help="chunk store directory (default: a temporary one)")
    demo.add_argument("--json", dest="json_path", default=None, help="also write the figures to this file")
    demo.add_argument(
        "--stored-dtype",
        default="auto",
        help="auto (lossless; default), int8, fp8, 8bit or H=fp8,KV=int8: replies restored from 8-bit state may differ",
    )
    demo.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per method and turn, interleaved; the median is shown (default 3)",
    )


def run(args: argparse.Namespace) -> int:
    from .chat import run_demo

    return (
        0
        if run_demo(
            args.model, args.turns, args.max_new_tokens, args.store, args.json_path, args.stored_dtype, args.repeats
        )
        else 1
    )
