"""``hcache bench <name>``: benchmarks that measure hcache against its baselines side by side in one run.

Each module here is one benchmark. It defines ``add_arguments(parser)`` and ``run(args) -> dict``; the
first line of its docstring is its help. ``--json PATH`` writes the returned figures together with the
command and the machine's facts, so a kept result says where it came from.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
from pathlib import Path

from ..machine import machine_facts


def available() -> dict[str, str]:
    """Benchmark name -> module name, for every module of this package."""
    return {m.name: f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="benchmark", required=True)
    for name, module_name in sorted(available().items()):
        module = importlib.import_module(module_name)
        parser = bench.add_parser(name, help=(module.__doc__ or name).strip().splitlines()[0])
        parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this file")
        module.add_arguments(parser)


def run(args: argparse.Namespace, command: str) -> int:
    result = importlib.import_module(available()[args.benchmark]).run(args)
    if args.json_path:
        record = {"benchmark": args.benchmark, "command": command, "machine": machine_facts()}
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({**record, **result}, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0
