"""A config crosses to Ray actors pickled as its values and is validated again on arrival
(config/base.py), so a driver and actors of different ray_diloco versions fail loudly, naming
the field, or agree, never half-agree."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import cloudpickle
import pytest
from pydantic import ValidationError

from ray_diloco.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_config_survives_pickling_as_itself(path: Path) -> None:
    cfg = load_config(path)
    for dumps in (pickle.dumps, cloudpickle.dumps):  # Ray pickles actor arguments with the latter
        back = pickle.loads(dumps(cfg))
        assert type(back) is RunConfig and back == cfg


def test_a_config_from_another_version_takes_defaults_or_names_the_unknown_field() -> None:
    rebuild, (cls, values) = load_config(None).__reduce__()
    older = copy.deepcopy(values)  # a driver from before `outer.warmup_rounds` existed
    del older["outer"]["warmup_rounds"]
    assert rebuild(cls, older).outer.warmup_rounds == 0
    newer = copy.deepcopy(values)  # a driver from after a field this process does not know
    newer["outer"]["lookahead"] = 2
    with pytest.raises(ValidationError, match=r"outer\.lookahead\s+Extra inputs are not permitted"):
        rebuild(cls, newer)
