"""``hcache bench <name>``: the command that runs the benchmarks of :mod:`hcache.bench`.

Each module of the package but this one (and those named ``_*``, its helpers) is one benchmark. It defines ``add_arguments(parser)`` and ``run(args) -> dict``; the
first line of its docstring is its help. ``--json PATH`` writes the returned figures together with the
command, the hcache commit it ran (:func:`~hcache.machine.facts.source_commit`) and the machine's facts, so a kept
result says where it came from.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import pkgutil
from pathlib import Path

from ..machine.facts import machine_facts


def available() -> dict[str, str]:
    """Benchmark name -> module name, for every benchmark module of the package."""
    here = Path(__file__).parent
    return {
        m.name: f"{__package__}.{m.name}"
        for m in pkgutil.iter_modules([str(here)])
        if not m.name.startswith("_") and m.name != "command"
    }


class _BenchmarkParser(argparse.ArgumentParser):
    """A benchmark's parser, whose arguments are added when it is first used (to parse or for its help):
    a benchmark module imports torch, and ``hcache --help`` and ``hcache bench --help`` should not."""

    def __init__(self, *args, module_name: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._module_name = module_name

    def _arguments_added(self) -> None:
        if self._module_name is not None:
            module_name, self._module_name = self._module_name, None
            importlib.import_module(module_name).add_arguments(self)

    def parse_known_args(self, args=None, namespace=None):
        self._arguments_added()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._arguments_added()
        return super().format_usage()

    def format_help(self) -> str:
        self._arguments_added()
        return super().format_help()


def _summary(name: str) -> str:
    """The first line of a benchmark module's docstring, read without importing the module."""
    doc = ast.get_docstring(ast.parse((Path(__file__).parent / f"{name}.py").read_text(encoding="utf-8")))
    return (doc or name).strip().splitlines()[0]


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(
        dest="benchmark", required=True, parser_class=_BenchmarkParser
    )
    for name, module_name in sorted(available().items()):
        parser = bench.add_parser(name, help=_summary(name), module_name=module_name)
        parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this file")


def run(args: argparse.Namespace) -> int:
    from ..machine.facts import source_commit

    commit = source_commit()  # before the run: the source it measures, whatever is committed meanwhile
    result = importlib.import_module(available()[args.benchmark]).run(args)
    if args.json_path:
        record = {
            "benchmark": args.benchmark,
            "command": args.command_line,
            "commit": commit,
            "machine": machine_facts(),
        }
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({**record, **result}, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 0
