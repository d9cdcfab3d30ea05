"""The package's import graph: every module imports on its own, and no modules, nor packages, import each
other.

A cycle lets a lower module reach back into a higher one (the configuration once went from the MII backend
to the serving engine, to the profile, to auto-profiling and back), and makes what works depend on which
module happens to be imported first. Between packages, a loop is an arrow that runs back up the floors the
architecture stands on (the settings and planning, the model and storage, the OpenAI server and MII, once),
even when no two modules import each other. The graph counts every import, those inside functions too.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import hcache

PACKAGE = Path(hcache.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":  # a script: importing it runs the command line
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(module: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The hcache modules ``module`` imports, and the top-level names of the other packages it imports."""
    ours, theirs = set(), set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".")
                if node.level
                else node.module
            )
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            (ours if name.split(".")[0] == "hcache" else theirs).add(
                name.split(".")[0] if name.split(".")[0] != "hcache" else name
            )
    ours = {m for m in ours if m in modules and m != module}
    return ours, theirs


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other():
    modules = _modules()
    graph = {m: _imports(m, p, modules)[0] for m, p in modules.items()}
    assert len(graph) > 40 and graph["hcache.serving.runtime"] >= {
        "hcache.config",
        "hcache.serving.engine",
    }  # the graph is read
    mutual = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph[b])
    assert not mutual, f"modules that import each other: {mutual}"
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def _package(module: str) -> str:
    """The top-level part of hcache a module belongs to: ``hcache.storage.chunk`` is ``storage``, and a module
    at the top, ``hcache.config``, is its own."""
    return module.split(".")[1]


def test_no_packages_import_each_other_round_a_loop():
    """``hcache`` itself (its ``__init__``, which hands the public names on) stands on top of everything and
    is left out: a module that imports ``hcache`` for a name would loop through it."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        if module == "hcache":
            continue
        graph.setdefault(_package(module), set()).update(
            _package(m) for m in _imports(module, path, modules)[0] if m != "hcache" and _package(m) != _package(module)
        )
    for package in {p for targets in graph.values() for p in targets}:
        graph.setdefault(package, set())
    assert {"storage", "model", "serving", "config", "planning"} <= graph.keys() and "storage" in graph[
        "serving"
    ]  # the graph is read
    loops = {tuple(loop): sorted(f"{a} -> {b}" for a in loop for b in graph[a] if b in loop) for loop in _cycles(graph)}
    assert not loops, f"packages that import each other round a loop: {loops}"


def test_every_module_imports_in_a_fresh_interpreter():
    """Each module is imported by a child forked from an interpreter that holds the third-party packages but
    no hcache module, so each import starts from nothing of hcache (and costs a fork, not a torch import);
    a child per core at once. A module that needs a package not installed here (``hcache.vllm`` without
    vLLM) raises ModuleNotFoundError naming it, and is counted apart."""
    modules = _modules()
    third_party = sorted(
        set().union(*(_imports(m, p, modules)[1] for m, p in modules.items())) - set(sys.stdlib_module_names)
    )
    script = f"""
import importlib, json, os, sys, traceback
missing = set()
for name in {third_party!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            missing.add(name)  # not installed (vLLM where torch is a CUDA build): the modules that need it say so
    except Exception:
        pass  # an optional dependency that cannot load here: the module that needs it says so when imported
assert not any(m == "hcache" or m.startswith("hcache.") for m in sys.modules)
failed, without, running = [], [], {{}}

def reap():
    pid, status = os.wait()
    module, code = running.pop(pid), os.waitstatus_to_exitcode(status)
    if code == 2:
        without.append(module)
    elif code:
        failed.append(module)

for module in {sorted(modules)!r}:
    if len(running) >= (os.cpu_count() or 1):  # a child per core at once
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
            os._exit(0)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in missing:
                os._exit(2)  # it needs a package that is not installed, and says so
            traceback.print_exc()
            os._exit(1)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    running[pid] = module
while running:
    reap()
print(json.dumps({{"imported": len({sorted(modules)!r}) - len(failed) - len(without), "failed": failed,
                  "missing": sorted(missing), "without": sorted(without)}}))
sys.exit(1 if failed else 0)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["failed"] == [] and report["imported"] + len(report["without"]) == len(modules), report
    assert not report["without"] or report["missing"], report  # excused only for a package absent here


def test_nothing_outside_the_benchmarks_imports_them():
    """``hcache.bench`` is the benchmarks: production code stands without it. Only the command line imports
    ``hcache bench``'s command (its benchmark modules load when one is run); the check's
    speed step runs ``hcache bench`` as a command. Import statements are read from the graph, and any string
    naming a benchmark module (an ``importlib`` import) from the source."""
    modules = _modules()
    graph = {m: _imports(m, p, modules)[0] for m, p in modules.items()}
    assert "hcache.storage.redis_server" in graph["hcache.bench.storage"]  # the graph is read
    allowed = {"hcache.cli": {"hcache.bench", "hcache.bench.command"}}

    def benchmarks(names) -> set[str]:
        return {n for n in names if n == "hcache.bench" or n.startswith("hcache.bench.")}

    outside = {m: p for m, p in modules.items() if m != "hcache.bench" and not m.startswith("hcache.bench.")}
    imported = {m: sorted(benchmarks(graph[m]) - allowed.get(m, set())) for m in outside}
    named = {
        m: sorted(
            benchmarks(
                n.value
                for n in ast.walk(ast.parse(p.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            )
        )
        for m, p in outside.items()
    }
    imports, names = {m: b for m, b in imported.items() if b}, {m: b for m, b in named.items() if b}
    assert not imports, f"production modules that import hcache.bench: {imports}"
    assert not names, f"production modules that name a module of hcache.bench: {names}"
