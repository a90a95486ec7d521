"""A job's arguments checked against its task's signature where it is enqueued
(taskrunner/client/arguments.py): `add.delay(1)` for `def add(a, b)` raises BadArguments in
the caller, one line naming the task and what is wrong, and enqueues nothing, instead of
failing later in a worker. Correct calls still enqueue, workflow steps given their parent's
value first included; a producer without the app checks against the workers' declaration."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re

import pytest

from taskrunner import BadArguments, JobFailed, TaskRunner
from taskrunner.client import arguments, declarations
from taskrunner.client.canvas import chord, group
from tests import apps
from tests.conftest import wait_for


def nothing_enqueued(app: TaskRunner) -> bool:
    return not app.redis.exists(app.keys.q("default") + "pending")


@pytest.mark.parametrize("call, words", [
    (lambda: apps.add.delay(1), "missing a required argument: 'b'"),
    (lambda: apps.add.delay(1, 2, 3), "too many positional arguments"),
    (lambda: apps.add.apply_async((1, 2), {"c": 3}), "got an unexpected keyword argument 'c'"),
    (lambda: apps.app.enqueue("tests.apps.add", [1]), "missing a required argument: 'b'"),
    (lambda: apps.app.enqueue_many([{"task": "tests.apps.add", "args": [1, 2]},
                                    {"task": "tests.apps.add", "kwargs": {"a": 1}}]),
     "job 2: tests.apps.add(a, b): missing a required argument: 'b'"),
    (lambda: (apps.add.s(1, 2) | apps.mul.s(3, 4)).delay(), "tests.apps.mul(a, b): too many positional arguments"),
    (lambda: apps.add.apply_async((1, 2), on_success=apps.mul.s()), "missing a required argument: 'b'"),
    (lambda: chord(group(apps.add.s(i, i) for i in range(3)), apps.mul.s(1, 2)).delay(),
     "tests.apps.mul(a, b): too many positional arguments"),
])
def test_arguments_that_do_not_fit_are_refused_at_enqueue(app, call, words):
    with pytest.raises(BadArguments) as e:
        call()
    assert words in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, TypeError)  # as calling the function would raise
    assert nothing_enqueued(app) and not app.redis.exists(app.keys.q("default") + "waiting")


def test_calls_that_fit_still_enqueue(app):
    jobs = [apps.add.delay(1, 2), apps.add.apply_async((1,), {"b": 2}), apps.hold.delay("k"),
            app.enqueue("tests.apps.hold", ["k"], {"seconds": 1})]
    # Steps and callbacks given a value first: counted as their first argument.
    jobs.append((apps.add.s(1, 2) | apps.mul.s(10) | apps.echo.s() | apps.add.si(0, 0)).delay())
    jobs.append(apps.add.apply_async((1, 2), on_success=apps.echo.s(), on_failure=apps.echo.s()))
    jobs.append(apps.add.apply_async((1, 2), on_success=apps.add.si(1, 1), on_failure=apps.record.si("k")))
    jobs.append(chord(group(apps.add.s(i, i) for i in range(3)), apps.tsum.s()).delay())
    jobs.append(apps.add.s(1, 2).delay())  # a signature alone is not given anything
    assert all(j.created for j in jobs)


def make_eager() -> TaskRunner:
    """An eager app (the task runs in enqueue) with tasks of every shape the check reads."""
    app = TaskRunner("shapes", eager=True, redis_url="redis://127.0.0.1:1/0")

    @app.task(name="star")
    def star(first, *rest, scale=1, **options):
        return [first, list(rest), scale, options]

    @app.task(name="aio")
    async def aio(x, y=2):
        await asyncio.sleep(0)
        return x + y

    class Doubler:
        def __call__(self, x):
            return 2 * x

    app.task(Doubler(), name="doubler")

    def signed(fn):  # a decorator that says its signature: checked by it
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        wrapper.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        return wrapper

    @app.task(name="wrapped")
    @signed
    def wrapped(a, b):
        return a - b

    def injecting(fn):  # (review) a decorator that adds an argument: its wrapper's signature binds
        @functools.wraps(fn)
        def wrapper(*args):
            return fn("db", *args)
        return wrapper

    @app.task(name="injected")
    @injecting
    def injected(db, x):
        return f"{db}:{x}"

    @app.task(name="opted_out", check_args=False)
    def opted_out(x):
        return x

    return app


def test_every_shape_of_task_is_checked_and_runs(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    app = make_eager()
    t = app.tasks
    assert t["star"].delay(1).wait() == [1, [], 1, {}]
    assert t["star"].delay(1, 2, 3, scale=2, x=4).wait() == [1, [2, 3], 2, {"x": 4}]
    assert t["aio"].delay(1).wait() == 3 and t["aio"].delay(1, y=5).wait() == 6
    assert t["doubler"].delay(4).wait() == 8
    assert t["wrapped"].delay(5, 3).wait() == 2
    assert t["injected"].delay(7).wait() == "db:7"  # was refused: "missing a required argument: 'x'"
    with pytest.raises(JobFailed, match="BadArguments"):
        t["opted_out"].delay(1, 2).wait()  # check_args=False: not checked here, fails where it runs
    assert (t["aio"].s(1) | t["doubler"].s() | t["star"].s(0, scale=3)).delay().wait() == [6, [0], 3, {}]
    for call, words in [(lambda: t["star"].delay(), "missing a required argument: 'first'"),
                        (lambda: t["aio"].delay(1, 2, 3), "too many positional arguments"),
                        (lambda: t["doubler"].delay(x=1, y=2), "unexpected keyword argument 'y'"),
                        (lambda: t["wrapped"].delay(1), r"wrapped\(a, b\): missing a required argument: 'b'"),
                        (lambda: (t["aio"].s(1) | t["doubler"].s(2)).delay(), "too many positional")]:
        with pytest.raises(BadArguments, match=words):
            call()


def test_enqueue_many_says_how_many_jobs_before_the_bad_one_were_enqueued(app):
    """(Review.) A long enqueue_many sends its jobs in chunks: the chunks before a job that is
    refused are enqueued, and the error said nothing of it (a run again, fixed, enqueued them
    twice). The count it gives is what Redis holds."""
    jobs = [{"task": "tests.apps.add", "args": [i, i]} for i in range(2500)]
    jobs[2200] = {"task": "tests.apps.add", "args": [1]}
    with pytest.raises(BadArguments) as e:
        app.enqueue_many(jobs)
    m = re.search(r"^job 2201: .*missing a required argument: 'b' "
                  r"\((\d+) of the 2200 before it enqueued, none after\)$", str(e.value))
    assert m, str(e.value)
    assert int(m.group(1)) == app.redis.llen(app.keys.q("default") + "pending")


def test_eager_mode_refuses_a_callback_that_does_not_fit_before_the_job_runs(monkeypatch):
    """(Review.) In eager mode callbacks were not checked at enqueue: a bad on_failure was
    accepted (the job completed), a bad on_success refused only after the job had run."""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    app = make_eager()
    ran: list[int] = []

    @app.task(name="note")
    def note(x):
        ran.append(x)
        return x

    doubler = app.tasks["doubler"]
    for links in ({"on_failure": doubler.s(9, 9)}, {"on_success": doubler.s(9)}):
        with pytest.raises(BadArguments, match="too many positional arguments"):
            note.apply_async((1,), **links)
        with pytest.raises(BadArguments, match="too many positional arguments"):
            app.enqueue_many([{"task": "note", "args": [2], **links}])
    assert ran == []
    assert note.apply_async((3,), on_success=doubler.s()).wait() == 3 and ran == [3]


def test_a_task_declared_again_from_a_task_keeps_its_own_settings(monkeypatch):
    """(Review.) Task.__init__ copied the wrapped Task's attributes over its own
    (functools.update_wrapper after them): check_args=False, the name and the app were lost."""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    a, b = make_eager(), TaskRunner("other", eager=True, redis_url="redis://127.0.0.1:1/0")
    outer = b.task(a.tasks["doubler"], name="outer", check_args=False)
    assert (outer.name, outer.app, outer.check_args, outer.shape) == ("outer", b, False, None)


def test_a_schedule_with_arguments_that_do_not_fit_is_refused_where_it_is_declared(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    app = make_eager()
    with pytest.raises(BadArguments, match="missing a required argument: 'b'"):
        app.periodic("* * * * *", name="sub", args=[1])(app.tasks["wrapped"])
    with pytest.raises(BadArguments, match="missing a required argument: 'x'"):
        app.periodic("* * * * *", name="sub2")(app.tasks["doubler"])


def test_the_declaration_carries_the_parameters(app):
    """docs/PROTOCOL.md, Task declarations: `params`, as Python writes the signature without
    annotations nor defaults; none for a task that opts out."""
    def f(a, /, b, c=1, *, d, **kw): ...

    def g(*args, z=2): ...

    for fn, words in [(f, ["a", "/", "b", "c=", "*", "d", "**kw"]), (g, ["*args", "z="]), (lambda: 0, []),
                      (lambda a, b, /: 0, ["a", "b", "/"])]:
        shape = arguments.shape_of(fn)
        assert shape is not None and arguments.params(shape.signature) == words
        back = arguments.from_declaration({"params": words})
        assert back is not None and arguments.params(back.signature) == words
    assert declarations.declaration(app, apps.add, "w", 0.0)["params"] == ["a", "b"]
    assert declarations.declaration(app, apps.hold, "w", 0.0)["params"] == ["key", "seconds="]
    opted = TaskRunner("opted").task(lambda x: x, name="opted", check_args=False)
    assert "params" not in declarations.declaration(app, opted, "w", 0.0)
    for bad in [None, {}, {"params": "a"}, {"params": [1]}, {"params": ["a", "a"]}, {"params": ["a=", "b"]},
                {"params": ["no such"]}, {"params": [""]}, {"params": ["a", "**"]}]:
        assert arguments.from_declaration(bad) is None  # not checked


def test_a_producer_without_the_app_checks_against_the_declaration(app, stack):
    """The CLI without -A and app.enqueue by name look the declaration up anyway (the
    task's queue): its params then refuse arguments that do not fit, at no Redis cost."""
    stack.worker(name="declarer")
    wait_for(lambda: app.redis.zscore(app.keys.workers, "declarer"), what="the worker's first heartbeat")
    r = stack.cli("enqueue", "tests.apps.add", "--args", "[1]")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "Error: tests.apps.add(a, b): missing a required argument: 'b'\n"
    bare = TaskRunner("bare", redis_url=app.settings.redis_url, prefix=app.settings.prefix)
    with pytest.raises(BadArguments, match="too many positional arguments"):
        bare.enqueue("tests.apps.add", [1, 2, 3])
    assert nothing_enqueued(app)
    assert bare.enqueue("tests.apps.add", [1, 2]).wait(30) == 3
    # A declaration without params (an older worker's): not checked.
    old = {k: v for k, v in json.loads(app.redis.hget(app.keys.tasks, "tests.apps.mul")).items() if k != "params"}
    app.redis.hset(app.keys.tasks, "tests.apps.mul", json.dumps(old))
    r = stack.cli("enqueue", "tests.apps.mul", "--args", "[1]", check=True)
    assert r.stdout.strip()


def test_cli_with_the_app_refuses_arguments_that_do_not_fit(app, stack):
    r = stack.cli("enqueue", "-A", "tests.apps", "tests.apps.add", "--args", "[1, 2]", "--kwargs", '{"c": 3}')
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "Error: tests.apps.add(a, b): got an unexpected keyword argument 'c'\n"
    r = stack.cli("enqueue", "-A", "tests.apps", "tests.apps.add", "--args", "[1, 2]",
                  "--on-success", '{"task": "tests.apps.mul", "args": [1, 2]}')
    assert r.returncode == 2 and "tests.apps.mul(a, b): too many positional arguments" in r.stderr
    r = stack.cli("schedule", "add", "-A", "tests.apps", "nightly", "tests.apps.add", "--cron", "0 3 * * *",
                  "--args", "[1, 2, 3]")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "too many positional arguments" in r.stderr
    assert nothing_enqueued(app)
    r = stack.cli("enqueue", "-A", "tests.apps", "tests.apps.add", "--args", "[1]", "--kwargs", '{"b": 2}',
                  "--on-success", "tests.apps.echo", check=True)
    assert app.job(r.stdout.strip()).state == "pending"


def test_counting_and_looking_up_agree_with_binding():
    """Shape.check passes a job that plainly fits by counting its positional arguments and
    looking its keywords up, not by binding them: the same verdict as Signature.bind, for
    every kind of parameter and mix of arguments."""
    def plain(a, b): ...

    def defaults(a, b=1, c=2): ...

    def star(a, *rest): ...

    def kwonly(a, *, k): ...

    def kwdefault(a, *, k=1): ...

    def positional(a, /, b=1): ...

    def catchall(a, /, **kw): ...

    def anything(*args, **kwargs): ...

    keywords = [{}, {"a": 1}, {"b": 1}, {"k": 1}, {"a": 1, "b": 2}, {"b": 1, "k": 2}, {"c": 1, "k": 1}, {"z": 1},
                {"rest": 1}, {"kw": 1}]
    for fn in (plain, defaults, star, kwonly, kwdefault, positional, catchall, anything, lambda: 0):
        shape = arguments.shape_of(fn)
        assert shape is not None
        for n in range(4):
            for kwargs in keywords:
                for fed in (False, True):
                    try:
                        shape.signature.bind(*range(n + fed), **kwargs)
                        fits = True
                    except TypeError:
                        fits = False
                    try:
                        shape.check("t", list(range(n)), kwargs, fed)
                        assert fits, (fn, n, kwargs, fed)
                    except BadArguments:
                        assert not fits, (fn, n, kwargs, fed)
