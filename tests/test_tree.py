"""The tree's size rules (docs/architecture.md): at most ten modules at ``hcache/``'s root, and no module over
450 lines, so that each file holds one idea and the root holds only what every package stands on."""

from pathlib import Path

HCACHE = Path(__file__).resolve().parents[1] / "hcache"
ROOT_MODULES, MODULE_LINES = 10, 450


def test_the_root_holds_at_most_ten_modules():
    root = sorted(p.name for p in HCACHE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(root) <= ROOT_MODULES, root


def test_no_module_is_over_450_lines():
    long = {
        str(p.relative_to(HCACHE)): n
        for p in HCACHE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines: {long}"
