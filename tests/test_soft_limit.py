"""Soft time limits with real workers: SoftTimeLimit raised inside a sync task (SIGALRM, even
in time.sleep), a task in a thread (an asynchronous exception) and a coroutine (cancelled,
then SoftTimeLimit); an unhandled one fails the job (retryable like any exception); the hard
kill at max_duration stays."""

from __future__ import annotations

import signal

import pytest

from taskrunner import JobFailed, TaskRunner
from tests import apps
from tests.conftest import until_logged

A = "tests.async_apps"


def cleaned(app: TaskRunner, key: str) -> int:
    return int(app.redis.get(f"{app.settings.prefix}:ledger:{key}:cleanup") or 0)


def test_a_sync_task_gets_soft_time_limit_inside_time_sleep(app, stack):
    stack.worker("--async-slots", "0", concurrency=1)
    handled, unhandled = apps.soft_sleeper.delay("h", True), apps.soft_sleeper.delay("u", False)
    assert handled.wait(20) == "cleaned up"  # long before its 25 s sleep or 30 s max duration
    with pytest.raises(JobFailed, match="SoftTimeLimit"):
        unhandled.wait(20)
    d = unhandled.refresh().to_dict()
    assert d["error_type"] == "taskrunner.errors.SoftTimeLimit" and "soft time limit (0.3s)" in d["error"]
    assert d["soft_limit"] == 0.3  # a number, as max_duration
    assert (cleaned(app, "h"), cleaned(app, "u")) == (1, 1)
    assert apps.add.delay(1, 2).wait(20) == 3  # the child goes on, with no alarm left behind


@pytest.mark.parametrize("children", [("--async-slots", "0"), ("--threads", "2")], ids=["classic", "threads"])
def test_a_soft_time_limit_that_lands_in_a_finalizer_still_reaches_the_task(app, stack, children):
    """SoftTimeLimit raised inside a __del__ (SIGALRM's in a classic child, the timer's
    asynchronous exception in a thread) was swallowed by Python ("Exception ignored in", a
    traceback on the worker's output) and the task ran on to its hard limit; it is raised again
    at the task's next line, as a kill is (test_api.py), or posted to its thread again."""
    w = stack.worker(*children, concurrency=1)
    job = apps.soft_finalizing.delay("f")
    assert job.wait(25) == "cleaned up"  # its loop runs 20 s; the soft limit is 0.3 s
    assert cleaned(app, "f") == 1
    assert apps.add.delay(1, 2).wait(20) == 3  # the child goes on, with no trace left behind
    w.send_signal(signal.SIGTERM)
    out, _ = w.communicate(timeout=60)
    assert "Exception ignored" not in out and "Traceback" not in out, out


def test_an_unhandled_soft_time_limit_is_retried_like_any_exception(app, stack):
    stack.worker("--async-slots", "0", concurrency=1)
    stack.dispatcher()
    job = apps.soft_sleeper.apply_async(["r", False], retries=1)
    with pytest.raises(JobFailed, match="SoftTimeLimit"):
        job.wait(30)
    assert job.refresh().to_dict()["attempts"] == 2 and cleaned(app, "r") == 2


def test_a_task_in_a_thread_gets_soft_time_limit(app, stack):
    stack.worker("--threads", "2", concurrency=1)
    spinner, sibling = apps.soft_spinner.delay("t"), apps.hold.delay("sibling", 3)
    with pytest.raises(JobFailed, match="SoftTimeLimit"):
        spinner.wait(20)
    assert cleaned(app, "t") == 1
    assert sibling.wait(20) == "timeout"  # its neighbour thread ran on, untouched


def test_an_async_task_is_cancelled_at_its_soft_limit_and_fails_with_soft_time_limit(app, stack):
    until_logged(stack.worker(app="tests.async_apps", concurrency=1), "queues")  # it declared its tasks
    # Enqueued by name by an app that does not declare them: the soft limit comes from the
    # worker's declaration.
    soft, sibling = app.enqueue(f"{A}.async_soft", ["a"]), app.enqueue(f"{A}.async_nap", ["n", 2])
    with pytest.raises(JobFailed, match="SoftTimeLimit"):
        soft.wait(20)
    assert soft.refresh().to_dict()["error_type"] == "taskrunner.errors.SoftTimeLimit" and cleaned(app, "a") == 1
    assert sibling.wait(20) == "n"


def test_soft_limit_must_be_less_than_max_duration(app):
    with pytest.raises(ValueError, match="soft_limit .* must be less than max_duration"):
        app.task(soft_limit=30, max_duration=30, name="t.bad")(lambda: None)
    with pytest.raises(ValueError, match="soft_limit must be a finite number of seconds > 0"):
        app.task(soft_limit=0, name="t.bad")(lambda: None)
    with pytest.raises(ValueError, match="must be less than max_duration"):
        apps.soft_sleeper.apply_async(["x", True], max_duration=0.2)
