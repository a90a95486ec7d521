"""The worker's outbox (taskrunner/worker/outbox.py): what a sync carries goes back when the sync
fails, before what came since, and each outcome gets its own finish answer."""

from __future__ import annotations

from taskrunner.protocol import scripts
from taskrunner.protocol.claims import Delivery
from taskrunner.protocol.outcome import Outcome
from taskrunner.worker.outbox import Outbox


def delivery(job_id: str, attempt: str = "1") -> Delivery:
    return Delivery("default", job_id, attempt, "tests.apps.add", "[]", "{}", 30.0)


def test_a_failed_sync_puts_its_load_back_first_and_answers_pair_with_outcomes(app):
    box = Outbox(app)
    assert box.empty() and box.outcomes_since is None
    a, b = delivery("a"), delivery("b")
    box.report(a, Outcome.completed("1"))
    box.mark_stuck(a)
    assert box.note(a, {"progress": ["a", "1", 0.5, "half"]}, 0.0)
    assert not box.note(a, {"progress": ["a", "1", 7, ""]}, 0.0)  # not a fraction: refused
    first = box.put_into(scripts.Batch(app.redis), 0.0)
    assert box.load.ended == {} and box.holds("a") and not box.empty()
    box.report(b, Outcome.failed("E", "m"))
    box.failed()  # the sync carrying `first` failed
    assert [e.id for e in box.load.ended["default"]] == ["a", "b"] and box.load.marks == first.marks
    assert box.notes.pending and not box.on_the_way

    batch = scripts.Batch(app.redis)
    load = box.put_into(batch, 0.0)
    answers = box.answered(load, batch.execute())
    # Neither delivery holds a job in Redis: finish.lua answers 0 (not this delivery) for each.
    assert [(q, e.id, e.task, ack) for q, e, ack in answers] == [("default", "a", "tests.apps.add", 0),
                                                                  ("default", "b", "tests.apps.add", 0)]
    assert box.empty()


def test_an_empty_sync_leaves_nothing_on_the_way(app):
    box = Outbox(app)
    box.put_into(scripts.Batch(app.redis), 0.0)
    assert box.empty()
