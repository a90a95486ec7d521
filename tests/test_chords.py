"""Groups and chords with real workers: results in order, one enqueue call, the callback made
pending once by the last member's finish, a failed member canceling it or (continue) giving
it None, members on several queues, a SIGKILLed worker in the middle, and eager mode."""

from __future__ import annotations

import json
import os
import signal

import pytest

from taskrunner import JobFailed, TaskRunner, chain, chord, group
from taskrunner.ops.history import read
from tests import apps
from tests.conftest import wait_for
from tests.test_failures import ledger, started_pid


def test_a_group_runs_side_by_side_and_gives_results_in_order(app, stack):
    g = group(apps.add.s(i, i) for i in range(10))
    handle = g.delay()
    assert len(handle.ids) == 10 and app.redis.llen(app.keys.q("default") + "pending") == 10
    stack.worker()
    assert handle.wait(timeout=30) == [2 * i for i in range(10)]
    assert group(apps.add.s(1, 1), [apps.mul.s(2, 3)]).delay().wait(30) == [2, 6]
    with pytest.raises(JobFailed, match="ValueError: no"):
        group(apps.add.s(1, 1), apps.boom.s("no")).delay().wait(30)


def test_a_chord_gives_its_callback_every_result_in_order(app, stack):
    c = chord(group(apps.add.s(i, i) for i in range(10)), apps.tsum.s())
    handle = c.delay()
    d = app.redis.hgetall(app.keys.job("default", handle.id))
    assert d["state"] == "waiting" and d["waiting_on"] == "10" and d["takes"] == "results"
    stack.worker()
    assert handle.wait(timeout=30) == 90
    assert app.redis.hget(app.keys.job("default", handle.id), "args") == "[[0,2,4,6,8,10,12,14,16,18]]"
    # members on another queue; an immutable callback gets no results
    stack.worker("-Q", "one", concurrency=1)
    assert chord([apps.add.s(1, 1).set(queue="one"), apps.add.s(2, 2)], apps.tsum.s()).delay().wait(30) == 6
    fixed = chord([apps.add.s(1, 1).set(queue="one"), apps.add.s(2, 2)], apps.mul.si(3, 4)).delay()
    assert fixed.wait(30) == 12 and app.redis.hget(app.keys.job("default", fixed.id), "args") == "[3,4]"


def test_a_failed_member_cancels_the_callback_unless_it_continues(app, stack):
    stack.worker()
    handle = chord([apps.add.s(1, 1), apps.boom.s("no"), apps.add.s(2, 2)], apps.tsum.s()).delay()
    with pytest.raises(JobFailed, match=r"canceled: Canceled: step \S+ \(task tests.apps.boom\) failed"):
        handle.wait(30)
    go_on = chord([apps.add.s(1, 1), apps.boom.s("no"), apps.add.s(2, 2)], apps.tsum.s(),
                  on_member_failure="continue").delay()
    assert go_on.wait(30) == 6
    assert app.redis.hget(app.keys.job("default", go_on.id), "args") == "[[2,null,4]]"
    with pytest.raises(ValueError, match="on_member_failure"):
        chord([apps.add.s(1, 1)], apps.tsum.s(), on_member_failure="maybe")


def test_a_chord_survives_a_sigkilled_worker_and_its_callback_runs_once(app, stack):
    """Members held by a worker that is SIGKILLed run again elsewhere; the callback is made
    pending once (by the last member's finish) and runs once."""
    stack.dispatcher()
    w1 = stack.worker("-Q", "slow", concurrency=2)
    members = [apps.hold.s(f"m{i}", 30).set(queue="slow") for i in range(2)] + [apps.add.s(i, 1) for i in range(5)]
    handle = chord(members, apps.counted.si(0, "callback")).delay()
    for i in range(2):
        started_pid(app, f"m{i}")
    os.killpg(w1.pid, signal.SIGKILL)
    w1.wait()
    stack.worker("-Q", "slow,default", concurrency=3)
    for i in range(2):
        wait_for(lambda i=i: ledger(app, f"m{i}") >= 2, what=f"m{i} to run again")
        app.redis.set(f"{app.settings.prefix}:release:m{i}", 1)
    handle.wait(timeout=60)
    assert ledger(app, "callback") == 1
    entries = [f for _, f in read(app.redis.xrange(app.keys.q("default") + "history")) if f["id"] == handle.id]
    assert [e["state"] for e in entries] == ["completed"]


def test_a_member_with_a_short_result_ttl_keeps_its_result_for_the_callback(app, stack):
    """A member whose own result_ttl (1 s) is shorter than the chord takes: its record, which
    the callback's join reads its result from when the last member ends, is kept the result
    TTL setting instead (the callback was given null for it)."""
    stack.worker(concurrency=2)
    handle = chord([apps.forgetful.s(5), apps.hold.s("last", 60)], apps.echo.s()).delay()
    p = app.keys.q("default")
    first = app.redis.hget(p + "job:" + handle.id, "parents").split()[1]
    wait_for(lambda: app.redis.hget(p + "job:" + first, "state") == "completed", what="the quick member to end")
    assert app.redis.ttl(p + "job:" + first) > 60  # the setting's, not its own 1 s
    app.redis.set(f"{app.settings.prefix}:release:last", 1)
    assert handle.wait(timeout=60) == [5, "released"]


def test_status_of_a_chord_callback_names_its_first_parents_and_how_many_more(app, stack):
    """`taskrunner status` of a callback of 8 members names 5 of them and points to
    `workflow` for the rest (a chord of 1,000 printed a 40 KB line); --json has them all."""
    handle = chord([apps.add.s(i, 1) for i in range(8)], apps.echo.s()).delay()  # no worker: it waits
    out = stack.cli("status", handle.id, check=True).stdout
    [line] = [x for x in out.splitlines() if x.strip().startswith("parents")]
    assert line.count("(default)") == 5 and line.endswith(f"(+3: taskrunner workflow {handle.id})"), line
    assert len(json.loads(stack.cli("status", handle.id, "--json", check=True).stdout)["parents"]) == 8


def test_eager_groups_and_chords(redis_server):
    eager = TaskRunner("eager", eager=True)
    add = eager.task(apps.add.fn, name="add")
    boom = eager.task(apps.boom.fn, name="boom")
    tsum = eager.task(apps.tsum.fn, name="tsum")
    assert group(add.s(i, i) for i in range(4)).delay().wait() == [0, 2, 4, 6]
    assert chord(group(add.s(i, i) for i in range(4)), tsum.s()).delay().wait() == 12
    with pytest.raises(JobFailed, match="canceled"):
        chord([add.s(1, 1), boom.s("no")], tsum.s()).delay().wait()
    assert chord([add.s(1, 1), boom.s("no")], tsum.s(), on_member_failure="continue").delay().wait() == 2
    assert chain(add.s(1, 1), add.s(1)).delay().wait() == 3


def test_callbacks_on_success_and_on_failure_run_once_and_the_other_is_canceled(app, stack):
    stack.worker()
    ok = apps.add.apply_async((1, 2), on_success=apps.mul.s(10), on_failure=apps.record.si("never"))
    assert ok.wait(30) == 3
    p = app.keys.q("default")
    [success, failure] = app.redis.hget(app.keys.job("default", ok.id), "children").split()[1::2]
    wait_for(lambda: app.redis.hget(p + f"job:{success}", "state") == "completed", what="on_success")
    assert app.redis.hget(p + f"job:{success}", "result") == "30"
    assert app.redis.hmget(p + f"job:{failure}", "state", "error") == [
        "canceled", f"not run: step {ok.id} (task tests.apps.add) completed (an on_failure callback)"]
    bad = apps.boom.apply_async(("no",), on_success=apps.record.si("never"), on_failure=apps.echo.s())
    [success, failure] = app.redis.hget(app.keys.job("default", bad.id), "children").split()[1::2]
    wait_for(lambda: app.redis.hget(p + f"job:{failure}", "state") == "completed", what="on_failure")
    got = json.loads(app.redis.hget(p + f"job:{failure}", "result"))
    assert got == {"id": bad.id, "task": "tests.apps.boom", "state": "failed", "error_type": "ValueError",
                   "error": "no"}
    assert app.redis.hget(p + f"job:{success}", "state") == "canceled"
    assert ledger(app, "never") == 0
    # eager mode: the one that applies runs
    eager = TaskRunner("eager", eager=True)
    add, echo = eager.task(apps.add.fn, name="add"), eager.task(apps.echo.fn, name="echo")
    boom = eager.task(apps.boom.fn, name="boom")
    assert add.apply_async((1, 1), on_success=echo.s()).wait() == 2
    boom.apply_async(("x",), on_failure=echo.s())
