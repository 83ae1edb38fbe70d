"""The layering rule (docs/design.md), with the layers read from the folders of ray_diloco/:
the pure layers (algorithm, tasks, sim, control, config, cluster) never import the Ray layer
(runtime), what watches a run (observe) or the entry points (cli), nor ray itself; control,
config and cluster import no jax either; observe imports neither ray nor jax; and no module
imports, through any chain, a module that imports it back (deferred and type-only imports
count: a cycle hidden in a function is still a cycle). Imports are read from the source (every
`import` statement, wherever it stands), and the pure layers are also imported in a fresh
interpreter, so an import that only happens at run time cannot hide either."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ray_diloco"
PURE = ("algorithm", "tasks", "sim", "control", "config", "cluster")
NO_JAX = ("control", "config", "cluster", "observe")
UPPER = ("runtime", "observe", "cli")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else module


def _imports(module: str) -> set[str]:
    """Every module named by an import statement in `module`'s source (ray_diloco's own
    resolved to modules of the tree; others by their top-level name)."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            if name.startswith("ray_diloco"):
                while name not in MODULES and "." in name:
                    name = name.rpartition(".")[0]
                if name in MODULES and name != module:
                    out.add(name)
            else:
                out.add(name.split(".")[0])
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def test_the_layers_are_the_folders() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(PURE) | set(UPPER)
    loose = {p.name for p in PACKAGE.glob("*.py")}
    assert loose == {"__init__.py", "api.py", "task.py"}  # the public API and the contract


@pytest.mark.parametrize("layer", (*PURE, "observe"))
def test_a_layer_imports_only_what_lies_below_it(layer: str) -> None:
    forbidden = {"ray"} | ({"jax", "jaxlib", "flax", "optax"} if layer in NO_JAX else set())
    for module, imported in GRAPH.items():
        if _layer(module) != layer:
            continue
        upward = {m for m in imported if m.startswith("ray_diloco.") and _layer(m) in UPPER}
        if layer == "observe":
            upward = {m for m in upward if _layer(m) != "observe"}
        assert not upward, f"{module} imports {sorted(upward)}"
        assert not imported & forbidden, f"{module} imports {sorted(imported & forbidden)}"


def test_no_module_imports_itself_through_a_chain() -> None:
    # Tarjan's strongly connected components over ray_diloco's own modules.
    own = {m: {i for i in GRAPH[m] if i in MODULES} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in own[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for m in MODULES:
        if m not in index:
            visit(m)
    # A package's __init__ that re-exports its own modules is not a cycle of concepts.
    cycles = [c for c in cycles if not all(m.startswith(c[0]) for m in c)]
    assert cycles == []


def test_no_two_layers_import_each_other() -> None:
    edges = {
        (_layer(m), _layer(i))
        for m, imported in GRAPH.items()
        for i in imported
        if i in MODULES and _layer(m) != _layer(i)
    }
    assert sorted((a, b) for a, b in edges if (b, a) in edges) == []


_CHILD = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(info.name)
json.dump(sorted(sys.modules), sys.stdout)
"""


@pytest.mark.parametrize("layer", (*PURE, "observe"))
def test_importing_a_layer_loads_no_ray(layer: str) -> None:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, f"ray_diloco.{layer}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    loaded = json.loads(res.stdout)
    tops = {m.split(".")[0] for m in loaded}
    assert "ray" not in tops
    if layer in NO_JAX:
        assert "jax" not in tops


def test_the_supervisor_imports_no_jax() -> None:
    # Every run waits for the supervisor's boot before a learner is created, and the learners
    # load JAX themselves: ml_dtypes alone took 0.7 s of the supervisor's 1.4 s import.
    module = "ray_diloco.runtime.supervisor.actor"
    code = f"import json, sys, {module}; json.dump(sorted(sys.modules), sys.stdout)"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr
    tops = {m.split(".")[0] for m in json.loads(res.stdout)}
    assert not tops & {"jax", "jaxlib", "ml_dtypes", "flax", "optax", "orbax"}, tops
