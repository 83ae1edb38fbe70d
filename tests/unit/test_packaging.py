"""pyproject.toml declares what the package imports, each requirement once; tokenizers, which
only `prepare-data` imports, is an extra whose absence is one error line; the LICENSE is the
Apache-2.0 text pyproject names; every extra is described in docs/install.md."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ray_diloco.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]


def _names(requirements: list[str]) -> list[str]:
    """Canonical names, with their extras: jax[tpu] is not jax listed twice."""
    out = []
    for text in requirements:
        req = Requirement(text)
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(canonicalize_name(req.name) + extras)
    return out


def _imported_distributions() -> dict[str, set[str]]:
    """Distribution -> the package's files that import one of its modules."""
    owners = metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in (ROOT / "ray_diloco").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "ray_diloco":
                    continue
                for dist in owners.get(top, [top]):
                    found.setdefault(canonicalize_name(dist), set()).add(path.name)
    return found


def test_every_third_party_import_is_declared() -> None:
    declared = {n.split("[")[0] for n in _names(PROJECT["dependencies"])}
    for name, requirements in EXTRAS.items():
        if name != "dev":
            declared |= {n.split("[")[0] for n in _names(requirements)}
    missing = {d: files for d, files in _imported_distributions().items() if d not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_no_requirement_is_listed_twice() -> None:
    core = _names(PROJECT["dependencies"])
    assert len(core) == len(set(core)), core
    for name, requirements in EXTRAS.items():
        names = _names(requirements)
        assert len(names) == len(set(names)) and not set(names) & set(core), (name, names)


def test_tokenizers_is_the_data_extra_and_its_absence_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "tokenizers" not in _names(PROJECT["dependencies"])
    assert _names(EXTRAS["data"]) == ["tokenizers"]
    assert "ray-diloco[data]" in _names(EXTRAS["dev"])  # the tests run prepare-data
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises
    (tmp_path / "a.txt").write_text("some text")
    argv = ["prepare-data", "--input", str(tmp_path / "*.txt"), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "ray_diloco[data]" in err
    assert not (tmp_path / "out").exists()


def test_the_license_is_the_apache_2_text_pyproject_names() -> None:
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert " ".join(text.split()[:4]) == "Apache License Version 2.0,"
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_every_extra_is_described_in_the_install_page() -> None:
    page = (ROOT / "docs" / "install.md").read_text()
    for name, requirements in EXTRAS.items():
        assert f"'.[{name}]'" in page or f"| `{name}`" in page, name
        if name != "dev":
            for requirement in requirements:
                assert f"`{requirement.split('>')[0]}`" in page, (name, requirement)
