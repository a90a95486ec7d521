"""Operations: GET /metrics (and `taskrunner metrics`) read with prometheus_client's own
parser and checked against Redis while real workers and a dispatcher run; /healthz and
/readyz on the dashboard and on a worker's and a dispatcher's --health-port, with Redis up,
down and back."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboard import create_app
from taskrunner.ops import health
from taskrunner.ops.history import read
from tests import apps
from tests.conftest import wait_for


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def q(name: str) -> tuple[tuple[str, str], ...]:
    return (("queue", name),)


def test_metrics_tell_what_redis_holds(app, stack):
    """Two jobs running (hold), three pending behind them, one delayed, one worker of 2
    slots, one dispatcher: each series says so, the dashboard's and the CLI's alike."""
    held = [apps.hold.delay(f"m{i}", 60) for i in range(2)]
    stack.dispatcher()
    stack.worker("--prefetch", "1", "-Q", "default", concurrency=2)
    wait_for(lambda: app.redis.hlen(app.keys.q("default") + "running") == 2, what="both hold jobs running")
    pending = [apps.add.delay(i, i) for i in range(3)]
    apps.add.apply_async((1, 1), delay=3600)
    web = create_app(app, password="", token="").test_client()

    def scrape() -> dict:
        r = web.get("/metrics")
        assert r.status_code == 200 and r.content_type.startswith("text/plain; version=0.0.4")
        return samples(r.get_data(as_text=True))

    # The worker's heartbeat says how many slots are busy: wait for one that has both, and for
    # the dispatcher's first pass (under load it may come after the worker's beat).
    m = wait_for(lambda: (s := scrape())[("taskrunner_worker_slots_busy", ())] == 2
                 and s[("taskrunner_dispatchers_alive", ())] == 1 and s, what="busy slots in a beat, a dispatcher")
    p = app.keys.q("default")
    assert m[("taskrunner_queue_pending", q("default"))] == app.redis.llen(p + "pending") == 3
    assert m[("taskrunner_queue_delayed", q("default"))] == app.redis.zcard(p + "delayed") == 1
    assert m[("taskrunner_queue_running", q("default"))] == 2
    assert m[("taskrunner_queue_stuck", q("default"))] == 0
    assert m[("taskrunner_queue_enqueued_total", q("default"))] == int(app.redis.hget(p + "meta",
                                                                                      "produced_messages")) == 6
    assert m[("taskrunner_queue_claimed_total", q("default"))] == 2
    oldest = float(app.redis.hget(app.keys.job("default", pending[0].id), "enqueued_at"))
    age = m[("taskrunner_queue_oldest_pending_age_seconds", q("default"))]
    assert 0 <= age < 600 and age == pytest.approx(app.redis.time()[0] - oldest, abs=5)
    assert m[("taskrunner_queue_closed", q("default"))] == 0
    assert m[("taskrunner_workers", (("state", "alive"),))] == 1
    assert m[("taskrunner_worker_slots", ())] == 2
    assert m[("taskrunner_dispatchers_alive", ())] == 1
    assert 0 <= next(v for (n, _), v in m.items() if n == "taskrunner_dispatcher_last_pass_age_seconds") < 30
    # The CLI prints the same series.
    out = stack.cli("metrics", "-A", "tests.apps", check=True).stdout
    assert {k for k in samples(out)} == set(m)
    for j in held:
        j.kill()


def test_metrics_count_stuck_jobs_and_empty_queues(app, stack):
    """A queue with nothing pending has an oldest age of 0; a job held by a worker that is
    gone counts as stuck."""
    web = create_app(app, password="", token="").test_client()
    apps.add.delay(1, 2)
    app.redis.delete(app.keys.q("default") + "pending", app.keys.q("default") + "items")
    app.redis.hset(app.keys.q("default") + "running", "ghost", json.dumps(
        {"worker": "nobody.1", "host": "h", "ip": "127.0.0.1", "pid": 1, "started_at": 1.0, "max_duration": 5,
         "attempt": 1}))
    m = samples(web.get("/metrics").get_data(as_text=True))
    assert m[("taskrunner_queue_oldest_pending_age_seconds", q("default"))] == 0
    assert m[("taskrunner_queue_stuck", q("default"))] == 1
    assert m[("taskrunner_workers", (("state", "alive"),))] == 0


def test_metrics_token(app, monkeypatch):
    """With TASKRUNNER_METRICS_TOKEN set, /metrics needs it as a bearer token (the API's
    token does not do), and the rest of the dashboard is unchanged."""
    monkeypatch.setenv("TASKRUNNER_METRICS_TOKEN", "scrape-me")
    web = create_app(app, password="pw", token="api-token").test_client()
    assert web.get("/metrics").status_code == 401
    assert web.get("/metrics", headers={"Authorization": "Bearer api-token"}).status_code == 401
    r = web.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
    assert r.status_code == 200 and "taskrunner_queue_pending" in r.get_data(as_text=True)


def test_dashboard_health_with_redis_down_and_back(tmp_path, monkeypatch):
    """/healthz answers whatever Redis does; /readyz is 503 with the reason while Redis is
    down or no dispatcher runs, 200 once both are there."""
    from taskrunner import TaskRunner
    from taskrunner.ops.redis_server import RedisServer

    server = RedisServer(tmp_path, appendonly=False)
    runner = TaskRunner("health", redis_url=server.url)
    try:
        web = create_app(runner, password="", token="").test_client()
        assert web.get("/healthz").status_code == 200
        r = web.get("/readyz")
        assert r.status_code == 503 and "cannot reach Redis" in r.get_json()["reason"]
        server.start()
        r = web.get("/readyz")
        assert r.status_code == 503 and "no dispatcher" in r.get_json()["reason"]
        entry = {"name": "d1", "last_pass": runner.redis.time()[0]}
        runner.redis.hset(runner.keys.dispatchers, "d1", json.dumps(entry))
        r = web.get("/readyz")
        assert r.status_code == 200 and r.get_json() == {"ready": True, "dispatchers": 1}
        server.stop()
        assert web.get("/healthz").status_code == 200
        assert web.get("/readyz").status_code == 503
    finally:
        server.stop()


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health_url(p) -> str:
    """The address a process started with --health-port ...:0 logged."""
    found: list[str] = []

    def logged() -> bool:
        m = re.search(r"health checks on (http://[\d.]+:\d+)/healthz", p.stdout.readline())
        if m:
            found.append(m.group(1))
        return bool(m)

    wait_for(logged, what="the health address in the log")
    return found[0]


def test_health_port_of_a_worker_and_a_dispatcher(app, stack):
    """A worker's /readyz waits for a dispatcher; both processes answer /healthz."""
    w = _health_url(stack.worker("--health-port", "127.0.0.1:0"))
    assert _get(w + "/healthz") == (200, {"alive": True})
    status, body = _get(w + "/readyz")
    assert status == 503 and "no dispatcher" in body["reason"]
    d = _health_url(stack.spawn("dispatcher", "-A", "tests.apps", "--health-port", "0"))
    assert _get(d + "/healthz") == (200, {"alive": True})
    wait_for(lambda: _get(w + "/readyz")[0] == 200, what="the worker ready once the dispatcher passed")
    assert _get(w + "/nope")[0] == 404


def test_a_bad_health_port_is_refused_in_one_line(app, stack):
    r = stack.cli("worker", "-A", "tests.apps", "--health-port", "localhost:http")
    assert r.returncode == 2 and "--health-port" in r.stderr and "HOST:PORT" in r.stderr


def test_liveness_says_when_the_loop_stopped_going_round():
    check = health.liveness(lambda: 12.5, 10, "worker")
    assert check() == (False, {"alive": False, "reason": "the worker's loop last went round 12 s ago (more than 10 s)"})
    assert health.liveness(lambda: 0.2, 10, "worker")() == (True, {"alive": True})
    assert health.parse_address("8080") == ("127.0.0.1", 8080)
    assert health.parse_address("0.0.0.0:9") == ("0.0.0.0", 9)
    with pytest.raises(ValueError):
        health.parse_address("70000")


def _stream_truth(app, queue: str = "default") -> dict[tuple[str, str], int]:
    """(task, state) -> history records, read from the stream itself."""
    out: dict[tuple[str, str], int] = {}
    for _, f in read(app.redis.xrange(app.keys.q(queue) + "history")):
        out[(f["task"], f["state"])] = out.get((f["task"], f["state"]), 0) + 1
    return out


def test_job_counts_and_histograms_from_the_history(app, stack):
    """taskrunner_jobs_total matches the history stream entry for entry (completed, failed,
    retried); the run-time histogram counts every ended delivery, the queue wait every first
    one; a second read counts nothing twice."""
    web = create_app(app, password="", token="").test_client()
    stack.dispatcher()  # promotes the retry of flaky
    stack.worker(concurrency=2)
    adds = [apps.add.delay(i, i) for i in range(7)]
    booms = [apps.boom.delay(f"b{i}") for i in range(2)]
    flaky = apps.flaky.delay("fl", 2)  # fails once (requeued), then completes
    for j in [*adds, flaky]:
        j.wait(timeout=30)
    for j in booms:
        wait_for(lambda j=j: j.refresh().state == "failed", what="boom failed")
    truth = _stream_truth(app)
    assert truth[("tests.apps.add", "completed")] == 7 and truth[("tests.apps.boom", "failed")] == 2
    assert truth[("tests.apps.flaky", "requeued")] == 1
    for _ in range(2):  # read twice: the second counts nothing again
        m = samples(web.get("/metrics").get_data(as_text=True))
        counted = {(dict(labels)["task"], dict(labels)["outcome"]): v for (n, labels), v in m.items()
                   if n == "taskrunner_jobs_total"}
        assert counted == truth
    assert m[("taskrunner_job_runtime_seconds_count", (("queue", "default"), ("task", "tests.apps.add")))] == 7
    assert m[("taskrunner_job_runtime_seconds_bucket",
              (("le", "+Inf"), ("queue", "default"), ("task", "tests.apps.add")))] == 7
    assert m[("taskrunner_job_runtime_seconds_count", (("queue", "default"), ("task", "tests.apps.boom")))] == 2
    assert m[("taskrunner_job_queue_wait_seconds_count", (("queue", "default"), ("task", "tests.apps.flaky")))] == 1
    assert 0 <= m[("taskrunner_job_runtime_seconds_sum", (("queue", "default"), ("task", "tests.apps.add")))] < 70


def test_the_archiver_counts_what_it_trims_while_metrics_are_read(app, stack, tmp_path):
    """With metrics read lately, archiving (which trims the stream) loses no count; the
    counts then equal every delivery, archived or not."""
    pytest.importorskip("pyarrow")
    from taskrunner.ops.history import Archiver

    web = create_app(app, password="", token="").test_client()
    samples(web.get("/metrics").get_data(as_text=True))  # metrics are read: the archiver counts too
    stack.worker(concurrency=2)
    for j in [apps.add.delay(i, 1) for i in range(5)]:
        j.wait(timeout=30)
    Archiver(app, str(tmp_path)).archive(["default"])
    assert app.redis.xlen(app.keys.q("default") + "history") == 0
    for j in [apps.add.delay(i, 2) for i in range(3)]:
        j.wait(timeout=30)
    m = samples(web.get("/metrics").get_data(as_text=True))
    labels = (("outcome", "completed"), ("queue", "default"), ("task", "tests.apps.add"))
    assert m[("taskrunner_jobs_total", labels)] == 8


def test_tally_refuses_a_bad_count_and_skips_hostile_task_names(app):
    from redis.exceptions import ResponseError

    from taskrunner.protocol import scripts

    with pytest.raises(ResponseError, match="the most records to count, a whole number >= 1"):  # records, not entries
        scripts.TALLY(app.redis, [app.keys.q("default")], ["0"])
    app.redis.xadd(app.keys.q("default") + "history", {"task": "a|b", "state": "completed", "started_at": "x"})
    assert scripts.TALLY(app.redis, [app.keys.q("default")], [10]) == 1
    assert app.redis.hget(app.keys.q("default") + "stats", "jobs|?|completed") == "1"


def test_tally_counts_entries_of_every_shape(app):
    """The history stream holds entries of an older worker (a field each), of this one's
    single finishes (values packed in `v`) and of its batches (`jobs`, three lines a record):
    tally.lua counts every record alike."""
    from taskrunner.protocol import scripts

    p = app.keys.q("default")
    app.redis.xadd(p + "history", {"id": "a", "task": "t", "queue": "default", "state": "completed", "attempt": "1",
                                   "enqueued_at": "100", "started_at": "100.5", "finished_at": "101.5",
                                   "worker": "w", "host": "h", "pid": "1", "error_type": ""})
    app.redis.xadd(p + "history", {"id": "b", "v": "completed 1 100 100.5 101.5 1 t w a host"})
    app.redis.xadd(p + "history", {"id": "c", "v": "failed 2 100 100.5 101 1 t w h", "error_type": "E"})
    app.redis.xadd(p + "history", {"jobs": "d\ncompleted 1 100 100.5 101.5 1 t w h\n\n"
                                           "e\nrequeued 1 100 100.5 101 1 u w h\nWorkerLost"})
    assert scripts.TALLY(app.redis, [p], [10]) == 5
    stats = app.redis.hgetall(p + "stats")
    assert (stats["jobs|t|completed"], stats["jobs|t|failed"], stats["jobs|u|requeued"]) == ("3", "1", "1")
    assert (stats["run|t|8"], stats["run|t|7"], float(stats["run_sum|t"])) == ("3", "1", 3.5)
    assert (stats["wait|t|7"], float(stats["wait_sum|t"])) == ("3", 1.5)  # attempt 1 only


def test_tally_bounds_a_call_by_records_and_reads_whole_entries(app):
    """ARGV[1] bounds the records a call counts (an entry may hold a batch of them): it reads
    whole entries until it has counted that many, and the next call goes on from there."""
    from taskrunner.protocol import scripts

    p = app.keys.q("default")
    batch = "\n".join(f"j{i}\ncompleted 1 100 100.5 101 1 t w h\n" for i in range(4))
    for _ in range(3):
        app.redis.xadd(p + "history", {"jobs": batch})
    assert scripts.TALLY(app.redis, [p], [6]) == 8  # two whole entries
    assert scripts.TALLY(app.redis, [p], [6]) == 4
    assert scripts.TALLY(app.redis, [p], [6]) == 0
    assert app.redis.hget(p + "stats", "jobs|t|completed") == "12"


def test_canceled_steps_are_in_the_history_the_metrics_and_the_archive(app, stack, tmp_path):
    """A workflow step canceled by its failed parent writes a history entry (state canceled,
    attempt 0, never started), so metrics count outcome canceled and the archive holds it."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from taskrunner.ops.history import Archiver

    web = create_app(app, password="", token="").test_client()
    stack.worker()
    handle = (apps.boom.si("bad") | apps.add.s(1) | apps.mul.s(2)).delay()
    with pytest.raises(Exception, match="bad"):
        handle.wait(30)
    canceled = [f for _, f in read(app.redis.xrange(app.keys.q("default") + "history"))
                if f["state"] == "canceled"]
    assert sorted(f["task"] for f in canceled) == ["tests.apps.add", "tests.apps.mul"]
    assert {(f["attempt"], f["started_at"], f["worker"], f["error_type"]) for f in canceled} == {
        ("0", "", "", "Canceled")}
    assert handle.id in {f["id"] for f in canceled}
    m = samples(web.get("/metrics").get_data(as_text=True))
    for task in ("tests.apps.add", "tests.apps.mul"):
        assert m[("taskrunner_jobs_total", (("outcome", "canceled"), ("queue", "default"), ("task", task)))] == 1
        # never ran: no run time, no queue wait
        assert ("taskrunner_job_runtime_seconds_count", (("queue", "default"), ("task", task))) not in m
    assert m[("taskrunner_queue_canceled", q("default"))] == 2
    Archiver(app, str(tmp_path)).archive(["default"])
    [path] = tmp_path.glob("date=*/queue=default/*.parquet")
    rows = pq.read_table(path).to_pylist()
    assert sorted(r["task"] for r in rows if r["state"] == "canceled") == ["tests.apps.add", "tests.apps.mul"]
    assert {r["runtime"] for r in rows if r["state"] == "canceled"} == {None}
