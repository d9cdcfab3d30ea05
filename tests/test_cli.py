"""The command line itself: its help and version come at once, without importing the heavy libraries, and
``-v`` is taken before or after the subcommand."""

import re
import subprocess
import sys

import pytest

import hcache
from hcache.cli import build_parser

HEAVY = ("torch", "transformers", "deepspeed", "mii")


def _imported(argv: list[str]) -> set[str]:
    """The top-level packages ``python -m hcache <argv>`` imports, from ``-X importtime``."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hcache", *argv], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "usage: hcache" in result.stdout, result.stderr[-3000:]
    return {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s*([\w.]+)$", result.stderr, flags=re.M)}


@pytest.mark.parametrize("sub", ["", "demo", "bench", "serve", "fleet", "store", "check", "profile"])
def test_help_imports_none_of_the_heavy_libraries(sub):
    imported = _imported([sub, "--help"] if sub else ["--help"])
    assert "hcache" in imported and "argparse" in imported  # the import log is read
    assert not imported & set(HEAVY), f"hcache {sub} --help imports {sorted(imported & set(HEAVY))}"


def test_version():
    result = subprocess.run([sys.executable, "-m", "hcache", "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"hcache {hcache.__version__}"


@pytest.mark.parametrize(
    "argv, verbose",
    [
        (["demo"], False),
        (["-v", "demo"], True),
        (["demo", "-v"], True),
        (["--verbose", "check", "--quick"], True),
        (["check", "--quick", "--verbose"], True),
        (["serve", "-v", "--model", "m"], True),
        (["bench", "restore", "-v"], True),
    ],
)
def test_verbose_before_or_after_the_subcommand(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose
