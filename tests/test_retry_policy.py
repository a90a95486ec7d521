"""Retry policy with real workers: Retry capped by max_retries, a task's own backoff cap,
dead letters kept for failed_ttl, per-task result_ttl and ignore_result; and what the
enqueue script refuses of them."""

from __future__ import annotations

import json
import os
import signal

import pytest
import redis

from taskrunner import JobFailed, JobSpec, Retry, TaskRunner
from taskrunner.errors import MAX_RETRIES
from taskrunner.ops import listing
from taskrunner.protocol import scripts
from tests import apps, retry_apps
from tests.conftest import wait_for
from tests.test_declarations import Raw
from tests.test_failures import ledger, started_pid

WORKER = "tests.retry_apps"
WEEK = 7 * 86400


def record(app, job) -> dict:
    return job.refresh().to_dict()


# -- max_retries -------------------------------------------------------------------------


def test_retry_is_capped_by_max_retries_and_says_so(app, stack):
    stack.worker(app=WORKER)
    stack.dispatcher()
    assert retry_apps.asks.delay("two", 2).wait(30) == 3  # max_retries=2: two Retry are fine
    job = retry_apps.asks.delay("many", 100)
    with pytest.raises(JobFailed) as e:
        job.wait(30)
    assert (e.value.error_type, e.value.message) == ("MaxRetriesExceeded", "asked to retry 3 times; max_retries is 2")
    d = record(app, job)
    assert (ledger(app, "many"), d["retry_requests"], d["requeues"], d["attempts"]) == (3, 3, 2, 3)
    assert d.get("failures", 0) == 0  # retries (for exceptions) are another budget


def test_the_default_max_retries_and_apply_async(app, stack):
    stack.worker(app=WORKER)
    stack.dispatcher()
    with pytest.raises(JobFailed, match=f"max_retries is {MAX_RETRIES}"):
        apps.requeue_me.delay("default", 100).wait(30)  # a task that sets none
    assert ledger(app, "default") == MAX_RETRIES + 1
    job = retry_apps.asks.apply_async(["none", 1], max_retries=0)
    with pytest.raises(JobFailed, match="asked to retry 1 times; max_retries is 0"):
        job.wait(30)
    assert app.redis.hget(app.keys.job("default", job.id), "max_retries") == "0"
    [many] = app.enqueue_many([{"task": "tests.retry_apps.asks", "args": ["many", 1], "max_retries": 0}])
    with pytest.raises(JobFailed, match="asked to retry 1 times; max_retries is 0"):
        many.wait(30)


def test_lost_and_handed_back_deliveries_are_no_retry(app, stack):
    """max_retries=1: a SIGKILLed child and a worker's shutdown put the job back twice; its
    one Retry after that is still within its budget."""
    w1 = stack.worker(app=WORKER, concurrency=1, env={"TASKRUNNER_SHUTDOWN_GRACE": "0.3"})
    job = retry_apps.survives.delay("s")
    os.kill(started_pid(app, "s"), signal.SIGKILL)  # run 1: lost, requeued
    started_pid(app, "s", 2)
    w1.send_signal(signal.SIGTERM)  # run 2: outlives the grace, handed back
    assert w1.wait(30) == 0
    stack.worker(app=WORKER, concurrency=1)
    stack.dispatcher()
    assert job.wait(30) == "done"
    d = record(app, job)
    assert (d["lost"], d["retry_requests"], d["requeues"], ledger(app, "s")) == (1, 1, 3, 4)


def test_operator_retry_gives_a_fresh_budget(app, stack):
    stack.worker(app=WORKER)
    stack.dispatcher()
    job = retry_apps.asks.delay("again", 100)
    with pytest.raises(JobFailed, match="MaxRetriesExceeded"):
        job.wait(30)
    assert "queued again" in stack.cli("retry", job.id, check=True).stdout  # runs 4, 5 within the budget again
    with pytest.raises(JobFailed, match="asked to retry 3 times"):
        job.wait(30)
    assert ledger(app, "again") == 6
    done = retry_apps.asks.delay("done", 0)
    assert done.wait(30) == 1
    r = stack.cli("retry", done.id)
    assert r.returncode == 1 and "completed: only failed or killed jobs can be retried" in r.stderr


# -- retry_backoff_max -----------------------------------------------------------------


def test_a_tasks_own_backoff_cap(app, stack):
    """A backoff of 1000 s: the global cap (600 s) would make this wait for minutes."""
    stack.worker(app=WORKER)
    stack.dispatcher()
    job = retry_apps.capped.delay("cap")
    assert job.wait(30) == 3
    assert record(app, job)["failures"] == 2


# -- dead letters: failed_ttl ---------------------------------------------------------------


def test_failed_and_killed_jobs_are_kept_for_the_failed_ttl(app, stack):
    stack.worker(app=WORKER)
    failed = apps.boom.delay("x")
    with pytest.raises(JobFailed):
        failed.wait(30)
    lost = apps.crash.delay("poison")  # max_lost=2: WorkerLost, ended by lose()
    with pytest.raises(JobFailed, match="WorkerLost"):
        lost.wait(30)
    killed = apps.add.apply_async([1, 2], delay=3600)
    assert killed.kill("test") == "killed"
    done = apps.add.delay(1, 2)
    assert done.wait(30) == 3
    ttl = lambda job: app.redis.ttl(app.keys.job("default", job.id))  # noqa: E731
    assert all(86400 < ttl(j) <= WEEK for j in (failed, lost, killed)), [ttl(j) for j in (failed, lost, killed)]
    assert 0 < ttl(done) <= 86400
    own_fail, own_done = retry_apps.short_lived.delay(True), retry_apps.short_lived.delay(False)
    with pytest.raises(JobFailed):
        own_fail.wait(30)
    assert own_done.wait(30) == "ok"
    assert 60 < ttl(own_fail) <= 3600 and 0 < ttl(own_done) <= 60  # the task's failed_ttl and result_ttl


def test_the_sweep_keeps_dead_letters_listed_after_results_go(app, stack):
    """Results kept 1 s, failures a week: once the sweep has trimmed a later completed job,
    the earlier failed one is still listed, and can be retried."""
    env = {"TASKRUNNER_RESULT_TTL": "1"}
    stack.worker(app=WORKER, env=env)
    failed = apps.boom.delay("listed")
    with pytest.raises(JobFailed):
        failed.wait(30)
    done = apps.add.delay(2, 2)
    assert done.wait(30) == 4
    stack.dispatcher(env=env)
    p = app.keys.q("default")
    wait_for(lambda: app.redis.zscore(p + "completed", done.id) is None, what="the sweep to trim the result")
    assert app.redis.zscore(p + "failed", failed.id) is not None
    listed = json.loads(stack.cli("jobs", "--state", "failed", "--json", check=True).stdout)
    assert [j["id"] for j in listed] == [failed.id]
    assert failed.retry("test")
    with pytest.raises(JobFailed):
        failed.wait(30)  # failed again, and listed again


def test_a_tasks_longer_failed_ttl_keeps_it_listed(app, stack):
    """Failures kept 1 s, but short_lived's an hour: once a later failure's record expired
    and the sweep ran again, short_lived's is still listed (the sets are trimmed by the
    longest TTL of the queue's tasks); the expired one is not shown."""
    env = {"TASKRUNNER_FAILED_TTL": "1"}
    stack.worker(app=WORKER, env=env)
    stack.dispatcher(env=env)
    own = retry_apps.short_lived.delay(True)
    with pytest.raises(JobFailed):
        own.wait(30)
    other = apps.boom.delay("gone")
    with pytest.raises(JobFailed):
        other.wait(30)
    p = app.keys.q("default")
    assert app.redis.hget(p + "meta", "longest_failed_ttl") == "3600"
    wait_for(lambda: not app.redis.exists(app.keys.job("default", other.id)), what="the default failure to expire")
    assert apps.add.apply_async([1, 1], delay=0.1).wait(30) == 2  # promoted by a sweep, which trimmed too
    assert app.redis.zscore(p + "failed", own.id) is not None
    listed = json.loads(stack.cli("jobs", "--state", "failed", "--json", check=True).stdout)
    assert [j["id"] for j in listed] == [own.id]
    total, rows = listing.finished(app, "failed")
    assert [r["id"] for r in rows] == [own.id]


# -- result_ttl, ignore_result ----------------------------------------------------------------


def test_ignore_result_completes_without_storing_it(app, stack):
    stack.worker(app=WORKER)
    job = retry_apps.quiet.delay()
    assert job.wait(30) is None  # a set, which JSON cannot hold: not even encoded
    d = record(app, job)
    assert (d["state"], app.redis.hget(app.keys.job("default", job.id), "result")) == ("completed", "null")


def test_eager_mode_caps_retry_and_ignores_results_alike() -> None:
    eager = TaskRunner("eager-retry", eager=True)
    calls = []

    @eager.task(name="asks", max_retries=1)
    def asks() -> None:
        calls.append(1)
        raise Retry()

    @eager.task(name="quiet", ignore_result=True)
    def quiet() -> object:
        return {1}

    with pytest.raises(JobFailed) as e:
        asks.delay().wait()
    assert (e.value.message, len(calls)) == ("asked to retry 2 times; max_retries is 1", 2)
    assert quiet.delay().wait() is None


# -- declarations and refusals -------------------------------------------------------------


def test_a_producer_without_the_app_gets_the_tasks_policy(app, stack, redis_server):
    stack.worker(app=WORKER)
    wait_for(lambda: app.redis.hexists(app.keys.q("default") + "tasks", "tests.retry_apps.short_lived"),
             what="the worker's declarations")
    producer = TaskRunner("producer", redis_url=redis_server.url, prefix=app.settings.prefix)
    job = producer.enqueue("tests.retry_apps.asks", ["declared", 100])
    with pytest.raises(JobFailed, match="max_retries is 2"):
        job.wait(30)
    job = producer.enqueue("tests.retry_apps.short_lived", [False])
    assert job.wait(30) == "ok"
    d = app.redis.hgetall(app.keys.job("default", job.id))
    assert (d["result_ttl"], d["failed_ttl"], d["max_retries"]) == ("60", "3600", "3")
    # A producer that knows the task sends only what differs from the defaults.
    d = app.redis.hgetall(app.keys.job("default", apps.add.apply_async([1, 1], delay=3600).id))
    assert not {"max_retries", "retry_backoff_max", "result_ttl", "failed_ttl"} & set(d)


@pytest.mark.parametrize("field, value, words", [
    ("max_retries", "-1", "max_retries must be a whole number from 0"),
    ("max_retries", "1.5", "max_retries must be a whole number from 0"),
    ("result_ttl", "0", "result_ttl must be a whole number from 1"),
    ("failed_ttl", "week", "failed_ttl must be a whole number from 1"),
    ("retry_backoff_max", "-0.5", "retry_backoff_max must be a number of seconds >= 0"),
    ("retry_backoff_max", "nan", "retry_backoff_max must be a number of seconds >= 0"),
])
def test_enqueue_script_refuses_bad_policy_values(app, field, value, words):
    raw = Raw(app.settings.redis_url, app.settings.prefix)
    before = raw.snapshot()
    argv = [2, *raw.job("ok", "task", "t.good")[1:], *raw.job("bad", "task", "t.good", field, value)[1:]]
    with pytest.raises(redis.ResponseError, match=f"BadValue: job bad: {words}"):
        raw.enqueue([raw.q("default")], *argv)
    assert raw.snapshot() == before  # neither job written


def test_enqueue_script_refuses_a_bad_declared_policy(app):
    raw = Raw(app.settings.redis_url, app.settings.prefix)
    app.redis.hset(raw.q("default") + "tasks", "t.declared", json.dumps({"max_retries": -3}))
    before = raw.snapshot()
    with pytest.raises(redis.ResponseError, match="declaration of task t.declared .*max_retries must be"):
        raw.enqueue([raw.q("default")], *raw.job("j", "task", "t.declared"))
    assert raw.snapshot() == before


@pytest.mark.parametrize("option, value", [("max_retries", -1), ("max_retries", True), ("retry_backoff_max", -1.0),
                                           ("result_ttl", 0), ("failed_ttl", 1.5), ("failed_ttl", 2**31)])
def test_python_refuses_bad_policy_values(option, value):
    with pytest.raises(ValueError, match=option):
        JobSpec(**{option: value})
    with pytest.raises(ValueError, match=option):
        TaskRunner("x", eager=True).task(**{option: value})(lambda: None)


def test_finish_and_sweep_refuse_a_bad_failed_ttl(app):
    p = app.keys.q("default")
    with pytest.raises(redis.ResponseError, match=r"failed TTL \(ARGV\[4\]\)"):
        scripts.SWEEP(app.redis, [p], [10, 10, 3600, 0])
    with pytest.raises(redis.ResponseError, match=r"failed TTL \(ARGV\[3\]\)"):
        scripts.FINISH(app.redis, [p], [3600, 600, -1])
