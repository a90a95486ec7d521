"""An operator's retry of a failed workflow step brings back the steps its failure canceled
(docs/PROTOCOL.md, Workflows; retry.lua): the rest of a chain or a chord runs, with real
workers, whether retried from the CLI, the dashboard or the API."""

from __future__ import annotations

import pytest

from taskrunner import JobFailed, TaskRunner, chord
from taskrunner.ops import history, queue
from taskrunner.protocol import scripts
from tests import apps
from tests.conftest import wait_for
from tests.test_failures import ledger


def record(app: TaskRunner, queue: str, job_id: str) -> dict[str, str]:
    return app.redis.hgetall(app.keys.job(queue, job_id))


def parent_of(app: TaskRunner, queue: str, job_id: str) -> tuple[str, str]:
    q, i = record(app, queue, job_id)["parents"].split()
    return q, i


def fix(app: TaskRunner, key: str) -> None:
    app.redis.set(f"{app.settings.prefix}:fixed:{key}", 1)


def test_retrying_a_failed_middle_step_runs_the_rest_of_the_chain(app, stack):
    stack.worker()
    handle = (apps.add.s(1, 2) | apps.fails_until_fixed.s("mid") | apps.add.s(4) | apps.mul.s(10)).delay()
    with pytest.raises(JobFailed) as e:
        handle.wait(30)
    _, third = parent_of(app, "default", handle.id)
    _, mid = parent_of(app, "default", third)
    assert e.value.state == "canceled" and f"step {mid} (task tests.apps.fails_until_fixed) failed" in str(e.value)
    fix(app, "mid")
    r = stack.cli("retry", mid, check=True)
    assert r.stdout.strip() == f"{mid}: queued again"
    assert handle.wait(30) == 70  # (1 + 2), passed on, + 4, * 10
    assert ledger(app, "mid") == 2
    for step in (third, handle.id):
        d = record(app, "default", step)
        assert (d["state"], d["attempts"]) == ("completed", "1")
        assert "canceled_by" not in d and "error" not in d
        assert [v for k, v in d.items() if k.startswith("action:")][0].startswith(
            f"brought back: step {mid} retried by ")
    assert app.redis.zcard(app.keys.q("default") + "canceled") == 0
    assert app.redis.zcard(app.keys.q("default") + "waiting") == 0
    states = [f["state"] for _, f in history.read(app.redis.xrange(app.keys.q("default") + "history"))]
    assert sorted(states) == ["canceled"] * 2 + ["completed"] * 4 + ["failed"]


def test_retrying_a_failed_chord_member_runs_the_callback_with_every_result(app, stack):
    from dashboard import create_app

    stack.worker()
    handle = chord([apps.add.s(1, 1), apps.fails_until_fixed.si(5, "member"), apps.add.s(3, 3)], apps.tsum.s()).delay()
    with pytest.raises(JobFailed):
        handle.wait(30)
    member = record(app, "default", handle.id)["parents"].split()[3]
    fix(app, "member")
    web = create_app(app, password="", token="tok").test_client()  # the dashboard's API, as an operator's tool
    r = web.post(f"/api/jobs/{member}/retry", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200, r.get_json()
    assert handle.wait(30) == 13  # 2 + 5 + 6


def test_a_step_that_counted_a_failed_member_as_done_counts_it_again(app, stack):
    """on_member_failure="continue": the callback counted the failed member as done; once
    retried, it waits for it again (else it would fire before the other members ended)."""
    stack.worker()
    handle = chord([apps.fails_until_fixed.si(5, "cx"), apps.gate.si(7, "g")], apps.tsum.s(),
                   on_member_failure="continue").delay()
    failed = record(app, "default", handle.id)["parents"].split()[1]
    wait_for(lambda: record(app, "default", failed).get("state") == "failed", what="the member failed")
    assert record(app, "default", handle.id)["waiting_on"] == "1"
    fix(app, "cx")
    queue.pause(app, "default")  # else the worker may run it before the count is read
    assert app.job(failed).retry("tester")
    assert record(app, "default", handle.id)["waiting_on"] == "2"
    queue.resume(app, "default")
    wait_for(lambda: record(app, "default", failed).get("state") == "completed", what="the member retried")
    assert record(app, "default", handle.id)["state"] == "waiting"
    app.redis.set(f"{app.settings.prefix}:release:g", 1)
    assert handle.wait(30) == 12


def test_a_step_with_another_failed_parent_stays_canceled_naming_it(app, stack):
    a = apps.fails_until_fixed.apply_async((1, "a"))
    b = apps.fails_until_fixed.apply_async((2, "b"), queue="other")
    after = apps.add.apply_async((3, 4), depends_on=[a, b])
    then = apps.mul.apply_async((2, 5), depends_on=[after])
    stack.worker("-Q", "default,other")
    with pytest.raises(JobFailed):
        then.wait(30)
    wait_for(lambda: a.state == "failed" and b.state == "failed", what="both failed")
    first, second = (a, b) if record(app, "default", after.id)["canceled_by"] == f"default {a.id}" else (b, a)
    fix(app, "a")
    fix(app, "b")
    assert first.retry("tester")
    for step in (after, then):  # still canceled, now by the other parent (a retry of it brings them back)
        d = record(app, "default", step.id)
        assert (d["state"], d["canceled_by"]) == ("canceled", f"{second.queue} {second.id}")
        assert f"step {second.id} (task tests.apps.fails_until_fixed) failed: RuntimeError" in d["error"]
    wait_for(lambda: first.state == "completed", what="the first retried")
    queue.pause(app, second.queue)  # else the worker may run it before the count is read
    assert second.retry("tester")
    assert record(app, "default", after.id)["waiting_on"] == "1"
    queue.resume(app, second.queue)
    assert then.wait(30) == 10 and after.wait(30) == 7


def test_a_waiting_step_killed_then_retried_waits_for_its_parent_again(app, stack):
    handle = (apps.hold.si("p") | apps.add.s("!")).delay()
    assert handle.kill("tester") == "killed"
    r = stack.cli("retry", handle.id, check=True)
    assert r.stdout == f"{handle.id}: waiting for its parents again\n"
    d = record(app, "default", handle.id)
    assert (d["state"], d["waiting_on"]) == ("waiting", "1")  # not pending: its parent has not completed
    stack.worker()
    app.redis.set(f"{app.settings.prefix}:release:p", 1)
    assert handle.wait(30) == "released!"  # its parent's result first in its args, as a join gives it
    # killed while it waited for a parent that then failed: it could never run
    queue.pause(app, "default")  # else its parent may fail (and cancel it) before the kill
    bad = (apps.fails_until_fixed.si(1, "k") | apps.add.s(1)).delay()
    bad.kill("tester")
    queue.resume(app, "default")
    wait_for(lambda: record(app, "default", parent_of(app, "default", bad.id)[1]).get("state") == "failed",
             what="its parent failed")
    r = stack.cli("retry", bad.id)
    parent = parent_of(app, "default", bad.id)[1]
    assert (r.returncode, r.stderr) == (1, f"Error: job {bad.id} waits for step {parent}, which is failed: it could "
                                           "never run (retry that step)\n")
    assert bad.refresh().state == "killed"


def test_without_leave_to_touch_other_queues_steps_there_stay_canceled(app, stack):
    """As on a Redis Cluster (retry.lua without ARGV[3]): only the steps of the retried job's
    queue come back."""
    stack.worker("-Q", "default,other")
    handle = (apps.fails_until_fixed.si(1, "x") | apps.add.s(1) | apps.add.s(2).set(queue="other")).delay()
    with pytest.raises(JobFailed):
        handle.wait(30)
    _, middle = parent_of(app, "other", handle.id)
    _, first = parent_of(app, "default", middle)
    queue.pause(app, "default")  # else the worker may run the retried step, failing it again, before the read
    assert scripts.RETRY(app.redis, [app.keys.q("default")], [first, "tester"]) == "failed"
    assert record(app, "default", middle)["state"] == "waiting"
    assert record(app, "other", handle.id)["state"] == "canceled"
