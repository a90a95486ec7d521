"""Failure is the main path: real SIGKILLs, SIGSTOPs, restarts. Nothing may be lost."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from taskrunner import JobFailed
from taskrunner.client.aio import AsyncClient
from taskrunner.ops import listing
from taskrunner.ops.dispatcher import Dispatcher
from taskrunner.protocol.connection import server_time
from taskrunner.worker.crew import ended_by
from tests import apps
from tests.conftest import wait_for


def ledger(app, key: str) -> int:
    return int(app.redis.get(f"{app.settings.prefix}:ledger:{key}") or 0)


def started_pid(app, key: str, n: int = 1) -> int:
    """PID of the process running the n-th start of hold(key)."""
    def find():
        entries = [e for e in app.redis.lrange(f"{app.settings.prefix}:started", 0, -1) if e.startswith(key + ":")]
        return entries[n - 1] if len(entries) >= n else None
    return int(wait_for(find, what=f"{key} to start {n} time(s)").rsplit(":", 1)[1])


def release(app, key: str) -> None:
    app.redis.set(f"{app.settings.prefix}:release:{key}", 1)


def run_again_elsewhere(app, stack, key: str, first: str, second: str):
    """hold(key) starts on worker `first`, whose process group is SIGKILLed; it runs again
    on worker `second` and ends. The job."""
    w1 = stack.worker(name=first, concurrency=1)
    job = apps.hold.delay(key)
    started_pid(app, key)
    os.killpg(w1.pid, signal.SIGKILL)
    stack.worker(name=second, concurrency=1)
    started_pid(app, key, 2)
    release(app, key)
    job.wait(30)
    return job


def test_sigkilled_worker_group_job_runs_on_another_worker(app, stack):
    stack.dispatcher()
    w1 = stack.worker(name="w1")
    job = apps.hold.delay("k1")
    started_pid(app, "k1")
    assert job.refresh().data["worker"] == "w1"
    os.killpg(w1.pid, signal.SIGKILL)  # the worker and its children, as a crash would
    stack.worker(name="w2")
    started_pid(app, "k1", 2)
    release(app, "k1")
    assert job.wait(30) == "released"
    d = job.refresh().to_dict()
    assert d["worker"] == "w2" and d["attempts"] == 2 and d["requeues"] == 1 and d["lost"] == 1
    assert "w1 is dead" in d["last_lost_reason"]
    workers = {w["name"]: w["state"] for w in listing.workers(app)}
    assert workers["w1"] == "dead" and workers["w2"] == "alive"


def test_sigkilled_child_job_is_requeued_and_child_replaced(app, stack):
    w = stack.worker(concurrency=1)
    job = apps.hold.delay("k2")
    pid = started_pid(app, "k2")
    assert job.refresh().to_dict()["pid"] == pid  # the holding entry names the child
    entry = json.loads(app.redis.hget(app.keys.q("default") + "running", job.id))
    assert entry["pid"] == pid and entry["worker"] and entry["ip"] and entry["max_duration"] == 60
    os.kill(pid, signal.SIGKILL)
    pid2 = started_pid(app, "k2", 2)
    assert pid2 != pid
    release(app, "k2")
    assert job.wait(30) == "released"
    assert job.refresh().to_dict()["lost"] == 1
    assert w.poll() is None


def test_poison_pill_ends_as_worker_lost(app, stack):
    stack.worker(concurrency=1)
    job = apps.crash.delay("p1")  # max_lost=2
    with pytest.raises(JobFailed) as e:
        job.wait(30)
    assert e.value.error_type == "WorkerLost"
    assert ledger(app, "p1") == 2
    assert apps.add.delay(1, 2).wait(30) == 3  # the worker carries on


def test_a_worker_killed_by_a_poison_pill_fails_it_not_the_jobs_in_its_prefetch(app, stack):
    """A job that takes its whole worker down (SIGKILL of the process group) while quick
    jobs wait behind it in its child, sent ahead: at each death only the job that ran counts
    as lost. The pill ends WorkerLost after its max_lost (3) deaths; the jobs of its prefetch
    (max_lost 1: one death counted against them fails them) go back uncounted and complete."""
    stack.dispatcher()
    w = stack.worker(concurrency=1)
    assert apps.add.delay(1, 1).wait(30) == 2  # its child's runtime known: it is sent many at once
    pill, *innocents = app.enqueue_many([{"task": "tests.apps.crash_worker", "args": ["pill"]}]
                                        + [{"task": "tests.apps.fragile", "args": [f"i{k}"]} for k in range(6)])
    for deaths in range(1, 4):
        wait_for(lambda w=w: w.poll() is not None, what=f"the pill to kill worker {deaths}")
        if deaths == 1:  # they were in its prefetch: sent ahead behind the pill, not begun
            wait_for(lambda: pill.refresh().state == "pending", what="the dispatcher to requeue the pill")
            held = [d for d in (job.refresh().to_dict() for job in innocents) if d.get("attempts")]  # lost with it
            assert held and [(d["state"], d.get("lost", 0)) for d in held] == [("pending", 0)] * len(held), held
        if deaths < 3:
            w = stack.worker(concurrency=1)
    with pytest.raises(JobFailed) as e:
        pill.wait(30)
    assert e.value.error_type == "WorkerLost" and ledger(app, "pill") == 3
    stack.worker(concurrency=1)  # a healthy worker takes over
    assert [job.wait(30) for job in innocents] == [1] * 6
    records = [job.refresh().to_dict() for job in innocents]
    assert [r.get("lost", 0) for r in records] == [0] * 6
    events = [e["event"] for r in records for e in r["timeline"]]
    assert any(re.fullmatch(r"delivery 1 requeued, it had not begun: worker \S+ is dead", ev) for ev in events), events


def test_kill_running_job(app, stack):
    w = stack.worker(concurrency=1)
    job = apps.stubborn.delay("s1")  # ignores SIGTERM: needs the SIGKILL after the grace
    wait_for(lambda: ledger(app, "s1"), what="job start")
    assert job.kill() == "running"
    with pytest.raises(JobFailed) as e:
        job.wait(30)
    assert e.value.state == "killed"
    d = job.refresh().to_dict()
    assert d["attempts"] == 1 and d["killed_by"]
    assert w.poll() is None and apps.add.delay(2, 2).wait(30) == 4  # alive, takes jobs
    assert ledger(app, "s1") == 1  # never retried


def test_a_kill_of_an_ended_job_answers_already_and_its_state(app, stack):
    """Job.kill and AsyncClient.kill of a job that had already ended answer "already <state>"
    and write nothing: for a killed job they answered "killed", as for a job killed by the
    call (found by the newcomer sweep)."""
    async def aio_kill(job_id: str) -> str:
        client = AsyncClient(app)
        try:
            return await client.kill(job_id)
        finally:
            await client.close()

    for state, job in stack.ended_jobs().items():
        before = job.refresh().data
        assert job.kill("tester") == f"already {state}"
        assert asyncio.run(aio_kill(job.id)) == f"already {state}"
        assert job.refresh().data == before


def test_kill_reaches_worker_through_heartbeat_when_message_lost(app, stack):
    stack.worker(concurrency=1)
    job = apps.hold.delay("s2")
    started_pid(app, "s2")
    # As if the control message were lost: only the flag is set.
    app.redis.hset(app.keys.job("default", job.id), "kill_requested", "1")
    with pytest.raises(JobFailed) as e:
        job.wait(30)
    assert e.value.state == "killed"


def test_a_worker_stopping_a_job_requeued_under_it_logs_who_requeued_it(app, stack):
    """An operator's requeue (dashboard, API, `recover`) of a running job: the worker sees
    at its next beat that the delivery is no longer its own and stops it, and its log says
    why, from the record (`end:<attempt>`). It said "requeued while we were unreachable",
    with Redis reachable all along."""
    w = stack.worker(concurrency=1)
    job = apps.hold.delay("rq")
    started_pid(app, "rq")
    assert job.requeue("ops@desk")
    lines: list[str] = []
    wait_for(lambda: lines.append(w.stdout.readline()) or "no longer ours" in lines[-1], what="the worker's stop")
    assert "requeued by ops@desk" in lines[-1] and "unreachable" not in lines[-1], lines[-1]


def test_job_over_max_duration_is_stuck_then_failed(app, stack):
    stack.worker(concurrency=1, env={"TASKRUNNER_KILL_GRACE": "3"})
    job = apps.stubborn.apply_async(["t1"], max_duration=0.5)
    wait_for(lambda: job.refresh().data.get("stuck") == "1", what="stuck flag")
    assert job.state == "running"  # stuck is a flag on a running job
    with pytest.raises(JobFailed) as e:
        job.wait(30)
    assert e.value.error_type == "TimeLimitExceeded"
    d = job.refresh().to_dict()
    assert d["stuck"] and d["stuck_at"]


def test_a_job_stopped_at_its_max_duration_names_the_signal(app, stack):
    """Its child ends with 143 (128 + SIGTERM: its finally blocks ran): the error said
    "stopped by exit code 143"."""
    stack.worker(concurrency=1)
    job = apps.too_slow.delay("limit")
    with pytest.raises(JobFailed) as e:
        job.wait(30)
    assert (e.value.error_type, e.value.message) == ("TimeLimitExceeded",
                                                     "ran past its max duration; stopped by signal SIGTERM")


@pytest.mark.parametrize("code, said", [(-9, "signal SIGKILL"), (143, "signal SIGTERM"), (137, "signal SIGKILL"),
                                        (1, "exit code 1"), (0, "exit code 0"), (128, "exit code 128"),
                                        (255, "exit code 255"), (None, "exit code None")])
def test_what_ended_a_child_names_its_signal(code, said):
    """A child the worker stopped: 128 + N is the signal N. One it did not stop: only a
    negative code is a signal; its own exit status 137 is an exit code, not a SIGKILL (found
    by review: an os._exit(137) in a task read as the OOM killer's)."""
    assert ended_by(code, stopped=True) == said
    assert ended_by(code) == (said if code is None or code <= 128 or code == 255 else f"exit code {code}")


def test_dispatcher_flags_stuck_and_asks_worker_when_worker_hangs_in_a_child(app, stack):
    """policy "flag": the worker only flags; the dispatcher sees it in its due bucket too."""
    stack.worker(concurrency=1)
    stack.dispatcher()
    job = app.enqueue("tests.apps.hold", ["f1", 3], max_duration=0.3, timeout_policy="flag")
    wait_for(lambda: job.refresh().data.get("stuck") == "1", what="stuck flag")
    assert job.wait(30) == "timeout"  # flagged, never stopped


def test_a_job_left_running_past_its_time_is_logged_once(app, stack):
    """policy "flag": the worker flagged the job without a word, and the dispatcher, which
    looks at it again every stuck_recheck, counted each look: its log said "stuck=1" every
    10 s for as long as the job ran (`make demo`'s overdue job: 3 minutes of them), as if
    another job had got stuck each time, and nothing said which job."""
    w = stack.worker(concurrency=1)
    job = app.enqueue("tests.apps.hold", ["f2", 60], max_duration=0.3, timeout_policy="flag")
    d = Dispatcher(app)
    counted, buckets = [], set()

    def looked_again() -> bool:
        counted.append(d.run_once()["stuck"])
        bucket = job.refresh().data.get("bucket")
        if job.data.get("stuck") == "1" and bucket:
            buckets.add(bucket)  # each look moves the job to the bucket of its next
        return len(buckets) >= 4

    wait_for(looked_again, what="the dispatcher to look at the stuck job 3 times")
    assert sum(counted) <= 1, counted  # 1: the dispatcher's pass came before the worker's flag
    release(app, "f2")
    assert job.wait(30) == "released"
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    said = [line for line in w.stdout.read().splitlines() if job.id in line]
    assert len(said) == 1 and " WARNING " in said[0] and "max duration" in said[0], said


def test_dispatcher_killed_and_restarted_mid_run(app, stack):
    d1 = stack.dispatcher()
    stack.worker()
    jobs = [apps.add.apply_async([i, 1], delay=0.3 + (i % 10) * 0.1) for i in range(100)]
    wait_for(lambda: app.redis.zcard(app.keys.q("default") + "completed") > 10, what="some jobs")
    os.killpg(d1.pid, signal.SIGKILL)
    stack.dispatcher()
    assert [j.wait(30) for j in jobs] == [i + 1 for i in range(100)]


def test_two_dispatchers_act_once(app, stack):
    stack.dispatcher()
    stack.dispatcher()
    job = run_again_elsewhere(app, stack, "d1", "w1", "w2")
    d = job.refresh().to_dict()
    assert d["requeues"] == 1 and d["attempts"] == 2 and ledger(app, "d1") == 2


def test_paused_worker_is_fenced_off_and_learns_it(app, stack):
    stack.dispatcher()
    w1 = stack.worker(name="w1", concurrency=1)
    job = apps.hold.delay("z1", 4)
    started_pid(app, "z1")
    os.killpg(w1.pid, signal.SIGSTOP)  # a zombie: silent past dead_after
    try:
        w2 = stack.worker(name="w2", concurrency=1)
        started_pid(app, "z1", 2)
        assert job.refresh().data["worker"] == "w2"
    finally:
        os.killpg(w1.pid, signal.SIGCONT)
    # w1 comes back: its heartbeat check finds the job is not its own any more and stops it,
    # and a late finish from it would be fenced off. w2's run ends the job.
    release(app, "z1")
    assert job.wait(30) == "released"
    d = job.refresh().to_dict()
    assert d["worker"] == "w2" and d["attempts"] == 2
    wait_for(lambda: any(w["name"] == "w1" and w["state"] == "alive"
                         for w in listing.workers(app)), what="w1 back")
    assert w1.poll() is None and w2.poll() is None


def test_sigterm_lets_running_job_finish(app, stack):
    w = stack.worker(concurrency=1)
    job = apps.hold.delay("g1", 30)
    started_pid(app, "g1")
    w.send_signal(signal.SIGTERM)
    release(app, "g1")
    assert w.wait(30) == 0
    assert job.refresh().data["state"] == "completed"
    assert not app.redis.zscore(app.keys.workers, w.args[-1])


def test_sigterm_requeues_what_outlives_the_grace(app, stack):
    """And says so, naming the job: the worker's log said "stopped after 0 jobs" alone."""
    w = stack.worker(concurrency=1, env={"TASKRUNNER_SHUTDOWN_GRACE": "0.5"})
    job = apps.hold.delay("g2", 30)
    started_pid(app, "g2")
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    d = job.refresh().to_dict()
    assert d["state"] == "pending" and d["requeues"] == 1 and d.get("lost", 0) == 0
    said = [line for line in w.stdout.read().splitlines() if job.id in line]
    assert len(said) == 1 and " WARNING " in said[0] and "back in line" in said[0], said
    stack.worker(concurrency=1)
    release(app, "g2")
    assert job.wait(30) == "released"


def test_platform_sigterm_to_every_process_is_graceful(app, stack):
    """Heroku sends SIGTERM to every process of the dyno, children included."""
    w = stack.worker(concurrency=1)
    job = apps.hold.delay("g3", 30)
    child = started_pid(app, "g3")
    os.killpg(w.pid, signal.SIGTERM)
    release(app, "g3")
    assert w.wait(30) == 0
    assert job.refresh().data["state"] == "completed"
    assert job.refresh().to_dict()["pid"] == child


def test_a_repeated_sigterm_keeps_the_grace_and_sigquit_stops_now(app, stack):
    """One stop often arrives as several SIGTERMs (the platform signals every process, and
    honcho, `timeout` or `taskrunner up` pass it on too): the second cut the grace short
    and requeued a job about to finish. Only SIGQUIT (or Ctrl-C twice) means "now"."""
    w = stack.worker(concurrency=1)
    job = apps.hold.delay("g4", 30)
    started_pid(app, "g4")
    w.send_signal(signal.SIGTERM)
    w.send_signal(signal.SIGTERM)
    time.sleep(1.2)  # the scenario: a repeat a little later too (not waiting for anything)
    w.send_signal(signal.SIGTERM)
    release(app, "g4")
    assert w.wait(30) == 0
    d = job.refresh().to_dict()
    assert d["state"] == "completed" and d.get("requeues", 0) == 0, d
    w = stack.worker(concurrency=1)
    job = apps.hold.delay("g5", 60)
    started_pid(app, "g5")
    w.send_signal(signal.SIGTERM)
    w.send_signal(signal.SIGQUIT)
    assert w.wait(30) == 0
    d = job.refresh().to_dict()
    assert d["state"] == "pending" and d["requeues"] == 1, d


def test_dispatcher_on_same_host_sees_dead_pid_before_heartbeat_expires(app, stack):
    """dead_after is an hour here: only the PID check can find the worker dead."""
    slow = {"TASKRUNNER_DEAD_AFTER": "3600"}
    stack.dispatcher(env=slow)
    w1 = stack.worker(name="p1", concurrency=1, env=slow)
    job = apps.hold.delay("pid1")
    started_pid(app, "pid1")
    os.killpg(w1.pid, signal.SIGKILL)
    stack.worker(name="p2", concurrency=1, env=slow)
    started_pid(app, "pid1", 2)
    release(app, "pid1")
    assert job.wait(30) == "released" and "p1 is dead" in job.refresh().data["last_lost_reason"]


def test_timeline_tells_the_story(app, stack):
    stack.dispatcher()
    job = run_again_elsewhere(app, stack, "tl", "tl1", "tl2")
    events = [e["event"] for e in job.refresh().to_dict()["timeline"]]
    assert events == ["enqueued", "delivery 1 started", "delivery 1 requeued: worker tl1 is dead",
                      "delivery 2 started", "delivery 2 completed"]
    run2 = job.timeline()[3]
    assert run2["worker"] == "tl2" and run2["pid"] and run2["host"]


def test_worker_restarted_under_its_name_releases_what_its_previous_life_held(app, stack):
    """No dispatcher runs: only the restarted worker can give the job back."""
    w1 = stack.worker(name="again", concurrency=1)
    job = apps.hold.delay("o1")
    started_pid(app, "o1")
    twin = stack.cli("worker", "-A", "tests.apps", "-n", "again", "-c", "1")
    assert twin.returncode == 2 and twin.stderr.startswith("Error: worker name 'again' is in use by a live worker")
    assert twin.stderr.count("\n") == 1 and "Traceback" not in twin.stderr, twin.stderr
    os.killpg(w1.pid, signal.SIGKILL)
    beat = app.redis.zscore(app.keys.workers, "again")
    # the name is free again once its heartbeat is older than dead_after
    wait_for(lambda: server_time(app.redis) - beat > app.settings.dead_after, what="the old heartbeat to age")
    stack.worker(name="again", concurrency=1)
    started_pid(app, "o1", 2)
    release(app, "o1")
    assert job.wait(30) == "released"
    d = job.refresh().to_dict()
    assert d["attempts"] == 2 and d["lost"] == 1 and "again no longer ran it" in d["last_lost_reason"]
