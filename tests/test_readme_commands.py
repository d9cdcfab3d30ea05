"""The commands the README and the docs show run as shown, on any machine.

Every ``hcache ...`` (or ``python -m hcache ...``) line in a fenced block is parsed by the real command
line, so a subcommand or flag that does not exist fails here. The cheap ones then run for real, as a new
user would run them: each subcommand's ``--help``, and the README's main command, ``hcache demo``, with
one turn, in a directory with no ``profiles/`` (so nothing depends on a profile committed for another CPU).
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hcache.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands() -> list[tuple[str, list[str]]]:
    """(where, argv after ``hcache``) of each command line in a fenced block of the README and the docs."""
    found = []
    for page in PAGES:
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            for line in block.splitlines():
                command = line.split("  #")[0].strip()
                if not command.startswith(
                    ("hcache", "python -m hcache")
                ):  # another program's (vllm serve), or its JSON
                    continue
                words = shlex.split(command)
                if words[:3] == ["python", "-m", "hcache"]:
                    words = words[2:]
                if words[:1] != ["hcache"] or any(w.startswith("[") for w in words):  # a synopsis, not a command
                    continue
                found.append((f"{page.relative_to(ROOT)}: {line.strip()}", words[1:]))
    return found


COMMANDS = _commands()


def test_the_pages_show_the_main_commands():
    shown = {" ".join(argv[:2]) for _, argv in COMMANDS}
    assert {"demo", "serve --store-dir", "check --quick", "prepare --fastgen"} <= shown, shown
    assert len(COMMANDS) >= 12


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_command_shown_parses(where, argv):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: an unknown subcommand, flag or value
        pytest.fail(f"{where}: refused by the command line (exit {exc.code})")


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    hcache = Path(sys.executable).with_name("hcache")  # the console script the install put beside this Python
    return subprocess.run([str(hcache), *argv], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_every_subcommands_help_runs(tmp_path):
    subcommands = sorted({argv[0] for _, argv in COMMANDS} | {"profile", "bench"})
    for sub in ["", *subcommands]:
        result = _run([sub, "--help"] if sub else ["--help"], tmp_path)
        assert result.returncode == 0 and "usage: hcache" in result.stdout, (sub, result.stderr[-2000:])


@pytest.mark.slow
def test_the_readme_main_command_runs_with_one_turn(tmp_path):
    [demo] = [argv for where, argv in COMMANDS if where.startswith("README.md") and argv[:1] == ["demo"]]
    assert not (tmp_path / "profiles").exists()
    result = _run(
        [*demo, "--turns", "1", "--max-new-tokens", "8", "--repeats", "1"], tmp_path
    )  # the command runs; timing is the demo test's
    assert result.returncode == 0, result.stderr[-3000:]
    assert "turn 1:" in result.stdout and "all restored replies identical to recompute" in result.stdout
