"""The `ray-diloco` command as a new user meets it: `--version`, a description and examples for
every subcommand (no module docstring in any help), the format of `scale --add SPEC`, and
`ray-diloco config`, the run config's schema with its defaults, which loads back as a config."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from ray_diloco.cli import main
from ray_diloco.cli.help import COMMANDS
from ray_diloco.config import RunConfig, build_config
from ray_diloco.config.describe import _section_of


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's --help and --version
        rc = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_version_names_the_package_and_what_it_runs_on(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0
    assert out.startswith(f"ray-diloco {metadata.version('ray_diloco')} (")
    assert f"ray {metadata.version('ray')}" in out and f"jax {metadata.version('jax')}" in out


def test_the_command_list_is_every_subcommand_with_its_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = _run(["--help"], capsys)
    assert rc == 0 and "Layer:" not in out
    flat = " ".join(out.split())
    for name, command in COMMANDS.items():
        assert f"{name} {' '.join(command.summary.split())}" in flat, name
    assert "examples:" in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_a_description_and_examples(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run([name, "--help"], capsys)
    assert rc == 0
    assert out.startswith(f"usage: ray-diloco {name}")
    assert "Layer:" not in out and '"""' not in out  # no module docstring leaks into the help
    assert " ".join(COMMANDS[name].description.split()) in " ".join(out.split())
    examples = [ln for ln in out.split("examples:\n", 1)[1].splitlines() if ln.strip()]
    assert examples and all(ln.startswith(f"  ray-diloco {name}") for ln in examples)


def test_scale_help_says_what_a_spec_is(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(["scale", "--help"], capsys)
    flat = " ".join(out.split())
    assert "--add SPEC" in out and "comma-separated key=value pairs" in flat
    assert "name= is required" in flat


def _fields(cls: type[BaseModel], seen: set[type[BaseModel]]) -> set[str]:
    seen.add(cls)
    names = set(cls.model_fields)
    for field in cls.model_fields.values():
        section, _ = _section_of(field.annotation)
        if section is not None and section not in seen:
            names |= _fields(section, seen)
    return names


def test_config_prints_every_field_and_loads_back_as_the_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = _run(["config"], capsys)
    assert rc == 0
    tree: dict[str, Any] = yaml.safe_load(out)
    assert build_config(tree) == RunConfig()
    for name in _fields(RunConfig, set()):
        assert f"{name}:" in out, name  # a field of a section, shown even when empty by default
    assert "token_budget: 2000000  # int, >= 1" in out


def test_config_shows_a_jobs_values(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["config", "--set", "diloco.quorum_min=2", "--set", "seed=7"], capsys)
    assert rc == 0
    cfg = build_config(yaml.safe_load(out))
    assert cfg.diloco.quorum_min == 2 and cfg.seed == 7


def test_config_with_a_bad_override_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["config", "--set", "diloco.quorum_mn=2"], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and "quorum_mn" in err and "Traceback" not in err
