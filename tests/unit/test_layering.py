"""The layering rule (design.md): algorithm/ never imports ray; control/ and cluster/ import
neither ray nor jax. Checked in a fresh interpreter so other tests' imports cannot hide a
violation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONTROL_MODULES = [
    "ray_diloco.control.events",
    "ray_diloco.control.policy",
    "ray_diloco.control.chaos",
    "ray_diloco.control.tape",
    "ray_diloco.control.goodput",
    "ray_diloco.control.supervision",
    "ray_diloco.control.degradation",
    "ray_diloco.control.recovery",
]

_PURE_CHILD = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
imported, skipped = [pkg.__name__], []
for info in pkgutil.iter_modules(getattr(pkg, "__path__", []), pkg.__name__ + "."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as err:
        # A missing optional dependency (say jax on a bare machine) is not a layering
        # violation, but an attempt to import ray is.
        if err.name and (err.name == "ray" or err.name.startswith("ray.")):
            raise
        skipped.append(f"{info.name}: {err}")
        continue
    imported.append(info.name)
json.dump({"imported": imported, "skipped": skipped, "modules": sorted(sys.modules)}, sys.stdout)
"""


def _run(code: str, *args: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _top_level(modules: list[str], name: str) -> list[str]:
    return [m for m in modules if m == name or m.startswith(name + ".")]


def test_control_imports_neither_ray_nor_jax():
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in CONTROL_MODULES)
        + "json.dump({'modules': sorted(sys.modules)}, sys.stdout)\n"
    )
    modules = _run(code)["modules"]
    assert set(CONTROL_MODULES) <= set(modules)
    assert _top_level(modules, "ray") == []
    assert _top_level(modules, "jax") == []


@pytest.mark.parametrize("package", ["ray_diloco.algorithm", "ray_diloco.sim", "ray_diloco.tasks"])
def test_pure_packages_do_not_import_ray(package):
    out = _run(_PURE_CHILD, package)
    assert len(out["imported"]) > 1, f"no {package} module could be imported: {out['skipped']}"
    assert _top_level(out["modules"], "ray") == [], out["imported"]


def test_cluster_imports_neither_ray_nor_jax():
    # `ray-diloco plan` must run where neither a Ray cluster nor an accelerator is.
    out = _run(_PURE_CHILD, "ray_diloco.cluster")
    assert len(out["imported"]) == 4, out  # the package, slices, files, plan
    assert _top_level(out["modules"], "ray") == []
    assert _top_level(out["modules"], "jax") == []


WATCHING_MODULES = [
    "ray_diloco.progress",
    "ray_diloco.display",
    "ray_diloco.run_report",
    "ray_diloco.run_plots",
    "ray_diloco.grafana",
    "ray_diloco.metrics",
]


def test_what_watches_a_run_imports_neither_ray_nor_jax():
    # The report and the displays must work where only the run dir is (a laptop, CI).
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in WATCHING_MODULES)
        + "json.dump({'modules': sorted(sys.modules)}, sys.stdout)\n"
    )
    modules = _run(code)["modules"]
    assert set(WATCHING_MODULES) <= set(modules)
    assert _top_level(modules, "ray") == []
    assert _top_level(modules, "jax") == []
