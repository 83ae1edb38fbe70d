"""The configuration's common ground: the error every config problem raises and the frozen
model every section is."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, with a message that names the field and the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (to a Ray actor, by the driver) as the values it holds, and validated again
        # by the receiving process's own schema: a driver and actors of different ray_diloco
        # versions then agree on every field both know, a field the sender lacks takes the
        # receiver's default, and one the receiver does not know fails there, named. Pickled
        # as pydantic does by default (its __dict__), a config from an older driver reached
        # newer actors without a field added since, and every merge raised AttributeError.
        return (_rebuild, (type(self), self.model_dump(mode="python", round_trip=True)))


def _rebuild(cls: type[_Frozen], values: dict[str, Any]) -> _Frozen:
    return cls.model_validate(values)


WireDtype = Literal["float32", "bfloat16", "int8", "int4", "int2"]
