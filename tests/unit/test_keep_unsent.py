"""What a learner does with a new version of a fragment (LearnerCore.apply_received).
`diloco.keep_unsent_work`: it carries its unsent work on the fragment (the steps since it last
offered it) onto the new version instead of losing it to the overwrite, or to the mix with the
new version that keeps `diloco.mixing_alpha` of the learner's values. `diloco.apply_at`: it
applies the version on arrival, or no earlier than tau steps after its offer."""

from __future__ import annotations

import numpy as np
import pytest

from ray_diloco.algorithm import wire
from ray_diloco.algorithm.downstream import Message
from ray_diloco.algorithm.learner_core import LearnerCore
from ray_diloco.algorithm.setup import Setup
from ray_diloco.config import load_config
from tests.sync_helpers import TINY


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup.build(load_config(None, [*TINY, "diloco.keep_unsent_work=true"]))


def _learner(setup: Setup, keep: bool, *extra: str) -> LearnerCore:
    cfg = load_config(None, [*TINY, f"diloco.keep_unsent_work={keep}", *extra])
    snapshot = {
        p: (0, {k: np.asarray(setup.init[k], np.float32) for k in paths})
        for p, paths in enumerate(setup.plan.fragments)
    }
    return LearnerCore(cfg, cfg.learners[0], setup.task, setup.layout, setup.plan, snapshot)


def _train(core: LearnerCore, steps: int) -> None:
    for _ in range(steps):
        core.train_step(*core.next_batch())


def _publish(core: LearnerCore, p: int, version: int, shift: float) -> dict[str, np.ndarray]:
    """Version `version` of fragment p: the base moved by `shift` (bfloat16-exact)."""
    g = {k: (core.base_values[p][k] + shift).astype(np.float32) for k in core.base_values[p]}
    g = wire.decode_tree(wire.encode_tree(g, "bfloat16"))
    core.receive(Message(p, version, None, wire.encode_tree(g, "bfloat16")))
    assert core.apply_received() == [p]
    return g


@pytest.mark.parametrize("keep", [True, False])
def test_the_steps_since_the_last_offer_move_onto_the_new_version(setup: Setup, keep: bool):
    core = _learner(setup, keep)
    _train(core, 4)  # TINY: H = 4, P = 2: fragment 0 is offered at step 4
    offered = {p: (meta, delta) for meta, delta in core.offers() for p in [meta.fragment]}
    p = next(iter(offered))
    theta = {k: np.asarray(core.params[k], np.float32) for k in setup.plan.fragments[p]}
    _train(core, 3)  # unsent: three steps past the offer
    before = {k: np.asarray(core.params[k], np.float32) for k in theta}
    g = _publish(core, p, 1, 0.5)
    alpha = core.cfg.diloco.mixing_alpha  # without keeping: the mix of docs/algorithm.md section 4
    for k in theta:
        expected = g[k] + (before[k] - theta[k]) if keep else alpha * before[k] + (1 - alpha) * g[k]
        np.testing.assert_allclose(np.asarray(core.params[k]), expected, rtol=1e-6, atol=1e-6)
    assert core.steps_since[p] == (3 if keep else 0)
    assert core.tokens_since[p] == (3 * core.tokens_per_step if keep else 0)
    # without keeping, the three unsent steps are counted as overwritten (lost to G)
    assert core.overwritten_tokens == (0 if keep else 3 * core.tokens_per_step)
    # The next offer carries that work, against the new version.
    _train(core, 1)
    core._begin(p)
    [(meta, _)] = core.collect_offers()
    assert meta.base_version == 1 and meta.num_steps == (4 if keep else 1)


def test_with_no_offer_since_the_base_all_the_work_moves(setup: Setup):
    core = _learner(setup, True)
    _train(core, 2)  # nothing offered yet (fragments are due at steps 2 and 4)
    p = next(q for q in range(setup.plan.num_fragments) if q not in core.outstanding)
    before = {k: np.asarray(core.params[k], np.float32) for k in setup.plan.fragments[p]}
    base = core.base_values[p]
    g = _publish(core, p, 1, -0.25)
    for k, b in before.items():
        np.testing.assert_allclose(np.asarray(core.params[k]), g[k] + (b - base[k]), atol=1e-6)
    assert core.steps_since[p] == 2


@pytest.mark.parametrize("apply_at, held", [("arrival", 0), ("overlap", 2)])
def test_a_new_version_waits_for_the_overlap_only_when_asked(setup: Setup, apply_at, held):
    core = _learner(setup, False, f"diloco.apply_at={apply_at}")
    assert core.cfg.diloco.overlap_steps == 2
    _train(core, 4)  # fragment 0 is offered at step 4
    (meta, _), *_ = core.offers()
    p = meta.fragment
    q = next(f for f in range(setup.plan.num_fragments) if f not in core.outstanding)
    g = {k: v + 0.5 for k, v in core.base_values[p].items()}
    core.receive(Message(p, 1, None, wire.encode_tree(g, "bfloat16")))  # before the next step
    for _ in range(held):  # decoupled: held, never waited for (nothing blocks)
        assert core.apply_received() == [] and core.blocked_on() == []
        _train(core, 1)
    assert core.apply_received() == [p]
    assert core.base_version[p] == 1
    # A fragment not offered since its base takes a new version at once either way.
    g = {k: v + 0.5 for k, v in core.base_values[q].items()}
    core.receive(Message(q, 1, None, wire.encode_tree(g, "bfloat16")))
    assert core.apply_received() == [q]


def test_a_pulled_learner_offers_what_is_pulled_not_what_falls_due_on_its_own_count(
    setup: Setup,
):
    core = _learner(setup, False, "diloco.schedule=pull")
    _train(core, 4)  # TINY: H = 4, P = 2: fragment 0 falls due on its count at step 4
    assert core.offers() == []
    core.pull([1])  # the request arrives during step 5: offered at its boundary
    _train(core, 1)
    [(meta, _)] = core.offers()
    assert (meta.fragment, meta.num_steps, meta.base_version) == (1, 5, 0)
    _train(core, 1)
    assert core.offers() == []  # a pull is answered once
