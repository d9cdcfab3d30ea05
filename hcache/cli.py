"""The ``hcache`` command: each subcommand is a module of its own, with ``add_parser(sub)`` and
``run(args) -> int`` (``args.command_line``: the command as typed, which results record); this builds the
parser from them and dispatches. Command modules import the heavy libraries when run, so ``--help`` is quick."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .bench import command as bench_command
from .check import command as check_command
from .demo import command as demo_command
from .engine import prepare_command
from .errors import HCacheError
from .fleet import command as fleet_command
from .mii import serve_command
from .planning import command as profile_command
from .storage import command as store_command
from .version import __version__

VERBOSE_HELP = "log restore decisions and fallbacks (and the libraries' own info messages)"
COMMANDS = (
    demo_command,
    prepare_command,
    profile_command,
    bench_command,
    serve_command,
    fleet_command,
    store_command,
    check_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hcache", description="Fast LLM state restoration from hidden states.")
    parser.add_argument("--version", action="version", version=f"hcache {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
        list(sub.choices.values())[-1].set_defaults(run=module.run)  # the subcommand it just added
    _verbose_after_subcommands(parser)
    return parser


def _verbose_after_subcommands(parser: argparse.ArgumentParser) -> None:
    """``-v`` after a subcommand too (``hcache demo -v``), not only before it. Its default is suppressed
    there, so a ``-v`` given before the subcommand is not reset by the subcommand's parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.add_argument(
                    "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
                )
                _verbose_after_subcommands(subparser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:  # this process and those it starts (they inherit the environment)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
    args.command_line = " ".join(["hcache", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.run(args)
    except (HCacheError, ValueError) as exc:
        print(f"hcache: error: {exc}", file=sys.stderr)
        return 2
