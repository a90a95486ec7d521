"""A worker sends short jobs ahead to its children (prefetch): jobs held behind a long one
go back to the queue, a prefetched job can be killed before it begins, and a child that
dies hands back what it had not begun. Real workers, real SIGKILL."""

from __future__ import annotations

import os
import signal

from taskrunner import Job
from tests import apps
from tests.conftest import wait_for


def ledger(app, key: str) -> int:
    return int(app.redis.get(f"{app.settings.prefix}:ledger:{key}") or 0)


def warm(app, stack, **kw):
    """A worker -c 1 that has seen short jobs, so that it prefetches."""
    worker = stack.worker(concurrency=1, **kw)
    jobs = [apps.add.delay(i, i) for i in range(30)]
    for j in jobs:
        assert j.wait(timeout=30) == 2 * int(j.refresh().to_dict()["args"][0])
    return worker


def events(job: Job) -> list[str]:
    return [e["event"] for e in job.refresh().to_dict()["timeline"]]


def test_jobs_prefetched_behind_a_long_one_go_back_to_the_queue(app, stack):
    warm(app, stack, name="first")
    jobs = app.enqueue_many([{"task": "tests.apps.hold", "args": ["long", 50]}]
                            + [{"task": "tests.apps.record", "args": [f"r{i}"]} for i in range(10)])
    long, short = jobs[0], jobs[1:]
    wait_for(lambda: ledger(app, "long") == 1, what="the long job to begin")
    ahead = [j for j in short if j.state == "running"]
    assert ahead, "the worker prefetched nothing behind the long job"
    stack.worker(concurrency=1, name="second")
    for j in short:
        assert j.wait(timeout=30) == 1
    assert long.state == "running"  # they did not wait for it
    assert all(ledger(app, f"r{i}") == 1 for i in range(10))
    returned = [j for j in short if any("returned before it began" in e for e in events(j))]
    assert returned and {j.refresh().data["worker"] for j in returned} == {"second"}
    assert all(f"job {long.id} ahead of it ran long" in " ".join(events(j)) for j in returned)
    app.redis.set(f"{app.settings.prefix}:release:long", 1)
    assert long.wait(timeout=30) == "released"


def test_a_prefetched_job_killed_before_it_began_never_runs(app, stack):
    warm(app, stack)
    long, victim = app.enqueue_many([{"task": "tests.apps.hold", "args": ["long", 50]},
                                     {"task": "tests.apps.record", "args": ["victim"]}])
    wait_for(lambda: ledger(app, "long") == 1, what="the long job to begin")
    # prefetched (the worker is told), or already handed back (pending: killed at once)
    assert victim.kill("test") in ("running", "killed")
    wait_for(lambda: victim.state == "killed", what="the prefetched job to end killed")
    app.redis.set(f"{app.settings.prefix}:release:long", 1)
    assert long.wait(timeout=30) == "released"
    assert ledger(app, "victim") == 0


def test_a_child_killed_with_prefetched_jobs_hands_them_back(app, stack):
    """The long job holds until released, not for a second: a test process descheduled for
    that second (CI, 4 test processes on 2 cores) SIGKILLed the child after the job had
    ended, or a child running a short job, and the long job never ran again."""
    warm(app, stack)
    jobs = app.enqueue_many([{"task": "tests.apps.hold", "args": ["long", 50]}]
                            + [{"task": "tests.apps.record", "args": [f"r{i}"]} for i in range(5)])
    long, short = jobs[0], jobs[1:]
    wait_for(lambda: ledger(app, "long") == 1, what="the long job to begin")
    queued = [j for j in short if j.state == "running"]
    os.kill(int(long.refresh().data["pid"]), signal.SIGKILL)
    wait_for(lambda: ledger(app, "long") == 2, what="the long job requeued first in line and run again")
    app.redis.set(f"{app.settings.prefix}:release:long", 1)
    assert long.wait(timeout=30) == "released"
    for j in short:
        assert j.wait(timeout=30) == 1
    assert all(ledger(app, f"r{i}") == 1 for i in range(5))
    for j in queued:  # those that were queued in the dead child came back without a run
        assert any("returned before it began: its process died" in e for e in events(j)) or \
            any("ahead of it ran long" in e for e in events(j))
    assert "lost" in long.refresh().data and "lost" not in short[0].refresh().data


def test_big_jobs_sent_ahead_do_not_stall_the_worker(app, stack):
    """Jobs with big arguments sent ahead of a long job fill the pipe to a child that reads
    nothing until that job ends: the worker must go on (hand them back, heartbeat)."""
    warm(app, stack, name="first")
    big = "x" * 200_000
    jobs = app.enqueue_many([{"task": "tests.apps.hold", "args": ["long", 50]}]
                            + [{"task": "tests.apps.add", "args": [big, str(i)]} for i in range(20)])
    long, short = jobs[0], jobs[1:]
    wait_for(lambda: ledger(app, "long") == 1, what="the long job to begin")
    stack.worker(concurrency=1, name="second")
    for i, j in enumerate(short):
        assert j.wait(timeout=30) == big + str(i)
    assert long.state == "running"  # the first worker handed them back while it ran
    app.redis.set(f"{app.settings.prefix}:release:long", 1)
    assert long.wait(timeout=30) == "released"


def test_answers_of_short_jobs_are_read_while_a_long_one_runs(app, stack):
    """With short jobs queued in a child, the worker reads its answers on a timer (GLANCE)
    instead of waking for each one. Those of the jobs that ran before a long one reach Redis
    while it runs, before its followers are handed back (HOLD), not once that lets up."""
    warm(app, stack)
    jobs = app.enqueue_many([{"task": "tests.apps.record", "args": [f"a{i}"]} for i in range(3)]
                            + [{"task": "tests.apps.hold", "args": ["long", 50]}]
                            + [{"task": "tests.apps.record", "args": [f"b{i}"]} for i in range(28)])
    before, long, after = jobs[:3], jobs[3], jobs[4:]
    wait_for(lambda: ledger(app, "long") == 1, what="the long job to begin")
    # The child holds between half its depth and its depth (a claim tops it up once it is down
    # to half: policy.claim_slots), fewer as load makes the short jobs slower: at least two.
    assert sum(j.state == "running" for j in after) >= 2, "the child should hold jobs behind the long one"

    def handed_back() -> list[float]:
        return [e["at"] for j in after for e in j.refresh().to_dict()["timeline"]
                if "returned before it began" in e["event"]]

    back = wait_for(handed_back, what="the jobs behind the long one to be handed back")
    assert all(j.state == "completed" for j in before)
    assert max(float(j.refresh().data["finished_at"]) for j in before) < min(back)
    app.redis.set(f"{app.settings.prefix}:release:long", 1)
    assert long.wait(timeout=30) == "released" and all(j.wait(timeout=30) == 1 for j in after)
