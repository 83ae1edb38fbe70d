"""Property-based fuzzing of the config boundary: whatever a user writes in a YAML
file, a `--set key=value` or a `scale --add` spec either loads or raises the project's
`ConfigError` (one `error:` line in the CLI), never anything else.

Inputs mix the schema's real dotted paths (so deep fields and list items are reached) with
made-up keys, and values with the troublemakers seen in practice: `1e6`, YAML syntax errors,
tags, dates, lists and mappings where scalars belong, huge and non-finite numbers.
`pytest tests/unit/test_config_fuzz.py --hypothesis-show-statistics` prints the example counts.
"""

from __future__ import annotations

import tempfile
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from ray_diloco.config import ConfigError, RunConfig, build_config, load_config
from ray_diloco.runtime.scale import parse_spec

EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a loaded machine stalls any single example now and then
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.too_slow],
)


def _schema_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted field path of the config schema; list and dict sections get an index or
    key (in range and out of it)."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        ann = field.annotation
        args = typing.get_args(ann)
        inner = [a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        origin = typing.get_origin(ann)
        if not inner:
            continue
        if origin is tuple:
            for item in ("0", "1", "9"):
                out += _schema_paths(inner[0], f"{path}.{item}.")
        elif origin is dict:
            out += _schema_paths(inner[0], f"{path}.some-region.")
        else:
            out += _schema_paths(inner[0], f"{path}.")
    return out


PATHS = _schema_paths(RunConfig)

TRICKY = [
    "1e6", "1.5e3", "-1e-3", "1e400", "-0", "0x1F", "0o17", "1_000", "3.", ".5", ".inf",
    "-.inf", ".nan", "true", "no", "null", "~", "[]", "{}", "[1, 2]", "{a: 1}", "'quoted'",
    '"x"', "[", "{", "]", ":", "- a", "a: b: c", "!!binary aGk=", "!!python/object:os.system x",
    "2024-01-01", "12:30:00", "&a x", "*a", "? x", "|", ">", "%YAML 1.1", "---", "...",
    "decoupled", "synchronous", "rda", "int4", "cpu", "tpu-v5p", "2x2x2", "us-east5",
]  # fmt: skip

scalars = st.one_of(
    st.sampled_from(TRICKY),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
keys = st.one_of(
    st.sampled_from(PATHS),
    st.lists(st.sampled_from([*PATHS, "x", "0", "12", "", " "]), min_size=1, max_size=3).map(
        lambda parts: ".".join(p.split(".")[-1] for p in parts)
    ),
    st.text(max_size=12),
)
overrides = st.lists(
    st.one_of(st.tuples(keys, scalars).map(lambda kv: f"{kv[0]}={kv[1]}"), st.text(max_size=20)),
    min_size=1,
    max_size=4,
)


def _loads_or_config_error(load: Any) -> None:
    try:
        result = load()
    except ConfigError:
        return
    assert isinstance(result, RunConfig | dict)


@FUZZ
@given(overrides)
def test_every_set_override_loads_or_raises_config_error(items: list[str]) -> None:
    _loads_or_config_error(lambda: load_config(None, items))


def _tree(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A config tree with each value at its dotted path (a later value may replace a section)."""
    tree: dict[str, Any] = {}
    for path, value in pairs:
        node: Any = tree
        *above, last = path.split(".")
        for part in above:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return tree


yaml_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**30), 10**30),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=10),
        st.sampled_from(TRICKY),
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
trees = st.lists(st.tuples(st.sampled_from(PATHS), yaml_values), max_size=6).map(_tree)


@FUZZ
@given(trees, st.sampled_from(["yaml", "raw"]), st.text(max_size=60))
def test_every_yaml_file_loads_or_raises_config_error(
    tree: dict[str, Any], form: str, raw: str
) -> None:
    text = yaml.safe_dump(tree) if form == "yaml" else raw
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(text)
        _loads_or_config_error(lambda: load_config(path))
    _loads_or_config_error(lambda: build_config(tree))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["name", "region", "batch_size", "x", ""]), scalars)))
def test_every_scale_spec_parses_or_raises_config_error(pairs: list[tuple[str, str]]) -> None:
    text = ",".join(f"{k}={v}" for k, v in pairs)
    _loads_or_config_error(lambda: parse_spec(text))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learners.x=1", r"learners is a list of 4 items; .* --set learners\.0\.x=1"),
        ("learners.7.speed=2", r"--set learners\.3\.speed=2"),
        ("token_budget=[", r"--set token_budget: not valid YAML \(line 1, column 2"),
        ("token_budget=1e-3", r"token_budget: .*fractional part \(got 0\.001\)"),
        ("learners.0.name.x=1", r"learners\.0\.name is a value, not a section"),
        ("diloco..mode=rda", r"expected key\.path=value"),
    ],
)
def test_bad_overrides_name_the_field_and_the_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_numbers_in_exponent_form_are_numbers() -> None:
    cfg = load_config(None, ["token_budget=1e6", "inner.lr=3e-4", "outer.lr=7E-1"])
    assert (cfg.token_budget, cfg.inner.lr, cfg.outer.lr) == (1_000_000, 3e-4, 0.7)
