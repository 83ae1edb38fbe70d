"""Layer: config (pydantic only). A learner's mesh: the axes its devices are laid out on and
how large each is, resolved against the learner's device count."""

from __future__ import annotations

from pydantic import Field

from ray_diloco.config.base import _Frozen

MESH_AXES = ("data", "fsdp", "tensor")  # outermost first: tensor is innermost (fastest links)


class MeshConfig(_Frozen):
    """The learner's one mesh over every device of every host of its slice. -1 takes what the
    other axes leave (at most one axis). The batch is split over `data` x `fsdp`; the default
    sharding rule splits each large leaf over `fsdp` (algorithm/partitioning.py)."""

    data: int = Field(1, description="replicas of the parameters; the batch is split over them")
    fsdp: int = Field(-1, description="parameters, optimizer state and batch split over it")
    tensor: int = Field(1, description="for the task's tensor-parallel rules only")
    min_shard_elements: int = Field(
        2**14, ge=1, description="the default rule replicates smaller leaves (biases, scales)"
    )

    def sizes(self, num_devices: int) -> dict[str, int]:
        """Axis sizes over `num_devices` devices (the -1 resolved). Raises ValueError."""
        given = {axis: getattr(self, axis) for axis in MESH_AXES}
        bad = [f"{axis}={n}" for axis, n in given.items() if n == 0 or n < -1]
        if bad:
            raise ValueError(f"mesh {', '.join(bad)}: an axis size is >= 1, or -1 for the rest")
        free = [axis for axis, n in given.items() if n == -1]
        if len(free) > 1:
            raise ValueError(f"mesh: only one axis may be -1, got {free}")
        fixed = 1
        for n in given.values():
            fixed *= max(n, 1)
        if free:
            if num_devices % fixed:
                raise ValueError(
                    f"mesh {self.describe()}: the fixed axes ({fixed} devices) do not divide "
                    f"the learner's {num_devices} devices"
                )
            given[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ValueError(
                f"mesh {self.describe()} spans {fixed} devices but the learner has "
                f"{num_devices}; make the sizes multiply to {num_devices} or set one to -1"
            )
        return given

    def describe(self) -> str:
        return "{" + ", ".join(f"{a}: {getattr(self, a)}" for a in MESH_AXES) + "}"
