"""Workflows with real workers (docs/PROTOCOL.md, Workflows): chains and `|`, `.si`,
depends_on across queues, failure canceling the steps after it, a chain that survives a
SIGKILLed worker with each step made pending once, the enqueue script refusing bad edges,
and eager mode."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
import redis

from taskrunner import JobFailed, TaskRunner, chain
from taskrunner.client import steps
from taskrunner.ops import history as hist
from taskrunner.ops import listing
from taskrunner.protocol import scripts
from tests import apps
from tests.conftest import wait_for
from tests.test_declarations import Raw
from tests.test_failures import ledger, started_pid


def record(app: TaskRunner, queue: str, job_id: str) -> dict[str, str]:
    return app.redis.hgetall(app.keys.job(queue, job_id))


def test_a_chain_passes_each_result_on_in_order(app, stack):
    stack.worker()
    handle = chain(apps.add.s(1, 2), apps.mul.s(10), apps.add.s(5)).delay()
    assert handle.wait(timeout=30) == 35  # (1 + 2) * 10, + 5: each result first in the next args
    assert (apps.add.s(1, 2) | apps.mul.s(10)).delay().wait(30) == 30
    # .si: the step does not take its parent's result
    assert (apps.add.s(1, 2) | apps.mul.si(4, 5)).delay().wait(30) == 20
    d = record(app, "default", handle.id)
    assert d["state"] == "completed" and d["args"] == "[30,5]" and d["attempts"] == "1"
    parent = d["parents"].split()[1]
    assert record(app, "default", parent)["children"] == f"default {handle.id}"


def test_steps_wait_in_their_own_state_and_are_listed(app, stack):
    handle = (apps.add.s(1, 2) | apps.mul.s(10) | apps.mul.s(2)).delay()
    d = record(app, "default", handle.id)
    assert (d["state"], d["waiting_on"]) == ("waiting", "1")
    assert app.redis.zcard(app.keys.q("default") + "waiting") == 2
    assert app.redis.llen(app.keys.q("default") + "pending") == 1  # only the first step may be claimed
    [stats] = listing.queue_stats(app)
    assert (stats["waiting"], stats["pending"]) == (2, 1)
    assert {j.id for j in listing.list_jobs(app, "default", "waiting")} >= {handle.id}
    shown = stack.cli("status", handle.id, check=True).stdout
    assert "waiting" in shown and "parents" in shown
    stack.worker()
    assert handle.wait(30) == 60
    assert app.redis.zcard(app.keys.q("default") + "waiting") == 0


def test_depends_on_jobs_of_two_queues(app, stack):
    a = apps.hold.apply_async(["a"], queue="one")
    b = apps.hold.apply_async(["b"], queue="two")
    after = apps.record.apply_async(["after"], depends_on=[a, b.id])  # a Job, and an id
    assert after.state == "waiting"
    stack.worker("-Q", "one,two,default", concurrency=3)
    started_pid(app, "a")
    started_pid(app, "b")
    app.redis.set(f"{app.settings.prefix}:release:a", 1)
    wait_for(lambda: a.state == "completed", what="a to complete")
    assert after.state == "waiting" and record(app, "default", after.id)["waiting_on"] == "1"
    app.redis.set(f"{app.settings.prefix}:release:b", 1)
    assert after.wait(30) == 1
    assert ledger(app, "after") == 1
    shown = stack.cli("status", a.id, check=True).stdout
    assert f"children  {after.id} (default)" in shown
    # a parent that completed already counts at once
    assert apps.add.apply_async((2, 3), depends_on=[a]).wait(30) == 5


def test_a_failed_parent_in_another_queue_cancels_a_depends_on_job(app, stack):
    bad = apps.boom.apply_async(["no"], queue="one")
    after = apps.add.apply_async((1, 2), depends_on=[bad])
    then = apps.add.apply_async((3, 4), depends_on=[after])
    stack.worker("-Q", "one,default")
    with pytest.raises(JobFailed, match=rf"step {bad.id} \(task tests.apps.boom\) failed: ValueError: no"):
        then.wait(30)
    assert record(app, "default", after.id)["canceled_by"] == f"one {bad.id}"
    with pytest.raises(ValueError, match="ended failed: the job would never run"):
        apps.add.apply_async((1, 2), depends_on=[bad])


def test_a_step_that_goes_on_after_a_failure_may_name_a_parent_that_failed_already(app, stack):
    """A step with on_parent_failure "continue" or "only" whose parent ended failed before it
    was written (a chord over slots writes its members a call before its callback: a member
    in the callback's slot may fail in between) is settled as that end says, not refused:
    continue runs it with null for that result, only (an on_failure callback) runs it with the
    error; cancel, the default, is still refused (it would never run)."""
    bad = apps.boom.apply_async(["early"])
    good = apps.add.apply_async((2, 2))
    stack.worker()
    with pytest.raises(JobFailed):
        bad.wait(30)
    assert good.wait(30) == 4

    def enqueue(job_id: str, parents: list[str], takes: str, opf: str | None) -> int:
        fields = ["task", "tests.apps.echo", "args", "[]", "kwargs", "{}", "parents",
                  " ".join(f"default {p}" for p in parents), *(["takes", takes] if takes else [])]
        return app._enqueue_batch("default", [(job_id, 0, fields + (["on_parent_failure", opf] if opf else []))],
                                  ())[0]

    assert enqueue("cb-continue", [good.id, bad.id], "results", "continue") == 1
    assert app.job("cb-continue").wait(30) == [4, None]
    assert enqueue("cb-only", [bad.id], "error", "only") == 1
    got = app.job("cb-only").wait(30)
    assert (got["id"], got["state"], got["error_type"], got["error"]) == (bad.id, "failed", "ValueError", "early")
    with pytest.raises(ValueError, match="ended failed: the job would never run"):
        enqueue("cb-cancel", [good.id, bad.id], "results", None)
    # `only` with a parent that completed is canceled, whichever order the parents are named in
    for name, parents in (("only-gb", [good.id, bad.id]), ("only-bg", [bad.id, good.id])):
        assert enqueue(name, parents, "", "only") == 1 and app.job(name).refresh().state == "canceled", name


def test_a_failed_step_cancels_the_steps_after_it_and_wait_names_it(app, stack):
    stack.worker()
    handle = (apps.add.s(1, 2) | apps.boom.si("bad input") | apps.add.s(1) | apps.mul.s(2)).delay()
    with pytest.raises(JobFailed) as e:
        handle.wait(30)
    failed_id = record(app, "default", record(app, "default", handle.id)["parents"].split()[1])["parents"].split()[1]
    assert e.value.state == "canceled"
    assert f"step {failed_id} (task tests.apps.boom) failed: ValueError: bad input" in str(e.value)
    for job_id in (handle.id, record(app, "default", handle.id)["parents"].split()[1]):  # transitively
        d = record(app, "default", job_id)
        assert (d["state"], d["canceled_by"], d["error_type"]) == ("canceled", f"default {failed_id}", "Canceled")
        assert d["attempts"] == "0"  # never ran
    assert app.redis.zcard(app.keys.q("default") + "canceled") == 2
    history = hist.read(app.redis.xrange(app.keys.q("default") + "history"))
    assert sorted(e["state"] for _, e in history) == ["canceled", "canceled", "completed", "failed"]
    assert app.redis.zcard(app.keys.q("default") + "waiting") == 0
    assert stack.cli("jobs", "--state", "canceled", check=True).stdout.count("canceled") >= 2


def test_steps_that_fail_for_good_otherwise_cancel_theirs_too(app, stack):
    stack.worker()
    stack.dispatcher()
    lost = (apps.crash.s("c") | apps.add.s(1)).delay()  # its process dies twice: WorkerLost (max_lost=2)
    rejected = (apps.reject.s("no thanks") | apps.add.s(1)).delay()  # Reject: failed at once, retries or not
    with pytest.raises(JobFailed, match=r"\(task tests.apps.crash\) failed: WorkerLost"):
        lost.wait(60)
    with pytest.raises(JobFailed, match=r"\(task tests.apps.reject\) failed: Rejected: no thanks"):
        rejected.wait(30)
    assert ledger(app, "c") == 2


def test_a_step_gets_its_parents_result_even_after_the_parent_expired(app, stack):
    handle = (apps.add.s(1, 2) | apps.mul.s(10).set(queue="later")).delay()
    w = stack.worker("-Q", "default")
    first = app.job(record(app, "later", handle.id)["parents"].split()[1])
    wait_for(lambda: first.state == "completed", what="the first step")
    assert record(app, "later", handle.id)["args"] == "[3,10]"
    app.redis.delete(app.keys.job("default", first.id))  # its result_ttl passed
    os.killpg(w.pid, signal.SIGKILL)
    w.wait()
    stack.worker("-Q", "later")
    assert handle.wait(30) == 30


def test_killing_or_deleting_a_waiting_step_cancels_its_children(app):
    handle = (apps.add.s(1, 2) | apps.mul.s(10) | apps.mul.s(2)).delay()
    middle = record(app, "default", handle.id)["parents"].split()[1]
    assert app.job(middle).kill() == "killed"
    assert record(app, "default", handle.id)["state"] == "canceled"
    other = (apps.add.s(1, 2) | apps.mul.s(10)).delay()
    first = app.job(record(app, "default", other.id)["parents"].split()[1])
    assert first.delete()
    d = record(app, "default", other.id)
    assert (d["state"], d["error"]) == ("canceled", f"step {first.id} (task tests.apps.add) deleted")
    with pytest.raises(JobFailed, match="deleted"):
        other.wait(5)


def test_purging_a_queue_cancels_what_waits_for_its_jobs(app):
    handle = (apps.add.s(1, 2) | apps.mul.s(10).set(queue="later")).delay()
    assert app.purge("default") == 1
    d = record(app, "later", handle.id)
    assert d["state"] == "canceled" and d["error"].endswith("(task tests.apps.add) deleted")
    assert app.redis.zcard(app.keys.q("later") + "waiting") == 0


def test_a_chain_survives_a_sigkilled_worker_each_step_made_pending_once(app, stack):
    stack.dispatcher()
    w1 = stack.worker(concurrency=1)
    handle = (apps.counted.s(0, "s1") | apps.gate.s("s2") | apps.counted.s("s3") | apps.counted.s("s4")).delay()
    started_pid(app, "s2")
    os.killpg(w1.pid, signal.SIGKILL)  # the worker and its child, in the middle of step 2
    w1.wait()
    app.redis.set(f"{app.settings.prefix}:release:s2", 1)
    stack.worker(concurrency=1)
    assert handle.wait(60) == 3
    assert [ledger(app, k) for k in ("s1", "s2", "s3", "s4")] == [1, 2, 1, 1]
    ids = [handle.id]
    while parents := record(app, "default", ids[0]).get("parents"):
        ids.insert(0, parents.split()[1])
    deliveries = [int(record(app, "default", i)["attempts"]) for i in ids]
    assert deliveries == [1, 2, 1, 1]  # step 2 ran again after the kill; each later one once
    history = hist.read(app.redis.xrange(app.keys.q("default") + "history"))
    assert sorted(e["id"] for _, e in history if e["state"] == "completed") == sorted(ids)


def test_the_enqueue_script_refuses_bad_edges_and_changes_nothing(app, redis_server):
    raw = Raw(redis_server.url, app.settings.prefix)
    q = raw.q("default")
    keys = [q, f"{app.settings.prefix}:{{_}}:queues"]
    raw.enqueue(keys, *raw.job("p1", "task", "t.a"))
    raw.r.hset(app.keys.job("default", "gone"), "state", "failed")
    before = raw.snapshot()
    bad = [
        (["parents", "default"], "parents must be"),
        (["parents", "default nope"], "parent nope not found"),
        (["parents", "default gone"], "ended failed"),
        (["parents", "other p1"], "not among KEYS"),
        (["parents", "default p1 default p1"], "listed twice"),
        (["parents", "default c"], "listed twice, or the job itself"),
        (["takes", "result"], "need parents"),
        (["on_parent_failure", "continue"], "need parents"),
        (["parents", "default p1", "on_parent_failure", "maybe"], "on_parent_failure must be"),
        (["parents", "default p1", "takes", "error"], 'takes "error" goes with'),
        (["parents", "default p1", "on_parent_failure", "only", "takes", "result"], 'takes "error" goes with'),
        (["parents", "default p1", "takes", "everything"], 'takes must be "result"'),
        (["cross_slot", "1"], "need parents"),
        (["parents", "other p1", "cross_slot", "yes"], "cross_slot must be 1"),
        (["parents", "other p1 other p1", "cross_slot", "1"], "listed twice"),
        (["cross_children", "other x"], "cross_children must be"),
        (["cross_children", "default x result"], "cross_children must be"),  # its own queue: no other slot
        (["cross_children", "other x all"], "cross_children must be"),
        (["cross_children", "other x - other b@d! -"], "cross_children must be"),
    ]
    for fields, why in bad:
        with pytest.raises(Exception, match=why):
            raw.enqueue(keys, *raw.job("c", "task", "t.b", *fields))
    with pytest.raises(Exception, match="cannot have a delay"):
        raw.enqueue(keys, 1, "c", 5, 2, "task", "t.b", "parents", "default p1")
    with pytest.raises(Exception, match="KEYS.3. must be the key prefix of a queue"):
        raw.enqueue([*keys, "elsewhere"], *raw.job("c", "task", "t.b", "parents", "default p1"))
    assert raw.snapshot() == before
    # a chain in one call: the second job names the first, which comes before it
    assert raw.enqueue(keys, 2, "x1", 0, 1, "task", "t.a", "x2", 0, 2, "task", "t.b", "parents", "default x1") == [1, 1]
    assert raw.r.hget(app.keys.job("default", "x1"), "children") == "default x2"


def test_the_join_and_attach_scripts_refuse_bad_input_and_change_nothing(app, redis_server):
    """join.lua and attach.lua (cross-slot edges, docs/PROTOCOL.md, Workflows) check what they
    are given as enqueue.lua does: one line, nothing changed."""
    raw = Raw(redis_server.url, app.settings.prefix)
    q = app.keys.q("default")
    apps.add.apply_async((1, 1), job_id="p1")
    failed = apps.add.apply_async((1, 1), job_id="p2")
    raw.r.hset(app.keys.job("default", failed.id), "state", "failed")
    before = raw.snapshot()
    entry = ["c1", "other p9", "t.a", "completed", "1", "", "", ""]
    for argv, why in [
        ([3600, *entry[:-1]], "8 values per entry"),
        ([0, *entry], "failed TTL"),
        ([3600, "c 1", *entry[1:]], "child must be a job id"),
        ([3600, "c1", "other", *entry[2:]], 'parent "<queue> <id>"'),
        ([3600, *entry[:3], "done", *entry[4:]], "state must be"),
    ]:
        with pytest.raises(ValueError, match=why):
            scripts.JOIN(app.redis, [q], argv)
    for argv, why in [
        (["other", "c1", "-"], "then the parents' ids"),
        (["default", "c1", "-", "p1"], "another than KEYS"),
        (["other", "c1", "all", "p1"], "takes must be"),
        (["other", "c1", "-", "nope"], "parent nope not found"),
        (["other", "c1", "-", "p1", failed.id], "ended failed: the job would never run"),
        (["other", "c1", "-", "p1", "p1"], "listed twice"),
    ]:
        with pytest.raises(ValueError, match=why):
            scripts.ATTACH(app.redis, [q], argv)
    assert raw.snapshot() == before
    assert scripts.ATTACH(app.redis, [q], ["other", "c1", "result", "p1"]) == [1]
    assert scripts.ATTACH(app.redis, [q], ["other", "c1", "result", "p1"]) == [1]  # again: nothing more
    assert raw.r.hmget(app.keys.job("default", "p1"), "children", "cross_children") == ["other c1",
                                                                                        "other c1 result"]


def test_eager_mode_runs_chains_and_depends_on_inline(redis_server):
    eager = TaskRunner("eager", eager=True)
    add = eager.task(apps.add.fn, name="add")
    mul = eager.task(apps.mul.fn, name="mul")
    boom = eager.task(apps.boom.fn, name="boom")
    assert chain(add.s(1, 2), mul.s(10)).delay().wait() == 30
    assert (add.s(1, 2) | mul.si(2, 3)).delay().wait() == 6
    assert ((add.s(1, 2) | mul.s(2)) | (add.s(1) | mul.s(3))).delay().wait() == 21  # chains of chains
    a = add.delay(1, 1)
    assert add.apply_async((3, 4), depends_on=[a]).wait() == 7
    handle = (add.s(1, 2) | boom.si("no") | mul.s(2)).delay()
    with pytest.raises(JobFailed, match=r"canceled: Canceled: step \S+ \(task boom\) failed: ValueError: no"):
        handle.wait()
    with pytest.raises(TypeError, match="Job objects"):
        add.apply_async((1, 1), depends_on=[a.id])


def test_a_step_whose_parents_all_completed_gets_what_the_join_would_give(app, stack):
    """depends_on jobs that completed already: a step taking "results" gets the array of
    their results, and an on_failure callback (on_parent_failure only) ends canceled, as
    when a join settles them (found in review: the first took its first parent's result
    alone, the second ran)."""
    stack.worker()
    a, b = apps.add.delay(1, 1), apps.add.delay(2, 2)
    assert (a.wait(30), b.wait(30)) == (2, 4)
    assert scripts.ENQUEUE(app.redis, [app.keys.q("default")], [
        2, "all-done", 0, 3, "task", "tests.apps.echo", "parents", f"default {a.id} default {b.id}",
        "takes", "results",
        "on-fail", 0, 4, "task", "tests.apps.echo", "parents", f"default {a.id}", "on_parent_failure", "only",
        "takes", "error"]) == [1, 1]
    assert app.job("all-done").wait(30) == [2, 4]
    d = app.redis.hgetall(app.keys.job("default", "on-fail"))
    assert (d["state"], d["canceled_by"]) == ("canceled", f"default {a.id}")
    assert "completed (an on_failure callback)" in d["error"]


def drive(op: Any, enqueue_answer: Callable[[steps.Enqueue], Any]) -> tuple[list[str], BaseException | None]:
    """Run a producer's operation by hand as on a Redis Cluster (canvas.across), each write
    answered by enqueue_answer (an exception: thrown in); the ids it asks to kill, and the
    error it ends with."""
    kills: list[str] = []
    answer: Any = None
    request = next(op)
    while True:
        if isinstance(request, steps.Clustered):
            answer = True
        elif isinstance(request, steps.Enqueue):
            answer = enqueue_answer(request)
            if isinstance(answer, BaseException):
                try:
                    request = op.throw(answer)
                    continue
                except Exception as e:
                    return kills, e
        elif isinstance(request, steps.Scripts):
            kills += [call.args[0] for call in request.calls]
            answer = [["killed"] for _ in request.calls]  # kill.lua: each killed by this call
        else:
            answer = None
        try:
            request = op.send(answer)
        except StopIteration:
            return kills, None
        except Exception as e:
            return kills, e


def test_a_workflow_that_fails_midway_kills_no_job_that_existed_before_it(app):
    """(Review.) A step answered 0 existed before the call — enqueued before (a workflow given
    again with its ids, another's ids) or by a try of this call whose answer was lost: a
    later level failing for good killed it with those this call wrote, children and all. Only
    those answered 1 are killed; the others are named."""
    flow = chain(apps.add.s(1, 2).set(queue="q1", job_id="existing-1"), apps.add.s(3).set(queue="q2", job_id="mine-2"),
                 apps.add.s(4).set(queue="q3", job_id="mine-3"))
    answers = {"existing-1": [0], "mine-2": [1]}
    kills, error = drive(flow.enqueued(), lambda r: answers[r.jobs[0][0]] if r.jobs[0][0] in answers
                         else redis.ResponseError("OOM command not allowed"))
    assert isinstance(error, redis.ResponseError)
    assert kills == ["mine-2"]
    assert str(error) == ("OOM command not allowed (the jobs of it written before were killed: 1; to enqueue it "
                          "again, give them new ids (a killed job's id exists: given again, it adds nothing); already "
                          "existed (this call's earlier try whose answer was lost, or enqueued before): not killed: "
                          "q1 existing-1)")
    assert error.withdrawn == [("q2", "mine-2")]
