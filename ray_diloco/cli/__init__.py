"""Layer: cli. The `ray-diloco` command (`commands.py`), thin over the public API: the
subcommands parse, validate and hand over to the runtime, the simulators or the plan."""

from ray_diloco.cli.commands import main

__all__ = ["main"]
