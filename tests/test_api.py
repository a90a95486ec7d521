"""The Python API against a real Redis and real worker processes."""

from __future__ import annotations

import signal
import time

import pytest

from taskrunner import (
    InvalidName,
    JobFailed,
    JobNotFound,
    NotJSONError,
    PayloadTooLarge,
    TaskRunner,
    TaskRunnerError,
    Timeout,
    current_job,
)
from tests import apps
from tests.conftest import wait_for


def test_task_names_default_to_module_function(app):
    assert apps.add.name == "tests.apps.add"
    assert app.tasks["tests.apps.add"] is apps.add
    assert apps.add(2, 3) == 5  # calling a task runs it here


def test_delay_enqueues_a_pending_job(app):
    job = apps.add.delay(1, 2)
    assert len(job.id) == 26 and job.queue == "default"
    assert job.state == "pending"
    d = job.refresh().to_dict()
    assert d["task"] == "tests.apps.add" and d["args"] == [1, 2] and d["kwargs"] == {}
    assert d["attempts"] == 0 and d["enqueued_at"] > 0
    assert app.job(job.id).id == job.id


def test_apply_async_options(app):
    job = apps.add.apply_async([1], {"b": 2}, queue="other", max_duration=7, job_id="my-id.1", delay=100)
    d = app.job("my-id.1").to_dict()
    assert (d["queue"], d["state"], d["max_duration"]) == ("other", "delayed", 7.0)
    assert d["kwargs"] == {"b": 2} and d["due_at"] > d["enqueued_at"] + 99
    assert job.created
    again = apps.add.apply_async([5], {"b": 5}, queue="other", job_id="my-id.1")
    assert not again.created and app.job("my-id.1").to_dict()["args"] == [1]


@pytest.mark.parametrize("bad", [{1, 2}, object(), b"bytes", complex(1, 2)])
def test_non_json_arguments_are_refused(app, bad):
    with pytest.raises(NotJSONError, match="not JSON"):
        apps.add.delay(bad, 1)
    with pytest.raises(NotJSONError):
        apps.add.apply_async([], {"a": bad})
    assert app.queue_names() == []  # nothing was written


def test_oversized_payload_is_refused(app):
    app.configure(max_payload=1000)
    try:
        with pytest.raises(PayloadTooLarge, match="limit is 1000"):
            apps.add.delay("x" * 2000, 1)
    finally:
        app.configure(max_payload=1 << 20)


@pytest.mark.parametrize("queue", ["", "a b", "{x}", "_", "x" * 300, "é"])
def test_bad_queue_names_are_refused(app, queue):
    with pytest.raises(InvalidName):
        apps.add.apply_async([1, 2], queue=queue)


def test_bad_job_id_and_unknown_job(app):
    with pytest.raises(InvalidName):
        apps.add.apply_async([1, 2], job_id="has space")
    with pytest.raises(JobNotFound):
        app.job("nope")


def test_bad_settings_are_clear():
    with pytest.raises(ValueError, match="timeout_policy"):
        TaskRunner("x").task(timeout_policy="explode")(lambda: None)
    with pytest.raises(ValueError, match="invalid cron"):
        TaskRunner("x").periodic("every day")(lambda: None)


def test_kill_pending_job(app):
    job = apps.add.delay(1, 2)
    assert job.kill() == "killed"
    assert job.state == "killed"
    with pytest.raises(JobFailed) as e:
        job.wait(1)
    assert e.value.state == "killed"
    assert app.redis.llen(app.keys.q("default") + "pending") == 0


@pytest.mark.parametrize("task", [apps.finalizing, apps.finalizing_generator])
def test_a_kill_that_lands_in_a_finalizer_still_stops_the_job_at_once(app, stack, task):
    """A kill raises in the job; raised inside a __del__ (CI: a zipfile's, in `up`'s stop
    now), Python swallowed it with "Exception ignored in" and a traceback on the worker's
    output, and the job ran on until the worker's SIGKILL: its finally blocks never ran.
    Raised again as a generator suspended, it skipped the generator's finally block."""
    w = stack.worker(concurrency=1)
    job = task.delay("fin")
    ledger = f"{app.settings.prefix}:ledger:fin"
    wait_for(lambda: app.redis.get(ledger), what="the job started")
    job.kill()
    wait_for(lambda: app.redis.get(f"{ledger}:cleanup") == "1", 30, "the job's finally block")
    if task is apps.finalizing_generator:
        wait_for(lambda: app.redis.get(f"{ledger}:generator") == "1", 30, "the generator's finally block")
    wait_for(lambda: job.state == "killed", what="the worker to record the kill")  # after the finally
    w.send_signal(signal.SIGTERM)
    out, _ = w.communicate(timeout=60)
    assert "Exception ignored" not in out and "Traceback" not in out, out


def test_wait_times_out_then_gets_result(app, stack):
    job = apps.add.delay(20, 22)
    with pytest.raises(Timeout):
        job.wait(0.2)
    stack.worker()
    assert job.wait(30) == 42
    d = job.refresh().to_dict()
    assert d["state"] == "completed" and d["attempts"] == 1 and d["result"] == 42
    assert d["worker"] and d["host"] and d["pid"] and d["finished_at"] >= d["started_at"] >= d["enqueued_at"]


def test_failures_are_recorded(app, stack):
    stack.worker()
    boom = apps.boom.delay("bad <thing>")
    unknown = app.enqueue("tests.apps.nope", [1])
    # Refused where the task is known (tests/test_arguments.py); a producer that does not
    # know it (no app, queue given: no declaration read) leaves the worker to fail it.
    blind = TaskRunner("blind", redis_url=app.settings.redis_url, prefix=app.settings.prefix)
    bad_args = blind.enqueue("tests.apps.add", [1, 2, 3], queue="default")
    not_json = apps.not_json.delay()
    rejected = apps.reject.delay("no way")
    with pytest.raises(JobFailed) as e:
        boom.wait(30)
    assert e.value.error_type == "ValueError" and e.value.message == "bad <thing>"
    assert "raise ValueError(message)" in e.value.traceback
    for job, kind in [(unknown, "NotRegistered"), (bad_args, "BadArguments"), (not_json, "NotJSONError"),
                      (rejected, "Rejected")]:
        with pytest.raises(JobFailed) as e:
            job.wait(30)
        assert e.value.error_type == kind, (kind, e.value)
    assert rejected.refresh().to_dict()["attempts"] == 1  # Reject: no retries
    # the worker carried on
    assert apps.add.delay(1, 1).wait(30) == 2


def test_retries_with_backoff(app, stack):
    stack.worker()
    stack.dispatcher()
    ok = apps.flaky.delay("f1", 3)  # fails twice, retries=2: completes on the third try
    assert ok.wait(30) == "ok on try 3"
    d = ok.refresh().to_dict()
    assert d["attempts"] == 3 and d["failures"] == 2 and d["error_type"] == "RuntimeError"
    bad = apps.flaky.delay("f2", 10)  # never succeeds: failed after 1 + 2 tries
    with pytest.raises(JobFailed, match="try 3"):
        bad.wait(30)
    assert bad.refresh().to_dict()["attempts"] == 3


def test_retry_on_and_no_retry_on_decide_which_errors_run_again(app, stack):
    """retry_on=(ConnectionError, TimeoutError), no_retry_on=ConnectionRefusedError: only
    the first is tried again (1 + 3 tries); a ValueError (not in retry_on) and a
    ConnectionRefusedError (a ConnectionError, but in no_retry_on) fail at once."""
    stack.worker()
    stack.dispatcher()
    jobs = {error: apps.picky.delay(error, error) for error in ("ConnectionError", "ValueError",
                                                                 "ConnectionRefusedError")}
    for error, job in jobs.items():
        with pytest.raises(JobFailed, match=error):
            job.wait(30)
    tries = {error: int(app.redis.get(f"{app.settings.prefix}:ledger:{error}")) for error in jobs}
    assert tries == {"ConnectionError": 4, "ValueError": 1, "ConnectionRefusedError": 1}
    assert jobs["ValueError"].refresh().to_dict()["error_type"] == "ValueError"
    with pytest.raises(TypeError, match="retry_on takes exception classes"):
        app.task(retry_on=("ValueError",))(lambda: None)


def test_current_job_tells_a_task_its_own_delivery(app, stack):
    stack.worker()
    stack.dispatcher()
    before = time.time()
    job = apps.whoami.delay()
    seen = job.wait(30)
    assert {k: seen[k] for k in ("id", "task", "queue", "attempt", "headers")} == \
        {"id": job.id, "task": "tests.apps.whoami", "queue": "default", "attempt": 2, "headers": {}}
    assert before + 60 < seen["deadline"] < time.time() + 60  # its second try's start + max duration
    with pytest.raises(TaskRunnerError, match="only available inside a task"):
        current_job()


def test_task_requeues_itself_with_delay(app, stack):
    stack.worker()
    stack.dispatcher()
    job = apps.requeue_me.delay("r1", 2)
    assert job.wait(30) == 3
    d = job.refresh().to_dict()
    assert d["requeues"] == 2 and d["attempts"] == 3 and d.get("failures", 0) == 0


def test_delayed_job_runs_when_due(app, stack):
    stack.worker()
    stack.dispatcher()
    job = apps.add.apply_async([2, 2], delay=0.5)
    assert job.state == "delayed"
    assert job.wait(30) == 4
    d = job.refresh().to_dict()
    assert d["started_at"] >= d["enqueued_at"] + 0.5


def test_queues_in_strict_priority_order(app, stack):
    for i in range(5):
        apps.add.delay(i, 0)
        apps.high.delay(f"h{i}")
    stack.worker("-Q", "high,default", concurrency=1)
    wait_for(lambda: app.redis.zcard(app.keys.q("default") + "completed") == 5, what="all jobs")
    high_done = app.redis.zrange(app.keys.q("high") + "completed", 0, -1, withscores=True)
    low_done = app.redis.zrange(app.keys.q("default") + "completed", 0, -1, withscores=True)
    assert max(t for _, t in high_done) <= min(t for _, t in low_done)


def test_corrupt_records_fail_with_a_reason(app, stack):
    """Records written straight into Redis by a broken producer harm nothing else."""
    good = apps.add.delay(1, 1)
    p = app.keys.q("default")
    for job_id, fields in [("c1", {"task": "tests.apps.add", "args": "[1,", "kwargs": "{}"}),
                           ("c2", {"task": "tests.apps.add", "args": '{"a": 1}', "kwargs": "[]"}),
                           ("c3", {"args": "[]"}),
                           ("c4", {"task": "tests.apps.add", "args": "[1, 2]", "kwargs": "{}",
                                   "max_duration": "soon"})]:
        app.redis.hset(p + "job:" + job_id, mapping={"state": "pending", **fields})
        app.redis.sadd(p + "items", job_id)
        app.redis.lpush(p + "pending", job_id)
    stack.worker()
    for job_id, kind in [("c1", "BadArguments"), ("c2", "BadArguments"), ("c3", "CorruptJob")]:
        with pytest.raises(JobFailed) as e:
            app.job(job_id).wait(30)
        assert e.value.error_type == kind
    assert app.job("c4").wait(30) == 3  # a bad max_duration falls back to the default
    assert good.wait(30) == 2 and apps.add.delay(2, 2).wait(30) == 4


def test_idle_worker_wakes_for_every_job(app, stack):
    """Each job finds the worker idle and blocked in Redis: hundreds of wake-ups in a row."""
    stack.worker(concurrency=1)
    for i in range(300):
        assert apps.add.delay(i, 1).wait(30) == i + 1
    clients = app.redis.client_list()
    assert len(clients) < 20, len(clients)  # no connection left behind per wake-up
