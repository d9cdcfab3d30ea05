"""The package installs as users install it: from a wheel built by pyproject.toml, not from this checkout.

An editable install finds every module in the tree, so a package that the wheel leaves out (a directory
without ``__init__.py``, which ``packages.find`` skips) passes every other test and fails only on a user's
``import hcache``.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_has_an_init():
    dirs = {p.parent for p in (ROOT / "hcache").rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").exists())
    assert not missing, f"left out of the wheel (no __init__.py): {missing}"


def test_the_wheel_holds_every_module_and_the_package_data(tmp_path):
    # No build isolation: the installed setuptools builds it, so this runs offline.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [wheel] = tmp_path.glob("hcache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "hcache").rglob("*.py") if "__pycache__" not in p.parts}
    assert not sorted(sources - names), f"modules missing from the wheel: {sorted(sources - names)}"
    assert "hcache/fleet/haproxy.cfg" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hcache = hcache.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_setup_py_reads_the_same_metadata_as_pyproject():
    """``setup.py`` (the design card's layout, and legacy tooling) adds nothing of its own: it names the
    package and version that pyproject.toml gives, and the wheel above is built with it present."""
    import tomllib

    from hcache.version import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dynamic"] == ["version"]  # read from hcache/version.py, as below
    result = subprocess.run(
        [sys.executable, "setup.py", "--name", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    name, version = result.stdout.split()[-2:]
    assert name == project["name"]
    assert version == __version__
