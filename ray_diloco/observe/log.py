"""Layer: observe. Logging setup for the CLI and the actors (one format, level from the CLI)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "WARNING") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING), format=FORMAT)
