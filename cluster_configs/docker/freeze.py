"""Writes constraints.txt: the exact version of every package the image installs (the closure of
pyproject.toml's dependencies and its `tpu` extra), as installed in the environment that runs it,
so two builds of the image get the same jax, flax, optax, orbax and ray as the tested checkout.

    python cluster_configs/docker/freeze.py > cluster_configs/docker/constraints.txt

A package the extra names that this environment lacks (libtpu off a TPU host) is left to
the pin of the package that asks for it (jax[tpu] names its libtpu exactly).
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGE_EXTRAS = ("tpu",)


def _wanted(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in extras or {""})


def closure(roots: list[Requirement]) -> dict[str, str]:
    """Installed name -> version of `roots` and everything they pull, extras included."""
    pins: dict[str, str] = {}
    todo = [(r, set(r.extras)) for r in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        key = (canonicalize_name(req.name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        pins[dist.metadata["Name"]] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if _wanted(sub, extras):
                todo.append((sub, set(sub.extras)))
    return pins


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = project["dependencies"] + [
        t for e in IMAGE_EXTRAS for t in project["optional-dependencies"][e]
    ]
    pins = closure([Requirement(t) for t in texts])
    sys.stdout.write(
        "# The versions the image installs with (pip install -c constraints.txt); written by\n"
        "# `python cluster_configs/docker/freeze.py > cluster_configs/docker/constraints.txt`\n"
    )
    for name in sorted(pins, key=canonicalize_name):
        sys.stdout.write(f"{name}=={pins[name]}\n")


if __name__ == "__main__":
    main()
