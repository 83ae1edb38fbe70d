"""The run config as commented YAML, generated from the pydantic models (`ray-diloco config`).

Every field of every section is one line: its value, then a comment with its type, its bounds
and its description. The text is the config itself, so it loads back to the same `RunConfig`;
an empty list or mapping of sections (links, chaos.faults) carries the fields of one entry as
comment lines below it.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ray_diloco.config.schema import RunConfig

REQUIRED = "REQUIRED"
# pydantic keeps a field's bounds as metadata objects with one of these attributes
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def describe_config(cfg: RunConfig | None = None) -> str:
    """`cfg` (default: the built-in defaults) as YAML with every field explained."""
    cfg = RunConfig() if cfg is None else cfg
    head = [f"# {line}".rstrip() for line in _doc(RunConfig).splitlines()]
    return "\n".join([*head, *_model(RunConfig, cfg.model_dump(mode="json"), 0, True)]) + "\n"


def _model(cls: type[BaseModel], values: dict[str, Any], indent: int, notes: bool) -> list[str]:
    lines: list[str] = []
    for name, field in cls.model_fields.items():
        lines += _field(name, field, values.get(name, REQUIRED), indent, notes)
    return lines


def _field(name: str, field: FieldInfo, value: Any, indent: int, notes: bool) -> list[str]:
    pad = " " * indent
    note = f"  # {_note(field)}" if notes and _note(field) else ""
    section, container = _section_of(field.annotation)
    if section is not None and isinstance(value, dict) and container is None:
        doc = f"  # {_doc(section).splitlines()[0]}" if notes and _doc(section) else ""
        return [f"{pad}{name}:{doc}", *_model(section, value, indent + 2, notes)]
    if section is not None and container is not None and value:
        lines = [f"{pad}{name}:{note}"]
        entries = value.items() if container is dict else enumerate(value)
        for i, (key, entry) in enumerate(entries):
            body = _model(section, entry, indent + 4, notes and i == 0)
            if container is dict:
                lines += [f"{pad}  {key}:", *body]
            else:
                lines += [f"{pad}  - {body[0].lstrip()}", *body[1:]]
        return lines
    lines = [f"{pad}{name}: {_flow(value)}{note}"]
    if section is not None and notes:  # an empty list or mapping: one entry's fields
        key = "NAME:" if container is dict else "-"
        defaults = {n: _default(f) for n, f in section.model_fields.items()}
        entry = _model(section, defaults, 0, True)
        lines += [f"{pad}#   {key} ({section.__name__})"]
        lines += [f"{pad}#     {line}" for line in entry]
    return lines


def _section_of(annotation: Any) -> tuple[type[BaseModel] | None, type | None]:
    """The section a field holds and how: (model, None), (model, list) or (model, dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (tuple, list) and args and _is_model(args[0]):
        return args[0], list
    if origin is dict and len(args) == 2 and _is_model(args[1]):
        return args[1], dict
    return None, None


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _default(field: FieldInfo) -> Any:
    if field.is_required():
        return REQUIRED
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, tuple | list):
        return [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    return value


def _note(field: FieldInfo) -> str:
    parts = [_type_name(field.annotation)]
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sign} {getattr(meta, attr)}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            parts.append(f"matching {pattern}")
    if field.is_required():
        parts.append("required")
    note = ", ".join(parts)
    return f"{note}: {field.description}" if field.description else note


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "null"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _flow(value: Any) -> str:
    """One YAML value on one line (PyYAML's own spelling: 2.0e-06, 'yes', null)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9)
    return text.removesuffix("\n...\n").strip()


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())
