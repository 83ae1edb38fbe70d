"""The configuration's common ground: the error every config problem raises and the frozen
model every section is."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field and the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


WireDtype = Literal["float32", "bfloat16", "int8", "int4", "int2"]
