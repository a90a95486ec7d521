"""Headers and middleware with real workers: headers travel from the producer to the task
and the record; every hook fires in the process it belongs to; a raising hook is logged
with the job id and the job is neither lost nor run twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from taskrunner import (
    BadArguments,
    JobFailed,
    JobNotFound,
    PayloadTooLarge,
    QueueClosed,
    Retry,
    TaskRunner,
    chain,
    chord,
    current_job,
    group,
)
from taskrunner.client.aio import AsyncClient
from taskrunner.errors import NotJSONError
from taskrunner.worker import child
from tests import apps


def status(stack, job_id: str) -> dict:
    return json.loads(stack.cli("status", job_id, "--json", check=True).stdout)


def test_headers_reach_the_task_and_the_record(app, stack):
    job = apps.whoami.apply_async(headers={"trace": "t-1", "tenant": {"id": 7}})  # fails once: a retry has them too
    stack.worker()
    stack.dispatcher()
    assert job.wait(30)["headers"] == {"trace": "t-1", "tenant": {"id": 7}}
    assert status(stack, job.id)["headers"] == {"trace": "t-1", "tenant": {"id": 7}}
    plain = apps.add.delay(1, 2)
    assert plain.wait(30) == 3
    assert "headers" not in app.redis.hgetall(app.keys.job("default", plain.id))  # no headers: no field
    assert status(stack, plain.id)["headers"] == {}


def test_headers_are_checked_and_counted_in_the_payload(app: TaskRunner):
    with pytest.raises(TypeError, match="headers must be a dict"):
        apps.add.apply_async([1, 2], headers=["x"])
    with pytest.raises(NotJSONError):
        apps.add.apply_async([1, 2], headers={"x": object()})
    with pytest.raises(PayloadTooLarge, match="arguments and headers of tests.apps.add take"):
        apps.add.apply_async([1, 2], headers={"x": "y" * app.settings.max_payload})
    many = app.enqueue_many([{"task": "tests.apps.add", "args": [1, 2], "headers": {"n": 1}}])
    assert many[0].refresh().to_dict()["headers"] == {"n": 1}


@pytest.fixture
def mw(app: TaskRunner):
    """tests/middleware_app.py, producing into the test's prefix."""
    from tests import middleware_app

    middleware_app.app.settings = app.settings
    middleware_app.app.configure(redis_url=app.settings.redis_url, prefix=app.settings.prefix)
    return middleware_app


def ran(app: TaskRunner, key: str) -> int:
    """How many times a task of middleware_app ran for `key` (its ledger)."""
    return int(app.redis.get(f"{app.settings.prefix}:ledger:{key}") or 0)


def stopped(w) -> str:
    """Stop a worker gracefully (SIGTERM); its output."""
    w.send_signal(signal.SIGTERM)
    return w.communicate(timeout=60)[0]


def test_every_hook_fires_in_its_process(app, mw, stack):
    w = stack.worker("--async-slots", "0", app="tests.middleware_app", concurrency=1)  # a classic child
    stack.dispatcher(app="tests.middleware_app")  # boom's retry
    ok = mw.work.delay("ok")
    result = ok.wait(30)
    child = result["pid"]
    assert result["headers"] == {"stamp": f"enqueued by {os.getpid()}"}  # before_enqueue's, in the producer
    bad = mw.boom.delay("bad")
    with pytest.raises(JobFailed):
        bad.wait(30)
    stopped(w)
    hooks = [tuple(h) for h in mw.recorded()]
    assert [h for h in hooks if h[0] == "before_enqueue"] == [("before_enqueue", os.getpid(), ok.id, None),
                                                             ("before_enqueue", os.getpid(), bad.id, None)]
    assert [h for h in hooks if h[0] != "before_enqueue"] == [
        ("child_start", child, None, None),
        ("before_run", child, ok.id, None), ("after_run", child, ok.id, "completed"),
        ("before_run", child, bad.id, None), ("on_retry", child, bad.id, "ValueError"),
        ("after_run", child, bad.id, "error"),
        ("before_run", child, bad.id, None), ("on_failure", child, bad.id, "ValueError"),
        ("after_run", child, bad.id, "error"),
        ("child_stop", child, None, None)]
    assert child != w.pid and ran(app, "bad") == 2


def test_a_retry_past_max_retries_is_a_failure_to_the_hooks(app, mw, stack):
    """on_retry or on_failure say what finish.lua will do: a Retry within max_retries runs
    again, the next is MaxRetriesExceeded. The child reads the record to know, and only
    when a hook asks (the claim carries nothing for it)."""
    w = stack.worker(app="tests.middleware_app", concurrency=1)
    job = mw.asks_again.delay("asks")
    with pytest.raises(JobFailed, match="MaxRetriesExceeded"):
        job.wait(30)
    stopped(w)
    hooks = [tuple(h[0::3]) for h in mw.recorded() if h[2] == job.id and h[0] in ("on_retry", "on_failure")]
    assert hooks == [("on_retry", "Retry"), ("on_failure", "Retry")] and ran(app, "asks") == 2


def test_a_task_knows_how_many_retries_it_has_left(app, mw, stack):
    stack.worker(app="tests.middleware_app", concurrency=1)
    stack.dispatcher(app="tests.middleware_app")  # the retries' backoff
    with pytest.raises(JobFailed):
        mw.counts_down.delay("cd").wait(30)
    assert app.redis.lrange(f"{app.settings.prefix}:left:cd", 0, -1) == ["2", "1", "0"]


def test_hooks_fire_in_a_loop_child_around_threads_and_coroutines(app, mw, stack):
    w = stack.worker("--threads", "2", app="tests.middleware_app", concurrency=1)
    in_thread, coroutine = mw.work.delay("t"), mw.async_work.delay("a")
    child = in_thread.wait(30)["pid"]
    assert coroutine.wait(30)["pid"] == child
    assert coroutine.wait(30)["headers"]["stamp"] == f"enqueued by {os.getpid()}"
    stopped(w)
    hooks = [tuple(h[:3]) for h in mw.recorded() if h[0] != "before_enqueue"]
    assert hooks[0] == ("child_start", child, None) and hooks[-1] == ("child_stop", child, None)
    assert sorted(hooks[1:-1]) == sorted([("before_run", child, in_thread.id), ("after_run", child, in_thread.id),
                                          ("before_run", child, coroutine.id), ("after_run", child, coroutine.id)])


def test_a_raising_hook_is_logged_with_the_job_id_and_the_job_is_neither_lost_nor_run_twice(app, mw, stack, caplog):
    with pytest.raises(RuntimeError, match="before_enqueue hook failed on purpose"):
        mw.work.apply_async(["never"], job_id="refused", headers={"raise": "before_enqueue"})
    assert "raised for job refused; not enqueued" in caplog.text
    [refused] = [r for r in caplog.records if "not enqueued" in r.getMessage()]
    assert (refused.job_id, refused.task, refused.queue, refused.attempt) == (
        "refused", mw.work.name, mw.work.spec.queue, 0)  # its log fields (--log-format json)
    with pytest.raises(JobNotFound):
        app.job("refused")  # nothing written
    w = stack.worker("--async-slots", "0", app="tests.middleware_app", concurrency=1)
    before = mw.work.apply_async(["before"], headers={"raise": "before_run"})
    after = mw.work.apply_async(["after"], headers={"raise": "after_run"})
    failure = mw.boom.apply_async(["failure"], retries=0, headers={"raise": "on_failure"})
    with pytest.raises(JobFailed, match="before_run hook failed on purpose"):
        before.wait(30)
    assert after.wait(30)["headers"]["raise"] == "after_run"
    with pytest.raises(JobFailed, match="ValueError"):
        failure.wait(30)
    assert (ran(app, "before"), ran(app, "after"), ran(app, "failure")) == (0, 1, 1)  # the task did not run
    assert before.refresh().to_dict()["error_type"] == "RuntimeError"
    out = stopped(w)
    for job, hook in [(before, "before_run"), (after, "after_run"), (failure, "on_failure")]:
        assert f"Recorder.{hook} raised for job {job.id}" in out
        lines = [x["line"] for x in job.refresh().to_dict()["logs"]]
        assert any(f"Recorder.{hook} raised for job {job.id}" in x for x in lines), lines
    hooks = [tuple(h[:3]) for h in mw.recorded()]
    assert ("after_run", hooks[-2][1], before.id) in hooks  # after a raising before_run, the after hooks ran


def test_an_enqueue_refused_for_its_arguments_runs_no_before_enqueue_hook(app, mw, stack):
    """The job is checked first (its arguments against the task's parameters, as JSON, their
    size), then the hooks run: a hook that counts or logs enqueues saw ones never enqueued
    (Celery checks the arguments before its publish signals too). Headers a hook adds are
    counted in the payload after it."""
    refusals = [
        (lambda: mw.work.delay(), BadArguments),  # work(key)
        (lambda: mw.work.delay("a", "b"), BadArguments),
        (lambda: mw.work.apply_async(kwargs={"nope": 1}), BadArguments),
        (lambda: mw.work.delay(object()), NotJSONError),
        (lambda: mw.work.delay("y" * app.settings.max_payload), PayloadTooLarge),
        (lambda: mw.work.apply_async(["k"], headers={"x": object()}), NotJSONError),
        (lambda: mw.app.enqueue_many([{"task": mw.work.name, "args": []}]), BadArguments),
    ]
    for enqueue, refused in refusals:
        with pytest.raises(refused):
            enqueue()
    r = stack.cli("enqueue", "-A", "tests.middleware_app", mw.work.name, "--args", "[1, 2]")
    assert r.returncode == 2 and "too many positional arguments" in r.stderr, r.stderr
    assert mw.recorded() == []
    with pytest.raises(PayloadTooLarge, match="arguments and headers"):  # its stamp takes the last bytes
        mw.work.delay("y" * (app.settings.max_payload - len('[""]{}')))
    ok = mw.work.delay("ok")
    hooks = mw.recorded()
    assert [h[0] for h in hooks] == ["before_enqueue"] * 2 and hooks[1][2] == ok.id


def test_a_workflow_runs_its_before_enqueue_hooks_once_every_step_is_checked(app, mw):
    """A workflow is written whole or not at all, so its hooks run once every job of it is
    checked: one refused for a step's (a callback's, a member's) arguments, or for a parent
    that does not exist, runs none, where the steps before it had run theirs (a hook that
    counts enqueues counted jobs never enqueued). A valid one runs each job's hook once,
    and the headers it sets reach every job, callbacks too."""
    work, name = mw.work, mw.work.name  # work(key): a step fed its parent's result takes no other

    def aio(call):
        """call(client), awaited with an AsyncClient of its own loop."""
        async def main():
            client = AsyncClient(mw.app)
            try:
                return await call(client)
            finally:
                await client.close()
        return asyncio.run(main())

    refusals = [
        (lambda: chain(work.s("a"), work.s("b")).delay(), BadArguments),
        (lambda: group(work.s("a"), work.s()).delay(), BadArguments),
        (lambda: chord([work.s("a"), work.s("b")], work.s("x")).delay(), BadArguments),
        (lambda: work.apply_async(["a"], on_success=work.si("x"), on_failure=work.s("x")), BadArguments),
        (lambda: work.apply_async(["a"], depends_on=["no-such-job"]), JobNotFound),
        (lambda: mw.app.enqueue_many([{"task": name, "args": ["a"], "on_success": {"task": name, "args": ["x"]}}]),
         BadArguments),
        (lambda: aio(lambda c: c.apply(chain(work.s("a"), work.si("b"), work.s("c")))), BadArguments),
        (lambda: aio(lambda c: c.enqueue(name, ["a"], on_success=work.s("x"))), BadArguments),
    ]
    for n, (enqueue, refused) in enumerate(refusals):
        with pytest.raises(refused):
            enqueue()
        assert mw.recorded() == [], n
    assert app.redis.keys(f"{app.settings.prefix}:*job:*") == []  # nothing written
    last = chain(work.s("c1"), work.si("c2"), work.si("c3")).delay()
    members = group(work.s("g1"), work.s("g2")).delay()
    callback = chord([work.s("m1"), work.s("m2")], work.si("cb")).delay()
    linked = work.apply_async(["l"], on_success=work.si("ok"), on_failure=work.si("ko"), depends_on=[last])
    [many] = mw.app.enqueue_many([{"task": name, "args": ["e"], "on_success": {"task": name, "args": ["s"],
                                                                              "immutable": True}}])
    in_aio = aio(lambda c: c.apply(chain(work.s("a1"), work.si("a2"))))
    ids = [h[2] for h in mw.recorded() if h[0] == "before_enqueue"]
    assert len(ids) == len(set(ids)) == 3 + 2 + 3 + 3 + 2 + 2, ids  # each job's hook once, callbacks included
    assert {last.id, *members.ids, callback.id, linked.id, many.id, in_aio} <= set(ids)
    stamp = {"stamp": f"enqueued by {os.getpid()}"}
    assert [app.job(i).to_dict()["headers"] for i in ids] == [stamp] * len(ids)


def test_a_hook_that_raises_in_enqueue_many_leaves_the_producers_link_in_step(app):
    """enqueue_many sends a chunk and builds the next while Redis runs it; a hook raising
    an exception of its own there (not one enqueue_many reports, with how many went) left
    the chunk's answers unread on the thread's link: each lone enqueue after it read the
    answer before its own — a job written reported refused, one refused reported written."""
    from taskrunner.ops import queue

    producer = TaskRunner("hooks-many", redis_url=app.settings.redis_url, prefix=app.settings.prefix)

    class Refuse:
        def before_enqueue(self, job):
            if job.args == [1200]:
                raise RuntimeError("refused by a hook")

    producer.add_middleware(Refuse())
    queue.create(producer, "shut")
    queue.close(producer, "shut")
    with pytest.raises(RuntimeError, match="refused by a hook"):
        producer.enqueue_many([{"task": "hooks.noop", "args": [i]} for i in range(1500)])
    a = producer.enqueue("hooks.noop", args=[-1])
    assert a.created and a.refresh().state == "pending"
    with pytest.raises(QueueClosed):
        producer.enqueue("hooks.noop", args=[-2], queue="shut")
    b = producer.enqueue("hooks.noop", args=[-3])
    assert b.created and b.refresh().state == "pending"
    assert producer.redis.llen(producer.keys.q("default") + "pending") == 1002  # the first chunk, a and b


def test_a_hooks_exception_that_takes_other_arguments_reaches_enqueue_many_s_caller(app):
    """enqueue_many says which job failed by making the exception again with a message;
    one whose type takes other arguments (json.JSONDecodeError, from a hook) is raised as
    it was, not replaced by a TypeError about its constructor."""
    producer = TaskRunner("hooks-json", redis_url=app.settings.redis_url, prefix=app.settings.prefix)

    class Parse:
        def before_enqueue(self, job):
            json.loads("{")

    producer.add_middleware(Parse())
    with pytest.raises(json.JSONDecodeError):
        producer.enqueue_many([{"task": "hooks.noop"}])


def test_eager_mode_calls_the_same_hooks_in_process():
    eager = TaskRunner("eager-hooks", eager=True)
    calls = []

    class Trace:
        def before_enqueue(self, job):
            job.headers["by"] = "trace"
            calls.append(("before_enqueue", job.task))

        def before_run(self, job):
            calls.append(("before_run", job.attempt, job.headers["by"]))

        def after_run(self, job, outcome):
            calls.append(("after_run", job.attempt, outcome.kind))

        def on_retry(self, job, exc):
            calls.append(("on_retry", job.attempt, type(exc).__name__))

        def on_failure(self, job, exc):
            calls.append(("on_failure", job.attempt, type(exc).__name__))

    eager.add_middleware(Trace())

    @eager.task(name="flaky", retries=1)
    def flaky():
        raise KeyError("k")

    @eager.task(name="asks", max_retries=1)
    def asks():
        calls.append(("left", current_job().retries_left))
        raise Retry()

    assert eager.enqueue("asks").refresh().data["error_type"] == "MaxRetriesExceeded"
    assert calls[1:] == [("before_run", 1, "trace"), ("left", 0), ("on_retry", 1, "Retry"), ("after_run", 1, "requeue"),
                         ("before_run", 2, "trace"), ("left", 0), ("on_failure", 2, "Retry"),
                         ("after_run", 2, "requeue")]
    calls.clear()
    assert eager.enqueue("flaky").state == "failed"
    assert calls == [("before_enqueue", "flaky"), ("before_run", 1, "trace"), ("on_retry", 1, "KeyError"),
                     ("after_run", 1, "error"), ("before_run", 2, "trace"), ("on_failure", 2, "KeyError"),
                     ("after_run", 2, "error")]
    calls.clear()
    for refused in (lambda: chain(flaky.si(), asks.s()).delay(),  # asks() takes no parent's result
                    lambda: flaky.apply_async(on_success=asks.s())):
        with pytest.raises(BadArguments):
            refused()
    with pytest.raises(TypeError, match="depends_on"):  # ids, where eager mode takes Job objects
        flaky.apply_async(depends_on=["some-id"])
    assert calls == []  # a workflow refused for a step's arguments runs no hook, in eager mode too
    with pytest.raises(TypeError, match="defines none of the middleware hooks"):
        eager.add_middleware(object())


def test_a_redis_that_cannot_be_read_to_tell_retry_from_failure_costs_no_child(tmp_path, caplog):
    """on_retry vs on_failure reads the job's record; with Redis unreachable at that moment
    (here: nothing listens on the socket) that read used to raise out of the child's run,
    killing the child with the job's outcome unsent. Now neither hook runs (it is logged)
    and the outcome stands."""
    down = TaskRunner("down", redis_url=f"unix://{tmp_path}/nobody.sock")
    calls = []

    class Trace:
        def on_retry(self, job, exc):
            calls.append("on_retry")

        def on_failure(self, job, exc):
            calls.append("on_failure")

    down.add_middleware(Trace())

    @down.task(name="t.boom", retries=1)
    def boom():
        raise ValueError("no")

    link = child.Link(os.open(os.devnull, os.O_WRONLY), None, down)
    message = child.message("j1", "1", "t.boom", "default", "300", "[]", "{}", "", "")
    outcome = child.run(down, message, link)
    assert (outcome.kind, outcome.error_type) == ("error", "ValueError") and calls == []
    assert "could not read job j1's record" in caplog.text
    [r] = [r for r in caplog.records if "could not read job" in r.getMessage()]
    assert (r.job_id, r.task, r.queue, r.attempt) == ("j1", "t.boom", "default", 1)
