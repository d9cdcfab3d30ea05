"""The tree is formatted by the one formatter pyproject.toml configures (``ruff format``), so a change's diff
is its content, not its layout."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_source_tree_is_formatted_by_ruff():
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "hcache", "tests", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
