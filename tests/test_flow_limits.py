"""Flow control enforced inside the claim (issue 17): global rate limits and concurrency
keys, with several real workers. A throttled job is never claimed (no claim-then-requeue),
a concurrency slot lives exactly as long as its delivery, and an idle throttled worker
sleeps until the next token."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from dashboard import create_app
from taskrunner.client import declarations
from taskrunner.client.consumer import Consumer
from taskrunner.ops import listing
from taskrunner.ops import queue as queues
from taskrunner.protocol import scripts
from taskrunner.protocol.claims import claim_args, decode
from taskrunner.protocol.outcome import Ended, Outcome
from tests import flow_apps
from tests.conftest import wait_for

FLOW = "tests.flow_apps"


def _states(jobs) -> list[str]:
    return [j.refresh().state for j in jobs]


def test_rate_limit_is_global_across_workers(app, stack):
    """100 jobs under rate_limit="20/s" on 2 workers x 4 children: their claims (the
    holding entries' started_at, Redis's clock) are at least 1/20 s apart, so the first and
    the last are at least 99/20 = 4.95 s apart; and the workers keep up with the tokens."""
    jobs = app.enqueue_many([{"task": "tests.flow_apps.limited", "args": [i]} for i in range(100)])
    stack.worker(app=FLOW, concurrency=4, name="r1")
    stack.worker(app=FLOW, concurrency=4, name="r2")
    wait_for(lambda: all(s == "completed" for s in _states(jobs)), timeout=60, what="100 rate-limited jobs")
    starts = sorted(json.loads(j.data["run:1"])["started_at"] for j in jobs)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 0.05 - 1e-5, min(gaps)
    assert 4.5 <= starts[-1] - starts[0] <= 7, starts[-1] - starts[0]
    assert {j.data["worker"] for j in jobs} == {"r1", "r2"}  # both took part
    assert all(j.data["attempts"] == "1" for j in jobs)  # none claimed, then put back


def test_max_concurrency_per_key_across_workers(app, stack):
    """Never more than max_concurrency (2) running per concurrency key; keys are
    independent; the key defaults to the task's name."""
    jobs = [flow_apps.capped.apply_async((key, 0.3), concurrency_key=key)
            for _ in range(6) for key in ("customer:1", "customer:2")]
    jobs += [flow_apps.capped.delay("tests.flow_apps.capped", 0.3) for _ in range(4)]
    stack.worker(app=FLOW, concurrency=4, name="c1")
    stack.worker(app=FLOW, concurrency=4, name="c2")
    wait_for(lambda: all(s == "completed" for s in _states(jobs)), timeout=60, what="the capped jobs")
    spans: dict[str, list[tuple[float, float]]] = {}
    for raw in app.redis.lrange(f"{app.settings.prefix}:spans", 0, -1):
        key, start, end = raw.split()
        spans.setdefault(key, []).append((float(start), float(end)))
    assert sorted(len(s) for s in spans.values()) == [4, 6, 6]
    for key, ss in spans.items():
        most = max(sum(1 for a, b in ss if a <= t < b) for t, _ in ss)
        assert most <= 2, (key, most)
    p = app.keys.q("default")
    assert not app.redis.keys(p.replace("{", "\\{").replace("}", "\\}") + "slots:*")  # every slot given back


def _started(app) -> list[str]:
    return app.redis.lrange(f"{app.settings.prefix}:started", 0, -1)


def test_a_sigkilled_worker_gives_its_slot_back_when_its_job_is_requeued(app, stack):
    """A holds key k's only slot on worker w1; B (same key) waits pending although w1 and
    w2 have idle children. w1 is SIGKILLed: the dispatcher requeues A, which gives the slot
    back, and the jobs of k run again on w2, one at a time."""
    a = flow_apps.capped_hold.apply_async(("a",), concurrency_key="k")
    b = flow_apps.capped_hold.apply_async(("b",), concurrency_key="k")
    w1 = stack.worker(app=FLOW, concurrency=2, name="w1")
    wait_for(lambda: _started(app) == ["a"], what="a to start")
    slots = app.keys.q("default") + "slots:k"
    assert app.redis.smembers(slots) == {a.id}
    stack.worker(app=FLOW, concurrency=2, name="w2")
    wait_for(lambda: app.redis.zscore(app.keys.workers, "w2"), what="w2 to beat")
    app.enqueue("tests.apps.add", [1, 2]).wait(10)  # w1 or w2 claimed since: b was passed over
    assert b.refresh().state == "pending" and _started(app) == ["a"]
    os.killpg(w1.pid, signal.SIGKILL)
    stack.dispatcher()
    wait_for(lambda: len(_started(app)) == 2, what="a job of k to run again")
    assert app.redis.scard(slots) == 1
    app.redis.set(f"{app.settings.prefix}:release:a", 1)
    app.redis.set(f"{app.settings.prefix}:release:b", 1)
    assert a.wait(30) == "released" and b.wait(30) == "released"
    assert a.refresh().data["lost"] == "1" and a.data["worker"] == "w2"
    assert sorted(_started(app)) == ["a", "a", "b"]
    assert app.redis.scard(slots) == 0


def test_an_idle_throttled_worker_sleeps_and_serves_its_other_queues(app, stack):
    """A queue whose rate limit is spent (1/h) keeps its jobs pending; the worker claims
    nothing from it and does not poll (its CPU time barely grows over many heartbeats),
    yet a job of its other queue runs at once."""
    jobs = [flow_apps.trickle.delay(i) for i in range(3)]
    w = stack.worker("-Q", "trickle,default", app=FLOW, concurrency=2, name="t1")
    jobs[0].wait(30)
    proc = psutil.Process(w.pid)

    def beat() -> float:
        return app.redis.zscore(app.keys.workers, "t1") or 0

    before, cpu0 = beat(), sum(proc.cpu_times()[:2])
    wait_for(lambda: beat() > before + 2, what="2 s of heartbeats")  # the worker's own clock
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    assert cpu < 0.25, cpu  # ~10 heartbeats; a poll of the throttled queue would spin
    assert _states(jobs[1:]) == ["pending", "pending"]
    assert app.enqueue("tests.apps.add", [2, 3]).wait(10) == 5
    limit = app.redis.hgetall(app.keys.q("trickle") + "limit:tests.flow_apps.trickle")
    assert limit["used"] == "1" and float(limit["tat"]) > beat() + 3000


def test_queue_rate_limit_set_changed_and_removed(app, stack):
    """`queue create Q --rate` limits every job of the queue; `queue rate Q none` removes
    the limit; `queues` shows it with its use."""
    r = stack.cli("queue", "create", "paced", "--rate", "1/h", check=True)
    assert "rate 1/h" in r.stdout
    jobs = [app.enqueue("tests.apps.add", [i, i], queue="paced") for i in range(3)]
    stack.worker("-Q", "paced", concurrency=2, name="p1")
    jobs[0].wait(30)
    stats = {s["name"]: s for s in json.loads(stack.cli("queues", "--json", check=True).stdout)}
    assert stats["paced"]["rate"] == "1/h" and stats["paced"]["rate_used"] + stats["paced"]["rate_used_last"] == 1
    assert "rate=1/h" in stack.cli("queues", check=True).stdout
    assert _states(jobs[1:]) == ["pending", "pending"]
    stack.cli("queue", "rate", "paced", "none", check=True)
    wait_for(lambda: _states(jobs[1:]) == ["completed", "completed"], what="the jobs once the limit is gone")
    assert queues.info(app, "paced")["rate"] is None


@pytest.mark.parametrize("bad", ["20", "0/s", "20/d", "1.5/s", "-1/s", "20/S"])
def test_bad_rate_limits_are_refused_everywhere(app, stack, bad):
    with pytest.raises(ValueError, match="N/s"):
        app.task(lambda: None, name="bad.rate", rate_limit=bad)
    with pytest.raises(ValueError, match="N/s"):
        queues.create(app, "q1", rate=bad)
    r = stack.cli("queue", "create", "q1", "--rate", bad)
    assert r.returncode == 2 and "N/s" in r.stderr
    with pytest.raises(ValueError, match="rate_limit must be"):  # the script's own check
        scripts.ENQUEUE(app.redis, [app.keys.q("q1")], [1, "j1", 0, 2, "task", "t", "rate_limit", bad])


def test_a_bad_rate_is_an_argument_mistake_even_with_redis_unreachable(stack):
    """The CLI checks a rate before it connects: exit 2 naming the rate, not exit 1 saying
    Redis is unreachable (as a newcomer with Redis stopped saw it)."""
    for args in (["queue", "rate", "q1", "5/fortnight"], ["queue", "create", "q1", "--rate", "0/s"]):
        r = stack.cli(*args, "--redis-url", "redis://127.0.0.1:1/0")
        assert r.returncode == 2 and "N/s" in r.stderr and "cannot reach Redis" not in r.stderr, r.stderr


def test_concurrency_key_needs_a_limit_and_a_name(app):
    with pytest.raises(ValueError, match="needs max_concurrency"):
        app.enqueue("tests.apps.add", [1, 2], concurrency_key="k")  # declared here, without a limit
    with pytest.raises(ValueError, match="concurrency key"):
        flow_apps.capped.apply_async(("k", 0), concurrency_key="a b")
    with pytest.raises(ValueError, match="needs max_concurrency"):  # a producer without the app
        scripts.ENQUEUE(app.redis, [app.keys.q("q1")], [1, "j1", 0, 2, "task", "t", "concurrency_key", "k"])
    with pytest.raises(ValueError, match="concurrency_key must be a name"):
        scripts.ENQUEUE(app.redis, [app.keys.q("q1")],
                        [1, "j1", 0, 3, "task", "t", "max_concurrency", "1", "concurrency_key", "a b"])


def test_plain_queues_are_not_marked_for_flow_control(app):
    """Only a job with rate_limit or max_concurrency marks its queue (the claim then checks
    it): a queue without pays nothing."""
    app.enqueue("tests.apps.add", [1, 2])
    assert app.redis.hget(app.keys.q("default") + "meta", "flow") is None
    flow_apps.capped.delay("x", 0)
    assert app.redis.hget(app.keys.q("default") + "meta", "flow") == "1"
    assert listing.queue_stats(app)[0]["rate"] is None


def test_the_dashboard_shows_a_rate_limited_queue_and_its_use(app):
    web = create_app(app, password="pw", token="tok").test_client()
    queues.create(app, "paced", rate="50/s")
    app.enqueue("tests.apps.add", [1, 2], queue="paced")
    assert "rate 50/s, 0 used" in web.get("/").get_data(as_text=True)
    consumer = Consumer(app, ["paced"])
    [d] = consumer.claim(1)
    assert "rate 50/s, " in web.get("/queues/paced").get_data(as_text=True)  # 1 used, or 0 in a new second
    [q] = [q for q in web.get("/api/queues").get_json() if q["name"] == "paced"]
    assert q["rate"] == "50/s" and q["rate_used"] + q["rate_used_last"] == 1
    consumer.ack([d])


def _claim_one(app, consumer: Consumer, key: str):
    """Enqueue a capped_hold job of `key` (max_concurrency 1) and claim it: it holds the slot."""
    job = flow_apps.capped_hold.apply_async(("x",), concurrency_key=key)
    [d] = consumer.claim(1)
    assert d.id == job.id and app.redis.smembers(app.keys.q("default") + "slots:" + key) == {job.id}
    return job, d


@pytest.mark.parametrize("path", ["completed", "error", "retry", "return", "killed", "lost", "lose", "requeue",
                                  "recover"])
def test_every_end_of_a_delivery_gives_its_slot_back(app, path):
    """While a job holds its key's only slot, the next job of that key is not claimed; once
    the delivery ends or is handed back, whichever way, the slot is free, a wake token says
    so, and the next job of the key is claimed."""
    consumer = Consumer(app, ["default"], name="c1")
    job, d = _claim_one(app, consumer, "k")
    waiting = flow_apps.capped_hold.apply_async(("y",), concurrency_key="k")
    assert consumer.claim(1) == [] and waiting.refresh().state == "pending"
    p = app.keys.q("default")
    app.redis.delete(p + "wake")
    outcomes = {"completed": Outcome.completed("null"), "error": Outcome.error("E", "boom"),
                "retry": Outcome.retry(delay=30), "return": Outcome.returned("handed back"),
                "killed": Outcome.killed("killed on request"), "lost": Outcome.lost("its child died")}
    if path in outcomes:
        assert consumer._finish([(d.queue, Ended(d.id, d.attempt, outcomes[path]))]) == [True]
    elif path == "lose":
        assert scripts.LOSE(app.redis, [p], [60, d.id, d.attempt, "gone", "", "1"]) == ["pending"]
    elif path == "requeue":
        assert scripts.REQUEUE(app.redis, [p], [d.id, "admin"]) == "running"
    else:
        assert scripts.RECOVER(app.redis, [p], [0, 10, "admin"]) == [d.id]
    assert app.redis.scard(p + "slots:k") == 0 and app.redis.llen(p + "wake") == 1
    [d2] = consumer.claim(1)
    assert d2.id in (job.id, waiting.id)  # job when it went back in line, next in line
    assert app.redis.smembers(p + "slots:k") == {d2.id}


def test_a_slot_whose_delivery_is_gone_is_taken_back(app):
    """No path leaves a slot behind, but if one did (a holder id without a holding entry),
    the claim that finds the key full drops it rather than wait for ever."""
    p = app.keys.q("default")
    app.redis.sadd(p + "slots:k", "ghost")
    flow_apps.capped_hold.apply_async(("x",), concurrency_key="k")
    [d] = Consumer(app, ["default"]).claim(1)
    assert app.redis.smembers(p + "slots:k") == {d.id}


def test_a_producer_without_the_app_gets_the_declared_limits(app):
    """enqueue.lua fills rate_limit and max_concurrency in from the task's declaration, as
    the other settings; a concurrency_key sent alone then counts against it."""
    declarations.publish(app, ["default"], "w1", 0.0)
    scripts.ENQUEUE(app.redis, [app.keys.q("default")], [2, "j1", 0, 1, "task", "tests.flow_apps.limited",
                                                         "j2", 0, 2, "task", "tests.flow_apps.capped",
                                                         "concurrency_key", "customer:7"])
    j1, j2 = app.job("j1", "default").data, app.job("j2", "default").data
    assert j1["rate_limit"] == "20/s" and "max_concurrency" not in j1
    assert j2["max_concurrency"] == "2" and j2["concurrency_key"] == "customer:7" and "rate_limit" not in j2
    assert app.redis.hget(app.keys.q("default") + "meta", "flow") == "1"


def test_jobs_behind_a_throttled_one_go_ahead_and_the_claim_says_when_to_come_back(app):
    """In one queue, jobs whose task has no token left stay in line, in order, and the jobs
    of other tasks behind them are claimed (within the FLOW_WINDOW oldest); the claim's
    answer ends with the seconds until the held-back task's next token."""
    held = [flow_apps.trickle.apply_async((i,), queue="default") for i in range(3)]
    other = app.enqueue("tests.apps.add", [1, 2])
    consumer = Consumer(app, ["default"])
    argv = claim_args(app, consumer.name, "h", "127.0.0.1", [os.getpid(), ""] * 4)
    consumer.heartbeat()
    answer = scripts.CLAIM(app.redis, [app.keys.q("default")], argv)
    got, wait = decode(answer, ["default"])
    assert [d.id for d in got] == [held[0].id, other.id]
    assert 3599 < wait <= 3600
    pending = app.redis.lrange(app.keys.q("default") + "pending", 0, -1)
    assert pending[::-1] == [held[1].id, held[2].id]  # oldest on the right, as before
    assert consumer.claim(4) == []


def test_a_lone_claim_looks_past_many_held_back_jobs_and_no_further_than_the_window(app):
    """A claim for one job reads on (k, then doubling) past the held-back jobs, up to the
    100 oldest: a job behind 30 throttled ones is claimed, one behind 100 is not yet."""
    consumer = Consumer(app, ["default"])
    held = [flow_apps.trickle.apply_async((i,), queue="default") for i in range(31)]
    near = app.enqueue("tests.apps.add", [1, 2])
    assert [d.id for d in consumer.claim(1)] == [held[0].id]  # the task's one token this hour
    assert [d.id for d in consumer.claim(1)] == [near.id]
    for i in range(70):
        flow_apps.trickle.apply_async((i,), queue="default")
    far = app.enqueue("tests.apps.add", [1, 2])  # 100 held-back jobs ahead of it
    assert consumer.claim(1) == [] and far.refresh().state == "pending"
    assert app.redis.llen(app.keys.q("default") + "pending") == 101
