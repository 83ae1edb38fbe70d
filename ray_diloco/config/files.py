"""Config files: YAML as the configs are written, dotted `--set` overrides, one error line
per problem naming the field or file and the fix, and the run dir's config dump."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ray_diloco.config.base import ConfigError
from ray_diloco.config.schema import RunConfig


class _Loader(yaml.SafeLoader):
    """YAML as the configs are written: `1e6` and `3.0e-4` are numbers, as in YAML 1.2 (PyYAML
    follows YAML 1.1, where a float needs a dot and a signed exponent: `1e6` is a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str) -> Any:
    """`text` read as YAML; a syntax error is a ConfigError naming `source` and the spot."""
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader: plain data only
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML ({where}{problem}); fix the syntax") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to read; flatten it") from None


def whole_number(text: str) -> int:
    """An argparse type: a whole number, also written as `1e6` or `1_000_000`."""
    try:
        return int(text)
    except ValueError:
        value = float(text)  # a ValueError here reads "invalid whole_number value" in argparse
    if not value.is_integer():
        raise ValueError(f"{text} is not a whole number")
    return int(value)


def _set_dotted(tree: dict[str, Any], dotted: str) -> None:
    key, sep, raw = dotted.partition("=")
    parts = [part.strip() for part in key.strip().split(".")]
    if not sep or not all(parts):
        raise ConfigError(f"--set {dotted!r}: expected key.path=value, e.g. diloco.quorum_min=2")
    value = parse_yaml(raw, f"--set {key}")
    node: Any = tree
    for i, part in enumerate(parts):
        above = ".".join(parts[:i])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                item = [str(len(node) - 1)] if part.isdigit() else ["0", part]
                example = ".".join([above, *item, *parts[i + 1 :]])
                raise ConfigError(
                    f"--set {key}: {above} is a list of {len(node)} items; name one by its "
                    f"index, e.g. --set {example}={raw.strip()}"
                )
            index: int | str = int(part)
        elif isinstance(node, dict):
            index = part
        else:
            raise ConfigError(f"--set {key}: {above} is a value, not a section; check the key")
        if i == len(parts) - 1:
            node[index] = value
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            node = node[index]


def format_validation_error(err: ValidationError, source: str, prefix: str = "") -> str:
    """One line per problem, each naming the dotted field (after `prefix`), what was given
    when the type is wrong, and the fix."""
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = prefix + ".".join(str(p) for p in e["loc"]) if e["loc"] else "<root>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; check the spelling against the schema"
        elif e["type"] not in ("missing", "value_error") and not isinstance(
            e.get("input"), dict | list
        ):
            given = repr(e.get("input"))
            msg += f" (got {given if len(given) <= 60 else given[:57] + '...'})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def build_config(tree: dict[str, Any], source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def add_config_args(p: argparse.ArgumentParser, config_help: str, example: str) -> None:
    """`--config FILE` and repeatable `--set KEY=VALUE` (into `args.overrides`), the one way
    every command takes a run config."""
    p.add_argument("--config", help=config_help)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted override, repeatable, e.g. --set {example}",
    )


def load_config(path: str | Path | None, overrides: tuple[str, ...] | list[str] = ()) -> RunConfig:
    """Load a YAML config (or the defaults when `path` is None) and apply dotted overrides."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory; pass a YAML file in it")
        if not p.is_file():
            raise ConfigError(f"config file {p} not found; pass --config jobs/local.yaml")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(
                f"config file {p}: cannot read it ({err}); pass a YAML file"
            ) from None
        loaded = parse_yaml(text, str(p))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        tree = loaded or {}
        source = str(p)
    apply_overrides(tree, overrides)
    return build_config(tree, source)


def check_output_dir(path: str | Path, field: str) -> None:
    """Raise a ConfigError naming `field` unless `path` is, or can be created as, a writable
    directory. Writes nothing: the nearest existing ancestor is probed with a temporary
    directory that is removed at once (permission bits alone miss read-only or virtual file
    systems, and root passes every permission check)."""
    where = Path(path).absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"{field}={path}: {existing} is a file, not a directory; pick another {field}"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=existing))
    except OSError as err:
        raise ConfigError(
            f"{field}={path}: cannot write in {existing} ({err.strerror}); pick another {field}"
        ) from None


def apply_overrides(tree: dict[str, Any], overrides: tuple[str, ...] | list[str]) -> None:
    """Apply dotted `key.path=value` overrides to a config tree (in place)."""
    if overrides and "learners" not in tree and any(o.startswith("learners.") for o in overrides):
        tree["learners"] = [lg.model_dump() for lg in RunConfig().learners]
    for o in overrides:
        _set_dotted(tree, o)


def dump_config(cfg: RunConfig, path: Path) -> None:
    """Write the validated config as JSON (run_dir/config.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True))


def config_digest(cfg: RunConfig) -> str:
    """Digest of the whole validated config: tells a driver whether an existing synchronizer
    serves its run; the event tape's RunStarted carries it too."""
    # Sorted keys: the same config written with its task_args in another order is the same run.
    canonical = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
