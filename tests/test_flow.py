"""Flow control (issue 17): paused queues, unique jobs, priorities — in the scripts and with
real workers and dispatchers."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from taskrunner.client.flow import unique_key_of
from taskrunner.ops import listing, queue
from taskrunner.protocol import scripts
from tests import apps
from tests.conftest import wait_for
from tests.test_scripts import claim, finish


def started(app) -> list[str]:
    """Keys of the `hold` jobs in the order they started."""
    return [s.rsplit(":", 1)[0] for s in app.redis.lrange(f"{app.settings.prefix}:started", 0, -1)]


def lock(app, key: str, q: str = "default") -> str | None:
    return app.redis.get(app.keys.q(q) + "unique:" + key)


# -- pause / resume -----------------------------------------------------------------------


def test_paused_queue_keeps_its_jobs_pending_while_its_worker_sleeps_then_runs_them(app, stack):
    stack.cli("queue", "create", "pz", check=True)
    assert json.loads(stack.cli("queue", "pause", "pz", "--json", check=True).stdout)["paused"] is True
    jobs = [apps.add.apply_async([i, i], queue="pz") for i in range(5)]  # a paused queue takes jobs
    w = stack.worker("-Q", "pz,other", concurrency=2)
    assert apps.add.apply_async([1, 1], queue="other").wait(30) == 2  # its other queue goes on
    proc = psutil.Process(w.pid)
    before = proc.cpu_times()
    t0 = time.monotonic()
    for i in range(100):  # each enqueue into the paused queue must not wake the worker to claim
        apps.add.apply_async([i, 0], queue="pz")
    time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)))  # the window its CPU time is measured over
    after = proc.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    assert used < 0.25, f"the worker used {used:.2f}s of CPU in 2s on a paused queue: it polls"
    assert {j.refresh().state for j in jobs} == {"pending"}
    [row] = [q for q in json.loads(stack.cli("queues", "--json", check=True).stdout) if q["name"] == "pz"]
    assert row["paused"] is True and row["pending"] == 105
    assert "paused" in stack.cli("queues", check=True).stdout
    assert json.loads(stack.cli("queue", "resume", "pz", "--json", check=True).stdout)["paused"] is False
    assert [j.wait(30) for j in jobs] == [0, 2, 4, 6, 8]
    wait_for(lambda: queue.backlog(app, "pz") == 0, what="the paused jobs to run after resume")


def test_pause_and_resume_refuse_a_queue_that_does_not_exist_in_one_line(app, stack):
    for how in ("pause", "resume"):
        r = stack.cli("queue", how, "nope")
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no queue 'nope'" in r.stderr
        r = stack.cli("queue", how, "bad name")
        assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_claim_takes_nothing_from_a_paused_queue_and_goes_on_with_the_next(app):
    a = apps.add.apply_async([1, 1], queue="pa")
    b = apps.add.apply_async([2, 2], queue="pb")
    queue.pause(app, "pa")
    assert [row[1] for row in claim(app, queues=("pa", "pb"), pids=(1, 2))] == [b.id]
    app.redis.delete(app.keys.q("pa") + "wake")  # its first job's token, taken by an idle worker
    apps.add.apply_async([3, 3], queue="pa")
    assert app.redis.llen(app.keys.q("pa") + "wake") == 0  # no wake token: its workers sleep on
    queue.resume(app, "pa")
    assert app.redis.llen(app.keys.q("pa") + "wake") == 1
    assert claim(app, queues=("pa", "pb"))[0][1] == a.id


# -- unique jobs --------------------------------------------------------------------------


def test_duplicates_return_the_first_job_and_are_counted_until_it_ends(app, stack):
    first = apps.record.apply_async(("u1",), unique_for=600)
    again = apps.record.apply_async(("u1",), unique_for=600)
    assert again.id == first.id and first.created and not again.created
    other = apps.record.apply_async(("u2",), unique_for=600)
    assert other.id != first.id
    assert apps.record.apply_async(kwargs={"key": "u2"}, unique_for=600).id != other.id  # kwargs, not args
    key = unique_key_of("tests.apps.record", ["u1"], {})
    assert lock(app, key) == first.id and 0 < app.redis.ttl(app.keys.q("default") + "unique:" + key) <= 600
    assert queue.info(app, "default")["duplicates"] == {"tests.apps.record": 1}
    stack.worker()
    assert first.wait(30) == 1
    assert lock(app, key) is None
    fresh = apps.record.apply_async(("u1",), unique_for=600)
    assert fresh.id != first.id and fresh.wait(30) == 2


def test_a_retry_keeps_the_lock_and_the_end_releases_it(app, stack):
    job = apps.flaky.apply_async(("fl", 2), unique_key="flaky:1")  # fails once, retried, completes
    stack.worker()  # no dispatcher yet: only it promotes the retry, so "delayed" holds while we look
    wait_for(lambda: job.refresh().state == "delayed", what="the first failure")
    assert apps.flaky.apply_async(("fl", 2), unique_key="flaky:1").id == job.id  # still the one job
    stack.dispatcher()
    assert job.wait(30)
    assert lock(app, "flaky:1") is None


def test_unique_until_start_releases_the_lock_when_claimed(app):
    job = apps.add.apply_async([1, 1], unique_key="report:7", unique_until="start")
    assert apps.add.apply_async([1, 1], unique_key="report:7", unique_until="start").id == job.id
    [row] = claim(app)
    assert row[1] == job.id and lock(app, "report:7") is None
    second = apps.add.apply_async([1, 1], unique_key="report:7", unique_until="start")
    assert second.id != job.id and lock(app, "report:7") == second.id
    assert finish(app, job.id, "1", "completed", "2") == 1
    assert lock(app, "report:7") == second.id  # the first's end leaves the second's lock alone


def test_kill_delete_and_purge_release_the_lock(app):
    killed = apps.add.apply_async([1, 1], unique_key="k")
    assert killed.kill() == "killed" and lock(app, "k") is None
    deleted = apps.add.apply_async([1, 1], unique_key="d", delay=60)
    assert deleted.delete() and lock(app, "d") is None
    apps.add.apply_async([1, 1], unique_key="p", queue="pu")
    assert app.purge("pu") == 1 and lock(app, "p", "pu") is None
    running = apps.add.apply_async([1, 1], unique_key="r")
    [row] = claim(app)
    assert running.kill() == "running" and lock(app, "r") == running.id  # until its worker stops it
    assert finish(app, running.id, str(row[2]), "killed", "", "killed on request") == 1
    assert lock(app, "r") is None
    assert running.retry() and lock(app, "r") == running.id  # an operator's retry takes it again


def test_a_stale_lock_naming_an_ended_job_is_taken_over(app):
    app.redis.set(app.keys.q("default") + "unique:s", "no-such-job")
    job = apps.add.apply_async([1, 1], unique_key="s")
    assert job.created and lock(app, "s") == job.id


def test_a_sigkilled_workers_job_keeps_its_lock_until_it_really_ends(app, stack):
    """The job holds until released, not for 1.5 s: a test process descheduled that long
    (CI, 4 test processes on 2 cores) SIGKILLed the worker after the job had completed, and
    no requeue ever came."""
    job = apps.hold.apply_async(("sk", 60), unique_key="sk")
    w = stack.worker(concurrency=1)
    wait_for(lambda: "sk" in started(app), what="the job to start")
    os.killpg(w.pid, signal.SIGKILL)
    w.wait()
    stack.dispatcher()
    wait_for(lambda: job.refresh().state == "pending", what="the dispatcher to requeue the job")
    assert lock(app, "sk") == job.id
    assert apps.hold.apply_async(("sk", 60), unique_key="sk").id == job.id
    app.redis.set(f"{app.settings.prefix}:release:sk", 1)  # its first run is gone with its worker
    stack.worker(concurrency=1)
    assert job.wait(30) == "released"
    assert lock(app, "sk") is None and job.refresh().to_dict()["requeues"] == 1


def test_the_cli_enqueues_with_a_priority_and_a_unique_key(app, stack):
    args = ("enqueue", "tests.apps.add", "--args", "[1, 2]", "--unique-key", "cli:1", "--priority", "5")
    first = stack.cli(*args, check=True).stdout.strip()
    again = stack.cli(*args, check=True)
    assert again.stdout.strip() == first and "not enqueued again" in again.stderr
    assert app.redis.hmget(app.keys.job("default", first), "priority", "unique_key") == ["5", "cli:1"]
    r = stack.cli("enqueue", "tests.apps.add", "--priority", "10")
    assert r.returncode == 2 and "10 is not in the range 0<=x<=9" in r.stderr


def test_unique_arguments_are_checked_by_python_and_by_the_script(app):
    with pytest.raises(ValueError, match="unique_until must be 'start' or 'finish'"):
        apps.add.apply_async([1, 1], unique_key="x", unique_until="later")
    with pytest.raises(ValueError, match="unique_until needs"):
        apps.add.apply_async([1, 1], unique_until="start")
    with pytest.raises(ValueError, match="unique_key must be"):
        apps.add.apply_async([1, 1], unique_key="a b")
    with pytest.raises(ValueError, match="workflow"):
        apps.add.apply_async([1, 1], unique_key="x", on_success=apps.add.s(1))
    p = app.keys.q("default")
    scripts.load(app.redis)  # called raw below
    for fields, why in ((["unique_key", "x", "unique_until", "later"], 'BadValue: .*unique_until must be "start"'),
                        (["unique_until", "start"], "BadCall: .*need unique_key"),
                        (["unique_key", "x", "unique_for", "0"], "BadValue: .*unique_for must be"),
                        (["priority", "10"], "BadValue: .*priority must be a whole number from 0 to 9")):
        with pytest.raises(Exception, match=why):
            app.redis.fcall(scripts.ENQUEUE.function, 1, p, 1, "j1", 0, 1 + len(fields) // 2, "task", "t", *fields)
    assert not app.redis.exists(p + "job:j1")


# -- priorities ---------------------------------------------------------------------------


def test_priorities_are_strict_and_fifo_within_one(app):
    low = [apps.add.apply_async([i, 0]) for i in range(3)]
    mid = [apps.add.apply_async([i, 5], priority=5) for i in range(2)]
    high = apps.add.apply_async([0, 9], priority=9)
    zero = apps.add.apply_async([9, 9], priority=0)  # the same as none
    assert queue.info(app, "default")["priorities"] == [9, 5]
    order = [high.id, *(j.id for j in mid), *(j.id for j in low), zero.id]
    assert listing.job_ids(app, "default", "pending") == order
    assert listing.job_ids(app, "default", "pending", limit=3, offset=2) == order[2:5]
    assert [q for q in listing.queue_stats(app) if q["name"] == "default"][0]["pending"] == 7
    assert [row[1] for row in claim(app, pids=(1, 2))] == order[:2]
    assert [row[1] for row in claim(app, pids=(1, 2, 3, 4, 5, 6))] == order[2:]


def test_priorities_hold_in_a_rate_limited_queue(app):
    """A flow-controlled queue (here a queue rate limit) is claimed from by one flow pass per
    priority's list, highest first."""
    low = [apps.add.apply_async([i, 0], queue="fq") for i in range(2)]
    high = apps.add.apply_async([0, 8], queue="fq", priority=8)
    queue.set_rate(app, "fq", "1000000/s")  # one start per call (no bursts), never short of tokens after
    order = []
    for _ in range(3):
        order += [row[1] for row in claim(app, queues=("fq",)) if len(row) > 1]  # not the "wait" value
    assert order == [high.id, low[0].id, low[1].id]


def test_a_prioritized_job_keeps_its_priority_when_requeued_retried_or_lost(app):
    high = apps.add.apply_async([1, 1], priority=7)
    [row] = claim(app)
    low = apps.add.apply_async([2, 2])
    assert finish(app, high.id, str(row[2]), "requeue", "0", "", "back") == 1  # at the back of its priority
    assert claim(app)[0][1] == high.id
    assert finish(app, high.id, "2", "error", "E", "e", "", "1") == 1  # retries 0: failed for good
    assert high.refresh().state == "failed" and high.retry()
    assert claim(app)[0][1] == high.id
    assert scripts.LOSE(app.redis, [app.keys.q("default")], [86400, high.id, "3", "gone", "", "1"]) == ["pending"]
    assert app.redis.lrange(app.keys.q("default") + "pending:7", 0, -1) == [high.id]
    assert [row[1] for row in claim(app, pids=(1, 2))] == [high.id, low.id]
    delayed = apps.add.apply_async([3, 3], priority=3, delay=0.01)
    wait_for(lambda: scripts.SWEEP(app.redis, [app.keys.q("default")], [100, 100, 3600, 3600])[0] == 1,
             what="the delayed job's promotion")
    assert app.redis.lrange(app.keys.q("default") + "pending:3", 0, -1) == [delayed.id]
    assert delayed.kill() == "killed" and app.redis.llen(app.keys.q("default") + "pending:3") == 0


def test_purge_and_a_bounded_queue_count_every_priority(app):
    queue.create(app, "bq", bound=2)
    apps.add.apply_async([1, 1], queue="bq", priority=4)
    apps.add.apply_async([1, 1], queue="bq")
    with pytest.raises(Exception, match="full"):
        apps.add.apply_async([1, 1], queue="bq", priority=9, block_timeout=0)
    assert app.purge("bq") == 2 and queue.backlog(app, "bq") == 0


def test_a_priority_9_job_behind_50_priority_0_jobs_starts_among_the_first(app, stack):
    jobs = [apps.hold.apply_async((f"low{i}", 0), priority=0) for i in range(50)]
    urgent = apps.hold.apply_async(("urgent", 0), priority=9)
    stack.worker(concurrency=1)  # of two children, the one sent `urgent` first may start after
    assert urgent.wait(30) == "timeout"  # the other ran four low ones (CI, under load)
    for j in jobs:
        j.wait(30)
    order = started(app)
    assert len(order) == 51 and order[0] == "urgent" and order[1:] == [f"low{i}" for i in range(50)], order[:5]


def test_a_queue_without_flow_control_costs_no_command_more(app):
    """Enqueue, claim and finish of a plain job: 35 commands (those the scripts run included;
    40 as issue 17 left them, before issue 18's cuts: an unbatched finish's HDEL is its check,
    and it reads the meta only for a job of an exclusive queue). Flow control added none: the
    meta and record HMGETs read more fields. bench/plain_cost.py measures the same, with the
    time; docs/PROTOCOL.md, Pause, priorities, unique jobs, gives the count."""
    plain = [apps.add.apply_async([1, 1], queue="plain")]
    [row] = claim(app, queues=("plain",))  # a first job: the scripts are loaded, the queue known
    assert finish(app, row[1], str(row[2]), "completed", "2", queue="plain") == 1
    app.redis.config_resetstat()
    plain.append(apps.add.apply_async([1, 1], queue="plain"))
    [row] = claim(app, queues=("plain",))
    assert finish(app, row[1], str(row[2]), "completed", "2", queue="plain") == 1
    stats = app.redis.info("commandstats")
    ours = {k[len("cmdstat_"):]: v["calls"] for k, v in stats.items()
            if k.split("|")[0] not in ("cmdstat_info", "cmdstat_config", "cmdstat_hello", "cmdstat_client")}
    assert sum(ours.values()) == 35, ours
    assert ours["fcall"] == 3 and "evalsha" not in ours  # enqueue, claim, finish: Redis Functions
