"""A synchronizer outage in the in-process run (docs/algorithm.md section 7, `diloco.accelerate`):
learners train through it, and their first offers after it carry the whole outage's work.
Taken through the outer momentum as a whole, that work carried G far past it; taken as one
sync window's worth, the rest applied as it is, the run ends as well as the fault-free one."""

from __future__ import annotations

import pytest

from ray_diloco.config import build_config
from ray_diloco.sim.simulate import run_reference
from tests.chaos.chaos_helpers import chaos_tree

BUDGET = 72000
# Virtual seconds. The learners train some 49k tokens in it: the first rounds after it merge
# about 60 inner steps per contribution where a window is 6.
OUTAGE = (5.0, 13.0)


def _overwriting() -> dict:
    """The chaos suite's config, with learners that overwrite their values with each new
    version (docs/algorithm.md section 4). With the default mix (alpha 0.25) the whole outage's work
    taken through the momentum did no harm here (1.794 against 1.827 taken as one window;
    fault-free 1.866), so the rule is pinned where it matters."""
    tree = chaos_tree(BUDGET, [])
    # learners offering on their own count and dropping unsent work on a new version, with the
    # grace window and the staleness bound the figures below were measured with
    tree["diloco"] |= {
        "schedule": "offer",
        "keep_unsent_work": False,
        "mixing_alpha": 0.0,
        "grace_fraction": 0.5,
        "max_staleness_versions": 4,
    }
    return tree


def _run(accelerate: str) -> dict:
    tree = _overwriting()
    # As the chaos suite runs past a synchronizer restart: the planned budget's schedule,
    # and a quarter budget more after the outage's work is merged.
    tree["token_budget"] = 97872
    tree["diloco"]["accelerate"] = accelerate
    return run_reference(build_config(tree), outage=OUTAGE)


def test_outage_work_is_taken_not_amplified() -> None:
    fault_free = run_reference(build_config(_overwriting()))["heldout_loss"]
    window, amplified = _run("window"), _run("all")
    assert window["outage_refusals"] > 50
    assert window["outage_refusals"] == amplified["outage_refusals"]
    # Measured (deterministic): window 2.161, all 2.418; fault-free 2.170 (the sqrt step; with
    # the fraction step 2.039, 2.827 and 2.038).
    assert window["heldout_loss"] < fault_free + 0.1, (window["heldout_loss"], fault_free)
    assert amplified["heldout_loss"] > window["heldout_loss"] + 0.2


def test_an_outage_needs_the_decoupled_mode() -> None:
    tree = chaos_tree(BUDGET, [])
    tree["diloco"]["mode"] = "synchronous"
    with pytest.raises(ValueError, match="decoupled"):
        run_reference(build_config(tree), outage=OUTAGE)
