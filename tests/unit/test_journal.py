"""The synchronizer's journal (control/journal.py): plain Python, no Ray."""

from __future__ import annotations

from ray_diloco.control.events import RoundClosed, event_from_dict
from ray_diloco.control.journal import Journal


def test_events_drain_in_order_from_a_sequence_number():
    j = Journal()
    for v in (1, 2, 3):
        j.record(RoundClosed(t=100.0 + v, fragment=0, version=v, num_contributors=2, tokens=64))
    events, seq = j.events_since(0)
    assert seq == 3 and [e["version"] for e in events] == [1, 2, 3]
    assert event_from_dict(events[0]) == RoundClosed(101.0, 0, 1, 2, 64)
    later, seq2 = j.events_since(seq)
    assert later == [] and seq2 == 3


def test_progress_only_moves_forward_and_keeps_the_last_loss():
    j = Journal()
    j.progress("a", step=5, cursor=640, loss=3.0, step_time_s=0.1)
    j.progress("a", step=4, cursor=512, loss=None, step_time_s=None)  # a late report
    row = j.learner_table()["a"]
    assert (row.step, row.cursor, row.loss, row.step_time_s) == (5, 640, 3.0, 0.1)
    assert row.reports == 2
    assert j.last_loss is None
    j.eval_point(tokens=640, rounds=3, loss=2.5)
    assert j.last_loss == 2.5 and j.evals[0]["rounds"] == 3
