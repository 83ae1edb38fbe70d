"""Layer: tasks (pure, no Ray). Where data lives: a local path or an fsspec URL (gs://, s3://,
file://, memory://, ...), opened through fsspec's file systems, so a corpus or a directory of
token files can stay in its bucket. gs:// needs gcsfs and s3:// needs s3fs (the `gcs` and `s3`
extras); fsspec's message says which when one is missing."""

from __future__ import annotations

from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem


def is_url(location: str) -> bool:
    return "://" in location


def filesystem(location: str, field: str) -> tuple[Any, str]:
    """The file system of `location` and the path on it; errors name `field`."""
    try:
        return url_to_fs(location)
    except (ImportError, ValueError) as err:  # the protocol's package is not installed; unknown
        raise ValueError(f"{field}={location!r}: {err}") from None


def is_local(fs: Any) -> bool:
    """Whether paths on `fs` are files of this machine (a memory map can read them in place)."""
    return isinstance(fs, LocalFileSystem)
