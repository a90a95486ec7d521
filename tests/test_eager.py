"""Eager mode: enqueue runs the task in this process and no Redis is needed. Every test
here runs with REDIS_URL on a port nothing listens on: a command sent to Redis would raise
ConnectionError. One test listens on the port itself to see that no connection is even
attempted."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest
import redis

from taskrunner import (
    BadArguments,
    JobFailed,
    JobNotFound,
    NotJSONError,
    PayloadTooLarge,
    Reject,
    Retry,
    TaskRunner,
    current_job,
)

NOWHERE = "redis://127.0.0.1:1/0"


@pytest.fixture(autouse=True)
def no_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", NOWHERE)
    monkeypatch.delenv("TASKRUNNER_EAGER", raising=False)


def make_app(**settings: object) -> tuple[TaskRunner, dict[str, list]]:
    """An eager app with tasks that record what they were given (`calls`, by task)."""
    app = TaskRunner("eager-test", eager=True, **settings)
    calls: dict[str, list] = {"add": [], "flaky": [], "again": [], "reject": []}

    @app.task(name="add")
    def add(a, b, *, scale=1):
        calls["add"].append((a, b, scale))
        return {"sum": (a + b) * scale}

    @app.task(name="flaky", retries=2)
    def flaky(fail_times):
        calls["flaky"].append(fail_times)
        if len(calls["flaky"]) <= fail_times:
            raise ConnectionError(f"try {len(calls['flaky'])}")
        return len(calls["flaky"])

    @app.task(name="again", max_retries=3)
    def again(times):
        calls["again"].append(times)
        if len(calls["again"]) <= times:
            raise Retry(delay=3600)  # not waited in eager mode
        return "done"

    @app.task(name="reject", retries=5)
    def reject():
        calls["reject"].append(1)
        raise Reject("bad input")

    @app.task(name="echo")
    def echo(*args, **kwargs):
        return [list(args), kwargs]

    @app.task(name="returns_set")
    def returns_set():
        return {1, 2}

    return app, calls


def test_delay_runs_inline_and_returns_an_ended_job() -> None:
    app, calls = make_app()
    job = app.tasks["add"].delay(2, 3, scale=10)
    assert calls["add"] == [(2, 3, 10)]
    assert job.state == "completed"
    assert job.result == {"sum": 50}
    assert job.wait() == {"sum": 50}
    assert job.wait(timeout=1) == {"sum": 50}
    d = job.refresh().to_dict()
    assert d["state"] == "completed" and d["result"] == {"sum": 50}
    assert d["args"] == [2, 3] and d["kwargs"] == {"scale": 10}
    assert d["attempts"] == 1 and d["task"] == "add" and d["queue"] == "default"
    assert d["finished_at"] >= d["started_at"] >= d["enqueued_at"]
    assert [e["event"] for e in d["timeline"]] == ["enqueued", "delivery 1 completed"]


def test_apply_async_and_enqueue_by_name() -> None:
    app, _ = make_app()
    job = app.tasks["add"].apply_async([1, 2], queue="fast", job_id="my-id", delay=3600)
    assert (job.id, job.queue, job.state, job.wait()) == ("my-id", "fast", "completed", {"sum": 3})
    assert app.enqueue("add", [4, 5], {"scale": 2}).wait() == {"sum": 18}


def test_task_gets_json_round_tripped_arguments() -> None:
    """As a worker's child would: tuples become lists; dict keys stay strings."""
    app, _ = make_app()
    assert app.enqueue("echo", [(1, 2), {"k": (3,)}], {"x": (4,)}).wait() == [[[1, 2], {"k": [3]}], {"x": [4]}]


def test_failure_raises_job_failed_with_type_and_message() -> None:
    app, calls = make_app()
    job = app.tasks["flaky"].apply_async([10], retries=0)
    assert calls["flaky"] == [10] and job.state == "failed"
    with pytest.raises(JobFailed) as e:
        job.wait()
    assert (e.value.state, e.value.error_type, e.value.message) == ("failed", "ConnectionError", "try 1")
    assert "ConnectionError: try 1" in e.value.traceback
    d = job.to_dict()
    assert (d["error_type"], d["error"], d["failures"], d["result"]) == ("ConnectionError", "try 1", 1, None)


def test_exceptions_are_retried_inline_up_to_the_tasks_retries() -> None:
    app, calls = make_app()
    job = app.tasks["flaky"].delay(2)  # fails twice, retries=2: the third run succeeds
    assert job.wait() == 3 and len(calls["flaky"]) == 3
    assert job.to_dict()["attempts"] == 3 and job.to_dict()["failures"] == 2

    calls["flaky"].clear()
    job = app.tasks["flaky"].delay(3)  # one failure too many
    assert len(calls["flaky"]) == 3
    with pytest.raises(JobFailed, match="try 3"):
        job.wait()


def test_retry_reruns_inline_and_is_capped_by_max_retries() -> None:
    app, calls = make_app()
    assert app.tasks["again"].delay(3).wait() == "done"  # 3 Retry, max_retries=3
    assert len(calls["again"]) == 4

    calls["again"].clear()
    job = app.tasks["again"].delay(100)
    assert len(calls["again"]) == 4  # not forever
    with pytest.raises(JobFailed) as e:
        job.wait()
    assert (e.value.error_type, e.value.message) == ("MaxRetriesExceeded", "asked to retry 4 times; max_retries is 3")


def test_current_job_and_retry_on_work_inline() -> None:
    """The task sees its delivery (current_job) and its retry policy as in a worker."""
    app = TaskRunner("eager-ctx", eager=True)
    seen: list = []

    @app.task(name="ctx", queue="q1", retries=2, max_duration=30, no_retry_on=ValueError)
    def ctx(fail):
        seen.append(current_job())
        if len(seen) == 1:
            raise ValueError("no retry") if fail else ConnectionError("retried")
        return seen[-1].attempt

    assert ctx.delay(False).wait() == 2
    assert [(j.task, j.queue, j.attempt) for j in seen] == [("ctx", "q1", 1), ("ctx", "q1", 2)]
    assert seen[-1].deadline > time.time() + 25
    seen.clear()
    with pytest.raises(JobFailed, match="no retry"):
        ctx.delay(True).wait()
    assert len(seen) == 1


def test_reject_fails_without_retries() -> None:
    app, calls = make_app()
    job = app.tasks["reject"].delay()
    assert calls["reject"] == [1]
    with pytest.raises(JobFailed) as e:
        job.wait()
    assert (e.value.error_type, e.value.message) == ("Rejected", "bad input")


def test_retry_of_a_failed_job_runs_it_again() -> None:
    app, calls = make_app()
    job = app.tasks["flaky"].apply_async([1], retries=0)
    assert job.state == "failed"
    assert job.retry() is True
    assert job.state == "completed" and job.wait() == 2
    assert job.retry() is False  # only failed or killed jobs


def test_arguments_and_results_must_be_json() -> None:
    app, calls = make_app()
    with pytest.raises(NotJSONError):
        app.tasks["add"].delay({1}, 2)
    with pytest.raises(NotJSONError):
        app.enqueue_many([{"task": "add", "args": [1, 2]}, {"task": "add", "args": [object(), 1]}])
    assert calls["add"] == [(1, 2, 1)]  # the jobs before the refused one ran, as they are enqueued
    with pytest.raises(JobFailed) as e:
        app.tasks["returns_set"].delay().wait()
    assert e.value.error_type == "NotJSONError"


def test_payload_limit() -> None:
    app, calls = make_app(max_payload=100)
    with pytest.raises(PayloadTooLarge):
        app.tasks["add"].delay("x" * 200, "y")
    assert calls["add"] == []


def test_unknown_task_ends_failed_not_registered() -> None:
    app, _ = make_app()
    job = app.enqueue("no.such.task", [1])
    assert job.state == "failed"
    with pytest.raises(JobFailed) as e:
        job.wait()
    assert e.value.error_type == "NotRegistered" and "no.such.task" in e.value.message


def test_bad_arguments_are_refused_at_enqueue_as_with_redis() -> None:
    app, calls = make_app()
    with pytest.raises(BadArguments, match="missing a required argument: 'b'"):
        app.tasks["add"].delay(1)
    assert calls["add"] == []


def test_enqueue_many_runs_each_in_order() -> None:
    app, calls = make_app()
    seen: list[int] = []
    jobs = app.enqueue_many([{"task": "add", "args": [i, i]} for i in range(5)] + [{"task": "reject"}],
                            progress=seen.append)
    assert [c[0] for c in calls["add"]] == [0, 1, 2, 3, 4] and sum(seen) == 6
    assert [j.state for j in jobs] == ["completed"] * 5 + ["failed"]
    assert jobs[4].wait() == {"sum": 8}


def test_enqueue_many_links_in_eager_mode() -> None:
    """depends_on names earlier jobs of the call by id; callbacks run after their job."""
    app, calls = make_app()
    jobs = app.enqueue_many([
        {"task": "add", "args": [1, 2], "id": "a"},
        {"task": "add", "args": [3, 4], "depends_on": ["a"], "on_success": {"task": "add", "args": [5, 5],
                                                                            "immutable": True}},
        {"task": "reject", "id": "r"},
        {"task": "add", "args": [6, 6], "depends_on": ["r"], "on_failure": {"task": "add", "args": [7, 7],
                                                                            "immutable": True}}])
    assert [j.state for j in jobs] == ["completed", "completed", "failed", "canceled"]
    assert calls["add"] == [(1, 2, 1), (3, 4, 1), (5, 5, 1), (7, 7, 1)]
    with pytest.raises(TypeError, match="job 1: in eager mode depends_on takes the Job objects"):
        app.enqueue_many([{"task": "add", "args": [1, 1], "depends_on": ["elsewhere"]}])


def test_kill_requeue_delete_of_an_ended_job() -> None:
    app, _ = make_app()
    job = app.tasks["add"].delay(1, 1)
    assert job.kill() == "already completed" and job.requeue() is False
    assert job.delete() is True
    with pytest.raises(JobNotFound):
        job.refresh()


@pytest.mark.parametrize(("value", "eager"), [("1", True), ("true", True), ("0", False), ("off", False)])
def test_env_variable(monkeypatch: pytest.MonkeyPatch, value: str, eager: bool) -> None:
    monkeypatch.setenv("TASKRUNNER_EAGER", value)
    app = TaskRunner("env")
    assert app.settings.eager is eager
    assert TaskRunner("kw", eager=True).settings.eager is True


def test_env_variable_runs_tasks_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKRUNNER_EAGER", "1")
    app = TaskRunner("env")
    double = app.task(name="double")(lambda x: 2 * x)
    assert double.delay(21).wait() == 42


def test_bad_env_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKRUNNER_EAGER", "maybe")
    with pytest.raises(ValueError, match="TASKRUNNER_EAGER='maybe' is not a valid yes/no"):
        TaskRunner("env")


@pytest.mark.parametrize("name", ["RESULT_TTL", "FAILED_TTL"])
def test_a_record_ttl_under_a_second_is_refused_at_start(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """finish.lua refuses it: a worker started with it would fail every finish."""
    monkeypatch.setenv(f"TASKRUNNER_{name}", "0")
    with pytest.raises(ValueError, match=f"TASKRUNNER_{name}=0 must be a whole number from 1 "):
        TaskRunner("env")


def test_without_eager_the_same_enqueue_needs_redis() -> None:
    """The check the tests above rely on: this URL really is unreachable."""
    app = TaskRunner("real", enqueue_retry=0)  # at once, not after riding out the outage
    app.task(name="add")(lambda a, b: a + b)
    with pytest.raises(redis.ConnectionError):
        app.enqueue("add", [1, 2])


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A port that accepts connections, as REDIS_URL: any connection attempt shows there."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{s.getsockname()[1]}/0")
    yield s
    s.close()


def accepted(s: socket.socket) -> bool:
    try:
        s.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def test_no_connection_is_attempted(listener: socket.socket) -> None:
    app, _ = make_app()
    app.tasks["add"].delay(1, 2).wait()
    app.enqueue("no.such.task").refresh().to_dict()
    assert app.enqueue_many([{"task": "flaky", "args": [5]}])[0].state == "failed"
    assert not accepted(listener)
    # The control: a real app's enqueue does connect there (and times out: no RESP answers).
    real = TaskRunner("real", redis_url=os.environ["REDIS_URL"] + "?socket_timeout=0.5")
    real.task(name="add")(lambda a, b: a + b)
    with pytest.raises(redis.RedisError):
        real.enqueue("add", [1, 2])
    assert accepted(listener)


def test_a_task_in_a_script_run_directly_is_named_after_the_script(tmp_path) -> None:
    """`python shop.py` defining tasks: their module is `__main__`, which no task name may
    start with, so the first @app.task raised InvalidName. They are named as a worker's
    `-A shop` names them: shop.add."""
    import subprocess
    import sys

    script = tmp_path / "shop.py"
    script.write_text("from taskrunner import TaskRunner\napp = TaskRunner('shop', eager=True)\n"
                      "@app.task\ndef add(a, b):\n    return a + b\n"
                      "print(sorted(app.tasks), add.delay(1, 2).wait())\n")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "REDIS_URL": NOWHERE})
    assert r.returncode == 0 and r.stdout.strip() == "['shop.add'] 3", r
