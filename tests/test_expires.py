"""A job's expiry (`expires`, as Celery's): a job that has not started by then never runs;
the claim that finds it past its expiry ends it killed, Expired, and goes on to the next job
(docs/PROTOCOL.md, Expiry). Real Redis and workers; a job passes its expiry before any claim
(no worker yet, or its queue paused), waited for on Redis's clock, never by a fixed sleep."""

from __future__ import annotations

import asyncio
import json
import math
import os
from datetime import datetime, timedelta, timezone

import pytest

from dashboard import create_app
from taskrunner import TaskRunner
from taskrunner.client.aio import AsyncClient
from taskrunner.client.consumer import Consumer
from taskrunner.errors import JobFailed
from taskrunner.ops.history import read
from taskrunner.protocol import scripts
from taskrunner.protocol.claims import claim_args, decode
from taskrunner.protocol.outcome import Ended, Outcome
from tests import apps, flow_apps
from tests.conftest import wait_for


def redis_now(app: TaskRunner) -> float:
    s, us = app.redis.time()
    return s + us / 1e6


def expiry_of(app: TaskRunner, job) -> float:
    return float(app.redis.hget(app.keys.job(job.queue, job.id), "expires"))


def past(app: TaskRunner, *jobs) -> None:
    """Wait until Redis's clock has passed the expiry of each job."""
    last = max(expiry_of(app, j) for j in jobs)
    wait_for(lambda: redis_now(app) >= last, what="the jobs' expiry on Redis's clock")


def utc(t: float) -> str:
    return datetime.fromtimestamp(math.floor(t), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def assert_expired(app: TaskRunner, job) -> None:
    d = job.refresh().to_dict()
    assert (d["state"], d["error_type"], d["attempts"]) == ("killed", "Expired", 0), d
    assert d["error"] == f"not started before it expired at {utc(d['expires'])}"


def test_the_record_holds_the_expiry_on_redis_clock_and_the_claim_reads_it_only_when_named(app):
    """`expires` seconds from now is stored as Redis's now + them (a datetime as the seconds
    until it), named in `opt`; a job without it has no field and an `opt` without it."""
    p = app.keys.q("default")
    job = apps.add.apply_async([1, 2], expires=30)
    rec = app.redis.hgetall(p + "job:" + job.id)
    assert rec["opt"] == "expires"
    assert float(rec["expires"]) == pytest.approx(float(rec["enqueued_at"]) + 30, abs=1e-5)
    soon = apps.add.apply_async([1, 2], expires=datetime.now(timezone.utc) + timedelta(hours=1), headers={"a": 1})
    rec = app.redis.hgetall(p + "job:" + soon.id)
    assert rec["opt"] == "headers expires"
    assert 3000 < float(rec["expires"]) - float(rec["enqueued_at"]) <= 3600 + 1e-5
    plain = apps.add.delay(1, 2)
    assert "expires" not in app.redis.hgetall(p + "job:" + plain.id)
    assert app.redis.hget(p + "job:" + plain.id, "opt") == ""


@pytest.mark.parametrize("want", [1, 3])
def test_an_expired_job_is_not_delivered_and_the_claim_delivers_the_jobs_behind_it(app, want):
    """The claim ends each job past its expiry killed (Expired: never delivered, attempts 0,
    not counted as consumed, listed and indexed as killed, in the history) and goes on, so
    the caller gets the jobs it asked for: a lone claim and a batch alike."""
    first = apps.add.apply_async([1, 1], expires=0.05)
    plain = apps.add.delay(2, 2)
    second = apps.add.apply_async([3, 3], expires=0.05)
    later = apps.add.apply_async([4, 4], expires=3600)
    last = apps.add.delay(5, 5)
    past(app, first, second)
    consumer = Consumer(app, ["default"])
    got = consumer.claim(want)
    assert [d.id for d in got] == [plain.id, later.id, last.id][:want]
    assert_expired(app, first)
    if want == 3:
        assert_expired(app, second)
    else:
        assert [d.id for d in consumer.claim(1)] == [later.id]  # the next claim ends `second` on its way
        assert_expired(app, second)
    with pytest.raises(JobFailed, match=r"killed: Expired: not started before it expired at ") as e:
        first.wait(5)
    assert (e.value.state, e.value.error_type) == ("killed", "Expired")
    p = app.keys.q("default")
    assert app.redis.hget(p + "meta", "consumed_messages") == ("3" if want == 3 else "2")
    assert not app.redis.sismember(p + "processing", first.id) and not app.redis.sismember(p + "processing", second.id)
    assert set(app.redis.zrange(p + "killed", 0, -1)) == {first.id, second.id}
    assert set(app.redis.zrange(p + "killed:error:Expired", 0, -1)) == {first.id, second.id}
    ended = {f["id"]: f for _, f in read(app.redis.xrange(p + "history"), "default")}
    assert (ended[first.id]["state"], ended[first.id]["error_type"]) == ("killed", "Expired")


def test_a_worker_never_runs_an_expired_job_and_status_and_the_dashboard_say_why(app, stack):
    """End to end: a job whose queue was paused past its expiry is never run by the worker
    that serves it once resumed; the jobs behind it run. wait() raises JobFailed naming
    Expired; `status` and the dashboard's job and Killed pages show it like any killed job,
    and `status --json` has `expires`."""
    expired = apps.record.apply_async(["expired"], expires=0.05)
    ok = apps.record.apply_async(["ok"], expires=3600)
    stack.cli("queue", "pause", "default", check=True)
    stack.worker()  # it serves the queue while the job passes its expiry
    past(app, expired)
    stack.cli("queue", "resume", "default", check=True)
    assert ok.wait(30) == 1
    with pytest.raises(JobFailed, match="Expired"):
        expired.wait(30)
    assert app.redis.get(f"{app.settings.prefix}:ledger:expired") is None
    text = stack.cli("status", expired.id, check=True).stdout
    assert f"expires  {utc(expiry_of(app, expired))}" in text
    assert f"error  Expired: not started before it expired at {utc(expiry_of(app, expired))}" in text
    d = json.loads(stack.cli("status", expired.id, "--json", check=True).stdout)
    assert (d["state"], d["error_type"], d["expires"]) == ("killed", "Expired", expiry_of(app, expired))
    web = create_app(app, password="pw", token="tok").test_client()
    page = web.get(f"/jobs/{expired.id}").get_data(as_text=True)
    assert '<td class="error">Expired: not started before it expired at' in page and 'data-field="expires"' in page
    assert expired.id in web.get("/failed?state=killed&error=Expired").get_data(as_text=True)
    assert [j["id"] for j in web.get("/api/failed?state=killed&error=Expired").get_json()["jobs"]] == [expired.id]


@pytest.mark.parametrize("until", ["start", "finish"])
def test_an_expired_unique_job_releases_its_lock(app, until):
    """Its unique lock ends with it: another job with the key is added after the claim."""
    job = apps.add.apply_async([1, 2], unique_key="k1", unique_until=until, expires=0.05)
    again = apps.add.apply_async([1, 2], unique_key="k1", unique_until=until)
    assert (again.id, again.created) == (job.id, False)
    past(app, job)
    assert Consumer(app, ["default"]).claim(1) == []
    assert_expired(app, job)
    assert app.redis.get(app.keys.q("default") + "unique:k1") is None
    fresh = apps.add.apply_async([1, 2], unique_key="k1", unique_until=until)
    assert fresh.created and fresh.id != job.id


def test_a_chain_step_that_expires_cancels_the_rest_and_runs_the_on_failure_callback(app, stack):
    """The step ends as a kill would end it: the steps after it are canceled (naming it), and
    a job's on_failure callback runs, given how it ended."""
    handle = (apps.add.s(1, 2).set(expires=0.05) | apps.mul.s(10) | apps.mul.s(2)).delay()
    middle = app.redis.hget(app.keys.job("default", handle.id), "parents").split()[1]
    first = app.job(app.redis.hget(app.keys.job("default", middle), "parents").split()[1])
    alone = apps.add.apply_async([1, 1], expires=0.05, on_failure=apps.record.si("called back"))
    past(app, first, alone)
    stack.worker()
    with pytest.raises(JobFailed, match="Canceled") as e:
        handle.wait(30)
    assert f"step {first.id} (task tests.apps.add) killed: Expired: not started before it expired" in str(e.value)
    assert_expired(app, first)
    assert app.job(middle).state == "canceled"
    wait_for(lambda: app.redis.get(f"{app.settings.prefix}:ledger:called back") == "1", what="the callback")
    assert_expired(app, alone)


def expired_batch(app: TaskRunner, task: str, n: int) -> list:
    """n jobs of `task` enqueued in one call with an expiry of 0.05 s, waited past."""
    jobs = app.enqueue_many([{"task": task, "args": [i], "expires": 0.05} for i in range(n)])
    past(app, jobs[-1])  # one call: one now, the same expiry for all
    return jobs


def test_a_flow_pass_reads_on_past_a_window_of_expired_jobs(app):
    """A flow-controlled queue whose oldest 100 jobs (a pass's window) expired: expired jobs
    do not count in the window, the pass ends them and delivers the live job behind them. It
    answered none, with no wake token left: its worker slept (up to its idle block) with the
    job pending."""
    p = app.keys.q("default")
    jobs = expired_batch(app, flow_apps.limited.name, 150)
    live = flow_apps.limited.delay(999)
    assert [d.id for d in Consumer(app, ["default"]).claim(1)] == [live.id]
    assert app.redis.zcard(p + "killed:error:Expired") == 150 and app.redis.llen(p + "pending") == 0
    assert_expired(app, jobs[0])


@pytest.mark.parametrize("task", [apps.echo.name, flow_apps.limited.name])
def test_a_claim_ends_a_bounded_number_of_expired_jobs_and_leaves_a_wake_token(app, task):
    """Each costs a finalize(): a backlog of expired jobs (20,000: 1.3 s) was ended in one
    claim that held Redis. A claim ends about 200 at most (a plain queue's batch, a flow
    pass), then answers short with a wake token left, so that its claimer comes back at once;
    the claims after it end the rest and deliver the live job behind them."""
    p = app.keys.q("default")
    expired_batch(app, task, 500)
    live = app.enqueue(task, [7])
    argv = claim_args(app, "c1", "h", "127.0.0.1", [os.getpid(), ""])

    def claim() -> list:  # one call of the script (Consumer.claim() claims on: see the test after)
        return decode(scripts.CLAIM(app.redis, [p], argv), ["default"])[0]

    app.redis.delete(p + "wake")  # the enqueues' token: a claim cut short leaves its own
    assert claim() == []
    assert 200 <= app.redis.zcard(p + "killed") < 300 and app.redis.llen(p + "wake") == 1
    got: list = []
    for _ in range(10):  # bounded: 2 more claims suffice
        app.redis.delete(p + "wake")
        got = claim()
        if got:
            break
        assert app.redis.llen(p + "wake") == 1
    assert [d.id for d in got] == [live.id] and app.redis.zcard(p + "killed") == 500


@pytest.mark.parametrize("worker_app, task, n", [("tests.apps", apps.echo.name, 500),
                                                  ("tests.flow_apps", flow_apps.limited.name, 350)])
def test_a_worker_behind_a_backlog_of_expired_jobs_runs_the_live_job_without_idling(app, stack, worker_app, task, n):
    """A worker whose claims meet more expired jobs than one claim ends (plain queue) or than
    a flow pass reads (flow-controlled; more than two: the wake token the enqueue left woke
    it once): it claims on at once, rather than waiting for its idle block (here 600 s) to
    end, and runs the job behind them."""
    jobs = expired_batch(app, task, n)
    live = app.enqueue(task, [7])
    stack.worker(app=worker_app, env={"TASKRUNNER_IDLE_BLOCK": "600"})
    assert live.wait(30) == 7
    assert_expired(app, jobs[-1])
    assert app.redis.zcard(app.keys.q("default") + "killed:error:Expired") == n


def test_an_expired_job_of_a_rate_limited_task_spends_no_token(app):
    """A flow pass takes an expired job without its task's token: the job behind it, of the
    same task (one token an hour), gets the token and is delivered in the same claim."""
    expired = flow_apps.trickle.apply_async((1,), expires=0.05)
    live = flow_apps.trickle.apply_async((2,))
    past(app, expired)
    consumer = Consumer(app, ["trickle"])
    argv = claim_args(app, consumer.name, "h", "127.0.0.1", [os.getpid(), ""] * 2)
    consumer.heartbeat()
    got, wait = decode(scripts.CLAIM(app.redis, [app.keys.q("trickle")], argv), ["trickle"])
    assert [d.id for d in got] == [live.id] and wait is None
    assert_expired(app, expired)


def test_an_expired_job_of_a_capped_task_takes_no_slot(app):
    """Nor a concurrency slot: the key's only slot goes to the job behind it, and stays with
    that delivery alone."""
    p = app.keys.q("default")
    expired = flow_apps.capped_hold.apply_async(("x",), concurrency_key="k", expires=0.05)
    live = flow_apps.capped_hold.apply_async(("y",), concurrency_key="k")
    past(app, expired)
    [d] = Consumer(app, ["default"]).claim(2)
    assert d.id == live.id and app.redis.smembers(p + "slots:k") == {live.id}
    assert_expired(app, expired)


def test_a_delayed_job_expires_at_its_claim_and_retries_and_requeues_keep_the_expiry(app):
    """A job whose expiry passes while it is delayed expires when claimed; a job that ran
    keeps its expiry through a retry and an operator's requeue, and expires at a claim after
    it (the expiry is moved to a past time of Redis's clock: a delivery outlived it)."""
    p = app.keys.q("default")
    consumer = Consumer(app, ["default"])
    delayed = apps.add.apply_async([1, 2], delay=3600, expires=0.05)
    past(app, delayed)
    assert scripts.REQUEUE(app.redis, [p], [delayed.id, "tests", "delayed"]) == "delayed"  # due now
    assert consumer.claim(1) == []
    assert_expired(app, delayed)

    for end in ("retry", "requeue"):
        job = apps.flaky.apply_async([end, 5], expires=3600)
        [d] = consumer.claim(1)
        app.redis.hset(p + "job:" + job.id, "expires", f"{redis_now(app):.6f}")  # its delivery outlived it
        if end == "retry":
            assert consumer._finish([("default", Ended(d.id, d.attempt, Outcome.error("E", "boom")))]) == [True]
            assert job.refresh().state == "delayed"
            assert scripts.REQUEUE(app.redis, [p], [job.id, "tests", "delayed"]) == "delayed"
        else:
            assert scripts.REQUEUE(app.redis, [p], [job.id, "tests"]) == "running"
        assert consumer.claim(1) == []
        d = job.refresh().to_dict()
        assert (d["state"], d["error_type"], d["attempts"]) == ("killed", "Expired", 1)


def test_an_operators_retry_of_an_expired_job_drops_its_expiry(app, stack):
    """`taskrunner retry` of an expired job runs it: its expiry (passed) is dropped, with its
    name in `opt`, else it would expire again at once."""
    p = app.keys.q("default")
    job = apps.add.apply_async([1, 2], expires=0.05, headers={"h": 1})
    past(app, job)
    assert Consumer(app, ["default"]).claim(1) == []
    assert_expired(app, job)
    assert stack.cli("retry", job.id, check=True).stdout.strip() == f"{job.id}: queued again"
    rec = app.redis.hgetall(p + "job:" + job.id)
    assert (rec["state"], rec["opt"], "expires" in rec) == ("pending", "headers", False)
    [d] = Consumer(app, ["default"]).claim(1)
    assert d.id == job.id and d.headers == {"h": 1}


def test_every_producer_takes_expires(app):
    """apply_async, app.enqueue, enqueue_many items, a chain step (Signature.set) and the
    asyncio client all send it."""
    p = app.keys.q("default")
    handle = (apps.add.s(1, 2).set(expires=60) | apps.mul.s(2)).delay()
    step = app.redis.hget(p + "job:" + handle.id, "parents").split()[1]
    jobs = [apps.add.apply_async([1, 2], expires=60), app.enqueue("tests.apps.add", [1, 2], expires=60),
            *app.enqueue_many([{"task": "tests.apps.add", "args": [1, 2], "expires": 60}]), app.job(step)]

    async def aio() -> str:
        client = AsyncClient(app)
        try:
            return await client.enqueue("tests.apps.add", [1, 2], expires=60)
        finally:
            await client.close()

    ids = [j.id for j in jobs] + [asyncio.run(aio())]
    for job_id in ids:
        rec = app.redis.hgetall(p + "job:" + job_id)
        assert rec["opt"] == "expires", rec
        assert float(rec["expires"]) - float(rec["enqueued_at"]) == pytest.approx(60, abs=1e-5)
    r = app.enqueue("tests.apps.add", [1, 2])
    assert "expires" not in app.redis.hgetall(p + "job:" + r.id)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "10", True, 2.0**53,
                                 datetime(2030, 1, 1), datetime.now(timezone.utc) - timedelta(seconds=1)])
def test_bad_expiries_are_refused_before_anything_is_sent(app, bad):
    with pytest.raises(ValueError, match=r"^expires ") as e:
        apps.add.apply_async([1, 2], expires=bad)
    assert "\n" not in str(e.value)
    assert app.redis.llen(app.keys.q("default") + "pending") == 0


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "abc", "", "1e999", "9007199254740992"])
def test_enqueue_lua_refuses_a_bad_expiry_in_one_line(app, bad):
    p = app.keys.q("default")
    with pytest.raises(ValueError) as e:  # the script's BadValue, as taskrunner raises it
        scripts.ENQUEUE(app.redis, [p], [1, "j1", 0, 2, "task", "tests.apps.add", "expires", bad])
    assert str(e.value) == f"job j1: expires must be a number of seconds > 0 and < 2^53, not {json.dumps(bad)}"
    assert not app.redis.exists(p + "job:j1")


def test_the_cli_takes_expires_and_refuses_a_bad_one_with_exit_2(app, stack):
    r = stack.cli("enqueue", "tests.apps.add", "--args", "[1, 2]", "--expires", "90", check=True)
    rec = app.redis.hgetall(app.keys.job("default", r.stdout.strip()))
    assert float(rec["expires"]) - float(rec["enqueued_at"]) == pytest.approx(90, abs=1e-5)
    for bad in ("0", "-5", "abc"):
        r = stack.cli("enqueue", "tests.apps.add", "--args", "[1, 2]", "--expires", bad)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert "expires" in r.stderr.strip().splitlines()[-1]
    assert app.redis.llen(app.keys.q("default") + "pending") == 1


def test_eager_mode_ignores_expires():
    """As it ignores a delay: the job runs now, and its record has no expiry."""
    eager = TaskRunner("eager-expires", eager=True, redis_url="redis://127.0.0.1:1")

    @eager.task(name="double")
    def double(x):
        return 2 * x

    job = double.apply_async([21], expires=0.001)
    assert job.wait() == 42 and "expires" not in job.data


@pytest.mark.parametrize("task", [apps.echo.name, flow_apps.limited.name])
def test_consume_without_a_timeout_takes_the_live_job_behind_a_backlog_of_expired_jobs(app, stack, task):
    """`taskrunner consume` (its --timeout 0: Consumer.claim(block=0)) behind more expired
    jobs than one claim ends: the claims cut short leave a wake token, which a claim that may
    not wait takes at once, as a BRPOP would, and claims on. It said "no job" (exit 2) with
    the live job pending, after one claim that ended 200 of them."""
    expired_batch(app, task, 450)
    live = app.enqueue(task, [7])
    consumer = Consumer(app, ["default"])
    try:
        got = consumer.claim(1)
        assert [d.id for d in got] == [live.id]
        consumer.ack(got)
    finally:
        consumer.close()
    assert app.redis.zcard(app.keys.q("default") + "killed") == 450
    again = app.enqueue(task, [8])
    expired_batch(app, task, 250)  # behind the live one this time: the CLI takes it first
    more = app.enqueue(task, [9])
    r = stack.cli("consume", "-q", "default")
    assert r.returncode == 0 and json.loads(r.stdout)["id"] == again.id, r.stderr
    r = stack.cli("consume", "-q", "default")
    assert r.returncode == 0 and json.loads(r.stdout)["id"] == more.id, r.stderr
