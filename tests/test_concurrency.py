"""Children that run several jobs at once (loop_child.py): async def tasks as coroutines
(`--async-slots`), plain tasks in threads (`--threads`). Real workers, real Redis; the
tasks are in tests/async_apps.py. Every job keeps its own holding entry, fencing, kill
and max duration; a stopped child loses none of its jobs."""

from __future__ import annotations

import os
import signal
import socket
import time

from taskrunner.protocol import codec
from taskrunner.protocol.claims import Delivery
from taskrunner.worker.children import wait_ready
from taskrunner.worker.crew import Crew
from taskrunner.worker.main import Worker
from taskrunner.worker.outbox import Outbox
from tests import apps
from tests.conftest import until_logged, wait_for
from tests.test_prefetch import events

A = "tests.async_apps"


def overlap(spans: list[list[float]]) -> int:
    """The most spans running at one instant."""
    events = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def ledger(app, key: str) -> int:
    return int(app.redis.get(f"{app.settings.prefix}:ledger:{key}") or 0)


def release(app, key: str) -> None:
    app.redis.set(f"{app.settings.prefix}:release:{key}", 1)


def running(app, jobs) -> bool:
    return all(j.state == "running" for j in jobs)


def test_200_async_jobs_run_at_once_in_one_child(app, stack):
    jobs = app.enqueue_many([{"task": f"{A}.async_span", "args": [1.0]} for _ in range(200)])
    stack.worker("--async-slots", "200", app=A, concurrency=1)
    spans = [j.wait(120) for j in jobs]
    assert overlap(spans) >= 100, overlap(spans)  # not one after another
    holders = {j.refresh().data["pid"] for j in jobs}
    assert len(holders) == 1  # one child ran them all, each with its own holding entry


def test_plain_tasks_run_in_threads_up_to_the_limit(app, stack):
    jobs = app.enqueue_many([{"task": f"{A}.thread_span", "args": [0.5]} for _ in range(16)])
    stack.worker("--threads", "8", app=A, concurrency=1)
    spans = [j.wait(120) for j in jobs]
    assert 2 <= overlap(spans) <= 8, overlap(spans)


def test_killing_one_async_job_leaves_its_siblings_running(app, stack):
    jobs = [app.enqueue(f"{A}.async_nap", [f"k{i}", 60]) for i in range(3)]
    stack.worker(app=A, concurrency=1)
    wait_for(lambda: running(app, jobs) and all(ledger(app, f"k{i}") for i in range(3)), what="3 async jobs running")
    pid = jobs[0].refresh().data["pid"]
    jobs[0].kill()
    wait_for(lambda: jobs[0].state == "killed", what="the killed job to end")
    assert running(app, jobs[1:]) and {j.refresh().data["pid"] for j in jobs[1:]} == {pid}
    release(app, "k1")
    release(app, "k2")
    assert [j.wait(30) for j in jobs[1:]] == ["released", "released"]
    assert ledger(app, "k1") == ledger(app, "k2") == 1  # never rerun


def test_an_async_job_past_its_max_duration_is_cancelled_alone(app, stack):
    slow = app.enqueue(f"{A}.async_too_slow", ["slow"], max_duration=0.5)  # as its declaration says
    other = app.enqueue(f"{A}.async_nap", ["other", 60])
    stack.worker(app=A, concurrency=1)
    wait_for(lambda: slow.state in ("failed", "completed", "killed") and slow, what="the slow job to end")
    d = slow.refresh().data
    assert d["state"] == "failed" and d["error_type"] == "TimeLimitExceeded" and d["stuck"] == "1"
    assert other.state == "running"
    release(app, "other")
    assert other.wait(30) == "released" and ledger(app, "other") == 1


def test_a_coroutine_that_ignores_cancellation_gets_its_child_stopped_and_siblings_handed_back(app, stack):
    deaf = app.enqueue(f"{A}.async_deaf", ["deaf"])
    other = app.enqueue(f"{A}.async_nap", ["sib", 60])
    w = stack.worker(app=A, concurrency=1)
    # both begun in the child (a job still in the worker's prefetch is killed there, uncancelled)
    wait_for(lambda: running(app, [deaf, other]) and ledger(app, "deaf") and ledger(app, "sib"), what="both running")
    child = stack.children_of(w)
    deaf.kill()
    wait_for(lambda: deaf.state == "killed", what="the deaf job to end killed")
    assert ledger(app, "deaf:cancelled") >= 1  # it was cancelled first, and ignored it
    wait_for(lambda: stack.children_of(w) and stack.children_of(w) != child, what="a new child")
    release(app, "sib")
    assert other.wait(30) == "released"
    d = other.refresh().data
    assert d.get("failures", "0") == "0" and int(d["requeues"]) == 1  # handed back, not failed


def test_a_sigkilled_child_with_50_async_jobs_loses_none(app, stack):
    jobs = app.enqueue_many([{"task": f"{A}.async_nap", "args": [f"m{i}", 60]} for i in range(50)])
    w = stack.worker(app=A, concurrency=1)
    wait_for(lambda: all(ledger(app, f"m{i}") for i in range(50)), what="50 async jobs running")
    (child,) = stack.children_of(w)
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: all(ledger(app, f"m{i}") == 2 for i in range(50)), what="each to run again")
    for i in range(50):
        release(app, f"m{i}")
    assert [j.wait(60) for j in jobs] == ["released"] * 50
    assert all(j.refresh().data["lost"] == "1" for j in jobs)


def test_killing_a_thread_job_stops_its_child_and_requeues_its_siblings(app, stack):
    """Both jobs begun in the child's threads (each marks it: a job's state is running from
    its claim, and on a loaded machine (CI) one still waiting in the worker's prefetch was
    killed there, its child untouched, its sibling never run again), the kill stops the
    child and its sibling runs again."""
    a = app.enqueue(f"{A}.thread_nap", ["a", 30])
    b = app.enqueue(f"{A}.thread_nap", ["b", 15])  # still running when the kill lands, however loaded the machine
    stack.worker("--threads", "2", app=A, concurrency=1)
    wait_for(lambda: ledger(app, "a") == 1 and ledger(app, "b") == 1, what="both jobs begun in the child's threads")
    a.kill()
    wait_for(lambda: a.state == "killed", what="the thread job to end killed")
    assert b.wait(60) == "b"
    d = b.refresh().data
    assert d.get("failures", "0") == "0" and int(d["attempts"]) == 2  # stopped with its child, run again
    assert ledger(app, "b") == 2


def test_requeueing_a_thread_job_leaves_its_child_and_siblings_running(app, stack):
    """An operator's requeue of a job that runs in a thread (dashboard, API, `recover`): at
    its next beat the worker finds the delivery no longer its own. A thread cannot be
    stopped; its job runs on, its result not reported, and its slot comes back when it
    ends; the child and the sibling beside it go on. The worker used to stop the whole
    child for it, and the sibling ran again."""
    a = apps.hold.delay("rqa", 60)
    b = apps.hold.delay("rqb", 60)
    w = stack.worker("--threads", "2", concurrency=1)
    wait_for(lambda: ledger(app, "rqa") == 1 and ledger(app, "rqb") == 1, what="both jobs begun in the child's threads")
    child = stack.children_of(w)
    assert a.requeue("ops@desk")
    lines: list[str] = []
    wait_for(lambda: lines.append(w.stdout.readline()) or "no longer ours" in lines[-1], what="the worker to find out")
    release(app, "rqb")
    assert b.wait(30) == "released"
    assert b.refresh().data["attempts"] == "1" and ledger(app, "rqb") == 1  # never stopped, never run again
    release(app, "rqa")  # the requeued job ran again in the slot its sibling freed
    assert a.wait(30) == "released" and a.refresh().data["attempts"] == "2" and ledger(app, "rqa") == 2
    assert stack.children_of(w) == child


def test_a_requeued_thread_job_run_again_beside_its_old_thread_keeps_its_own_result(app, stack):
    """The requeued job is claimed again for the same child while its first delivery still
    runs there, in another thread: each answer goes to its own delivery (the child's answers
    name the attempt). Matched by job id alone, the new delivery's answer went to the old
    one (not reported), and the old one's result, when it came, was reported as the new
    one's."""
    a = apps.hold_first.delay("rf")
    w = stack.worker("--threads", "2", concurrency=1, name="rf")
    wait_for(lambda: ledger(app, "rf") == 1, what="the job to begin in a thread")
    child = stack.children_of(w)
    assert a.requeue("ops@desk")
    assert a.wait(30) == 2  # run again beside its first delivery, which still runs
    assert ledger(app, "rf") == 2 and stack.children_of(w) == child
    until_logged(w, "no longer ours")  # the first delivery runs on, not held: not among the worker's jobs
    wait_for(lambda: codec.loads(app.redis.get(app.keys.worker("rf")))["running"] == [], what="a beat since")
    release(app, "rf")
    until_logged(w, "not reported")  # the first delivery's end
    assert a.wait(1) == 2 and a.refresh().data["attempts"] == "2"
    assert stack.children_of(w) == child


def test_a_requeued_thread_job_that_runs_past_its_max_duration_gets_its_child_stopped(app, stack):
    """A job requeued while it runs in a thread runs on (above), but not for ever: at its max
    duration its child is stopped, as for any thread's job, and the sibling beside it goes
    back to the queue, next in line (requeued, not failed). Nothing is reported for the
    delivery no longer the worker's: its job ran again on another worker meanwhile."""
    a = apps.hold_first.apply_async(["ra"], max_duration=4)
    b = apps.hold.delay("rb", 60)
    w = stack.worker("--threads", "2", concurrency=1)
    wait_for(lambda: ledger(app, "ra") == 1 and ledger(app, "rb") == 1, what="both jobs begun in the child's threads")
    child = stack.children_of(w)
    stack.worker(concurrency=1, name="other")
    assert a.requeue("ops@desk")
    assert a.wait(30) == 2 and a.refresh().data["worker"] == "other"
    wait_for(lambda: ledger(app, "rb") == 2, what="the sibling run again, its child stopped")
    assert stack.children_of(w) != child
    release(app, "rb")
    assert b.wait(30) == "released"
    d = b.refresh().data
    assert d.get("failures", "0") == "0" and int(d["requeues"]) == 1
    stack.stop()
    log = w.stdout.read()
    assert f"job {a.id} passed its max duration; stopping it" in log, log  # not at the requeue
    assert "discarded" not in log, log  # its end, TimeLimitExceeded, was not reported (and refused)


def test_a_job_enqueued_while_a_loop_child_runs_one_begins_at_once(app, stack):
    """An idle worker listens on the queues' wake lists while a child has room: for a loop
    child that is while it has a free slot, not only while it has nothing to do. It used
    to listen only with a child without jobs, so a job enqueued while one async job ran
    waited for that one to end (found by trying it: 7 s late behind an 8 s job)."""
    stack.worker("--async-slots", "10", app=A, concurrency=1)
    first = app.enqueue(f"{A}.async_nap", ["first", 120])
    wait_for(lambda: ledger(app, "first") == 1, what="the first job to begin")
    second = app.enqueue(f"{A}.async_nap", ["second", 120])
    wait_for(lambda: ledger(app, "second") == 1, timeout=30, what="the second job to begin beside the first")
    assert first.state == "running"
    release(app, "first")
    release(app, "second")
    assert (first.wait(30), second.wait(30)) == ("released", "released")


def test_spare_jobs_behind_long_ones_go_back_and_one_killed_while_it_waited_ends_killed(app):
    """A loop child is sent spare jobs beyond its slots (policy.spare); when long jobs hold
    every slot for HOLD they go back to the queue, except one it was asked to stop while
    it waited: that one ends killed, never run. It used to go back to the queue as any
    other, its kill forgotten. The worker runs in this process, driven step by step (as
    in tests/test_flights.py); its child and Redis are real."""
    w = Worker(app, ["default"], concurrency=1, threads=2, name="spare")
    w._wakeup, w._wakeup_w = socket.socketpair()  # what run() sets up for signals
    w.crew.start()
    try:
        w._sync()  # the first sync reconciles
        w._arm()
        (c,) = w.crew.children
        long = app.enqueue_many([{"task": "tests.apps.hold", "args": [f"long{i}", 60]} for i in range(2)])
        spare = app.enqueue_many([{"task": "tests.apps.record", "args": [f"s{i}"]} for i in range(3)])
        w.crew.runtime, c.last_began = 0.001, time.monotonic()  # as after short jobs: it takes spare ones
        w.may_claim, w.probing = True, False  # jobs found waiting: a full claim, not one job per child
        w._sync(wait=True)
        assert len(c.jobs) == 5
        wait_for(lambda: w._step() or all(ledger(app, f"long{i}") for i in range(2)), what="both threads busy")
        spare[1].kill()
        wait_for(lambda: w._step() or any(d.stop_reason for d in c.jobs), what="the worker to ask the child")
        wait_for(lambda: w._step() or spare[1].state != "running", what="the spare jobs to go back")
        assert spare[1].state == "killed" and [spare[0].state, spare[2].state] == ["pending", "pending"]
        assert f"the jobs ahead of it in child {c.pid} ran long" in " ".join(events(spare[0]))
        for i in range(2):
            release(app, f"long{i}")
        rest = [*long, spare[0], spare[2]]
        wait_for(lambda: w._step() or all(j.state == "completed" for j in rest), what="the other jobs to run")
        assert [ledger(app, f"s{i}") for i in range(3)] == [1, 0, 1]
    finally:
        w._shutdown()
        w._wakeup.close()
        w._wakeup_w.close()


def thread_crew(app) -> Crew:
    """A crew of one child with 2 threads, driven here step by step (read, enforce) as a
    worker drives it: the races below are set up, not waited for. Its child is real."""
    crew = Crew(app, Outbox(app), "crew", "h", concurrency=1, threads=2)
    crew.kill_grace = 0.5
    crew.start()
    return crew


def naps(crew: Crew, *seconds: float) -> list[Delivery]:
    """Thread jobs (tests.apps.nap) sent to the crew's child; each begins at once."""
    (c,) = crew.children
    sent = [Delivery("default", f"nap{i}", "1", "tests.apps.nap", f"[{s}]", "{}", 60.0) for i, s in enumerate(seconds)]
    crew.deliver([(c, 0.0)] * len(sent), sent)
    return sent


def drive(crew: Crew, until) -> None:
    """Read the child's answers and enforce what is due, as the worker does, until `until()`."""
    (c,) = crew.children

    def step() -> bool:
        for _ in wait_ready([c.conn], 0.05):
            crew.read(c)
        crew.enforce(time.monotonic(), False, float("inf"))
        return until()

    wait_for(step, what="the crew to get there")


def test_a_thread_job_found_requeued_before_its_begin_was_read_runs_on_beside_its_sibling(app):
    """The heartbeat finds a delivery no longer ours just as the child begins it in a thread,
    its {"began"} not read yet: stop() sends a cancel (as for a job not begun), which a
    thread does not heed. The job runs on, as one found requeued after its begin does; the
    cancel's grace (kill_grace) used to stop the whole child, the sibling with it."""
    crew = thread_crew(app)
    try:
        (c,) = crew.children
        sib, lost = naps(crew, 3, 3)
        wait_for(lambda: c.state[0] >= lost.seq, what="the child to begin both")  # its word unread
        assert lost.began is None and crew.stop(c, lost, "lost") is True  # a cancel
        due = lost.stop_at
        assert due is not None
        drive(crew, lambda: time.monotonic() > due + 0.5 and lost.began is not None)
        assert c.kill_reason is None and c.proc.is_alive(), "the child (and its sibling) was stopped"
        drive(crew, lambda: not c.jobs)
        assert [e.id for e in crew.outbox.load.ended["default"]] == [sib.id]  # the lost one: nothing
        assert crew.processed == 1 and c.done == 2  # counted where it ran again; its child ran it
    finally:
        crew.close()


def test_a_kill_naming_a_thread_job_already_found_requeued_leaves_its_child_running(app):
    """A kill request for a delivery the heartbeat has found no longer ours (the control
    message named the old attempt, read after the beat): nothing to stop. It stopped the
    whole child, its sibling with it."""
    crew = thread_crew(app)
    try:
        (c,) = crew.children
        sib, lost = naps(crew, 3, 3)
        drive(crew, lambda: lost.began is not None and sib.began is not None)
        assert crew.stop(c, lost, "lost") is False  # a begun thread's job: runs on
        assert crew.kill_request(lost.id, lost.attempt, "killed") is True  # handled: nothing to do
        assert c.kill_reason is None and c.proc.is_alive() and lost.stop_at is None
        drive(crew, lambda: not c.jobs)
        assert [e.id for e in crew.outbox.load.ended["default"]] == [sib.id]
    finally:
        crew.close()


def test_a_requeued_thread_job_past_its_max_duration_with_policy_flag_is_not_marked_stuck(app, caplog):
    """A thread's job no longer ours, timeout_policy flag: at its max duration it is not
    marked stuck (stuck.lua is fenced: the record is its new run's) and runs on, its child
    untouched; at the shutdown grace's end the log says it goes nowhere (not "back in
    line": it went back when it was requeued)."""
    crew = thread_crew(app)
    try:
        (c,) = crew.children
        (lost,) = naps(crew, 30)
        lost.max_duration, lost.timeout_policy = 2.0, "flag"
        drive(crew, lambda: lost.began is not None)
        assert crew.stop(c, lost, "lost") is False
        drive(crew, lambda: lost.stuck)
        assert crew.outbox.load.marks == [] and c.kill_reason is None and c.proc.is_alive()
        with caplog.at_level("WARNING", logger="taskrunner.worker"):
            crew.enforce(time.monotonic(), True, 0.0)  # the shutdown grace ended
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "no longer ours" in said and "nothing is reported" in said and "goes back in line" not in said, said
        assert c.kill_reason == "shutdown"
    finally:
        crew.close()
