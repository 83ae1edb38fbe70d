"""Which persistent compilation cache a run's processes use: the run's own, unless the
environment names one for many runs (JAX's `JAX_COMPILATION_CACHE_DIR`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import jax
import pytest

from ray_diloco.config import build_config
from ray_diloco.runtime.learner.compile_cache import use_compilation_cache


@pytest.fixture
def restore_jax_cache_config() -> Iterator[None]:
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


@pytest.mark.usefixtures("restore_jax_cache_config")
def test_a_run_caches_in_its_run_dir_unless_the_environment_names_a_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = build_config({"run_dir": str(tmp_path / "run")})
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    own = str(tmp_path / "run" / "jax_cache")
    assert use_compilation_cache(cfg) == own == jax.config.jax_compilation_cache_dir
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "shared"))
    assert use_compilation_cache(cfg) == str(tmp_path / "shared")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "shared")
