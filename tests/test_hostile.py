"""Hostile input: arbitrary JSON, huge payloads, odd names, bad cron strings, junk options,
and records corrupted straight in Redis. Each gets a clear error or ends `failed` with a
reason, while a real worker and dispatcher keep running. Fuzzed with hypothesis (bounded:
the file runs in well under a minute)."""

from __future__ import annotations

import functools
import json
import math
import socket

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dashboard import create_app
from taskrunner import TaskRunner
from taskrunner.cli import main
from taskrunner.client.consumer import Consumer
from taskrunner.errors import InvalidName, JobFailed, NotJSONError, PayloadTooLarge, TaskRunnerError
from taskrunner.ops import queue as queues
from taskrunner.ops.dispatcher import Dispatcher
from taskrunner.protocol import codec
from taskrunner.protocol.connection import connect, server_time
from tests import apps
from tests.conftest import wait_for

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
#: Names that matter: Redis Cluster hash tags ({}), key separators (:), spaces, unicode,
#: control characters, empty, reserved ("_" is the global keys' tag), the length limit.
NASTY_NAMES = ["", " ", "{", "}", "{x}", "a}b", "a{b}c", "a:b", "a b", "é", "名前", "a\nb", "a\x00b", "_", "-a",
               "x" * 200, "x" * 201, "a/b", "a*b", "a?b", "[a]", "a\\b"]
NAMES = st.sampled_from(NASTY_NAMES) | st.text(max_size=210)
DEEP = functools.reduce(lambda v, _: [v], range(300), [])
JUNK = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
        | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def noop() -> None:
    """A task for schedules: fired in these tests, never run."""


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes: between the first { and the next }."""
    start = key.index("{")
    return key[start + 1:key.index("}", start + 1)]


def cli(app: TaskRunner, *args: str):
    """The `taskrunner` command in this process, on the test's Redis and key prefix (the
    fuzzers run it hundreds of times: a process each would take minutes)."""
    env = {"REDIS_URL": app.settings.redis_url, "TASKRUNNER_PREFIX": app.settings.prefix}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def test_any_json_arguments_reach_the_task_and_come_back_unchanged(app, stack):
    stack.worker(concurrency=1)

    @FUZZ
    @given(args=st.lists(JSON, max_size=4), kwargs=st.dictionaries(st.text(), JSON, max_size=4))
    def check(args, kwargs):
        job = apps.add.delay(args, [])  # add(a, b) is a + b: the worker echoes the list
        assert app.job(app.enqueue("tests.apps.anything", [], kwargs, queue="unserved").id).to_dict()["kwargs"] \
            == kwargs
        assert job.wait(30) == args

    check()


@pytest.mark.parametrize("value, why", [
    (float("nan"), "NaN"), ([1, {"a": float("inf")}], "infinity"), (-float("inf"), "infinity"),
    (2**64, "64-bit"), ({1: "a"}, "key must be str"), ("\ud800", "surrogates"), (DEEP, "Recursion limit"),
])
def test_values_json_cannot_carry_are_refused_never_coerced(app, value, why):
    with pytest.raises(NotJSONError, match=why):
        apps.add.delay(value, 1)
    with pytest.raises(NotJSONError, match=why):
        apps.add.apply_async([], {"a": value})
    assert app.queue_names() == []


@pytest.mark.parametrize("args, message", [
    ("[NaN]", "NaN"), ("[1e999]", "infinity"), ("[" * 100_000, "not valid JSON"), ("[18446744073709551616]", "64-bit"),
])
def test_cli_refuses_what_json_cannot_carry(app, stack, args, message):
    r = stack.cli("enqueue", "tests.apps.add", "--args", args)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    assert app.queue_names() == []


@pytest.mark.parametrize("option", ["queue", "delay", "max_duration", "retries", "block_timeout", "job_id",
                                    "retry_backoff", "max_lost", "timeout_policy"])
@settings(FUZZ, max_examples=40)
@given(value=JUNK | st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, -0.5, True, "1", 10**400]))
def test_junk_options_are_refused_by_name_or_stored_sane(app, option, value):
    """Whatever a caller passes, the record a worker reads has numbers where it expects them."""
    name = {"queue": "queue name", "job_id": "job id"}.get(option, option)
    try:
        job = app.enqueue("tests.apps.add", [1, 2], **{"block_timeout": 0, option: value})
    except (TaskRunnerError, ValueError, TypeError) as e:
        assert name in str(e), str(e)
        return
    d = job.refresh().to_dict()
    assert math.isfinite(d["max_duration"]) and d["max_duration"] > 0
    assert math.isfinite(d["retry_backoff"]) and d["retry_backoff"] >= 0
    assert isinstance(d["retries"], int) and d["retries"] >= 0 and isinstance(d["max_lost"], int) and d["max_lost"] > 0
    assert d["timeout_policy"] in ("kill", "flag") and d["state"] in ("pending", "delayed")
    assert job.delete()


@FUZZ
@given(queue=NAMES, task=NAMES, job_id=NAMES)
def test_odd_names_are_refused_clearly_or_keep_every_key_in_one_slot(app, queue, task, job_id):
    for kind, call in [("queue", lambda: app.enqueue("tests.apps.add", [1, 2], queue=queue)),
                       ("task", lambda: app.enqueue(task, [1, 2], queue="names")),
                       ("job id", lambda: app.enqueue("tests.apps.add", [1, 2], queue="names", job_id=job_id))]:
        try:
            job = call()
        except InvalidName as e:
            assert f"invalid {kind}" in str(e)
            continue
        keys = [app.keys.q(job.queue) + s for s in ("pending", "items", "meta")] + [app.keys.job(job.queue, job.id)]
        assert {hash_tag(k) for k in keys} == {job.queue}  # one Redis Cluster slot per queue
        assert app.redis.exists(app.keys.job(job.queue, job.id)) and job.delete()


@settings(FUZZ, max_examples=40)
@given(queue=NAMES, task=NAMES, args=st.text(max_size=30) | st.lists(JSON, max_size=3).map(json.dumps))
def test_cli_enqueue_refuses_odd_input_in_one_line(app, queue, task, args):
    r = cli(app, "enqueue", task, "--args", args, "-q", queue)
    if r.exit_code == 0:
        job = app.job(r.stdout.strip())  # stderr: a warning, as no worker declared the task
        assert (job.data["task"], job.queue, codec.loads(job.data["args"])) == (task, queue, json.loads(args))
        job.delete()
    else:
        assert r.exit_code == 2 or r.output.startswith("Error: "), r.output
        assert "Traceback" not in r.output


@pytest.mark.parametrize("name", ["{x}", "a b", "é"])
def test_worker_refuses_an_odd_name_in_one_line(stack, name):
    r = stack.cli("worker", "-A", "tests.apps", "-n", name, "-c", "1")
    assert r.returncode == 2 and "invalid worker name" in r.stderr and "Traceback" not in r.stderr


def test_payload_limit_is_exact_and_named_in_api_cli_and_files(app, stack, tmp_path):
    limit = 1000
    app.configure(max_payload=limit)
    try:
        fits = "x" * (limit - len(b'[""]') - len(b"{}"))
        assert apps.echo.delay(fits).created
        with pytest.raises(PayloadTooLarge, match=f"take {limit + 1} bytes; the limit is {limit} "
                                                  r"\(TASKRUNNER_MAX_PAYLOAD\)"):
            apps.add.delay(fits + "y")
        with pytest.raises(PayloadTooLarge, match="job 2: .*TASKRUNNER_MAX_PAYLOAD"):
            app.enqueue_many([{"task": "tests.apps.add", "args": [1, 2]},
                              {"task": "tests.apps.add", "args": [fits, 1]}])
    finally:
        app.configure(max_payload=1 << 20)
    assert app.redis.llen(app.keys.q("default") + "pending") == 1  # the batch wrote nothing
    stack.env["TASKRUNNER_MAX_PAYLOAD"] = str(limit)
    r = stack.cli("enqueue", "tests.apps.add", "--args", json.dumps([fits + "y"]))
    assert r.returncode == 2 and f"the limit is {limit} (TASKRUNNER_MAX_PAYLOAD)" in r.stderr
    big = app.settings.max_payload + 1  # the default limit (1 MiB), through a file: no argv limit
    del stack.env["TASKRUNNER_MAX_PAYLOAD"]
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"task": "tests.apps.add", "args": ["x" * big, 1]}) + "\n")
    r = stack.cli("enqueue", "--from-file", str(path))
    assert r.returncode == 2 and f"the limit is {1 << 20} (TASKRUNNER_MAX_PAYLOAD)" in r.stderr
    assert app.redis.llen(app.keys.q("default") + "pending") == 1


CRON_TOKENS = st.sampled_from(["*", "*/0", "*/5", "0", "59", "60", "31", "30", "2", "L", "?", "-1", "1-0", "5-1",
                               "a", "#", "@", "1,", "99999999999", "0 0", "", "MON", "FEB", "H", "1/0", "W"])
DAYS = st.sampled_from(["*", "1", "28", "29", "30", "31", "32", "L", "0"])
MONTHS = st.sampled_from(["*", "1", "2", "4", "FEB", "13", "0"])
CRONS = (st.tuples(CRON_TOKENS, CRON_TOKENS, DAYS, MONTHS, CRON_TOKENS).map(" ".join)
         | st.lists(CRON_TOKENS, max_size=7).map(" ".join) | st.text(max_size=30) | JUNK)


@FUZZ
@given(cron=CRONS)
@example(cron="0 0 31 2 *")  # valid to croniter, yet no tick ever: found by this test
@example(cron="0 0 1 1 * 0 1999")  # a last tick, no next one
def test_bad_cron_strings_are_refused_at_declaration(app, cron):
    """A schedule that is accepted has a last and a next tick: the dispatcher can fire it."""
    runner = TaskRunner("cron-fuzz", redis_url=app.settings.redis_url, prefix=f"{app.settings.prefix}c{codec.new_id()}")
    try:
        runner.periodic(cron, name="s")(noop)
    except ValueError as e:
        assert "cron expression" in str(e)
        return
    dispatcher, now = Dispatcher(runner), server_time(runner.redis)
    dispatcher.fire_schedules(now - 10 * 366 * 86400)  # first sight, years ago
    assert dispatcher.fire_schedules(now) == 1  # the latest tick since
    state = codec.loads(runner.redis.hget(runner.keys.schedules, "s"))
    assert state["next"] > state["last"]


def test_schedules_that_could_never_fire_are_refused_at_declaration(app):
    runner = TaskRunner("cron-decl", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "d")
    with pytest.raises(InvalidName, match="job id"):  # cron.<name>.<tick> must be a job id
        runner.periodic("* * * * *", name="s" * 190)(noop)
    with pytest.raises(NotJSONError, match="args is not JSON"):
        runner.periodic("* * * * *", name="objects", args=[object()])(noop)
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        runner.periodic("* * * * *", name="listed", kwargs=[1])(noop)
    assert runner.schedules == {}


def test_a_schedule_that_cannot_fire_does_not_stop_the_others(app):
    runner = TaskRunner("cron-closed", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "e")
    for name in ("blocked", "corrupt", "fine"):
        runner.periodic("* * * * *", name=name)(runner.task(noop, name=f"t.{name}", queue=name))
    queues.create(runner, "blocked")
    queues.close(runner, "blocked")
    dispatcher, now = Dispatcher(runner), server_time(runner.redis)
    assert dispatcher.fire_schedules(now - 120) == 0  # first sight: remembers the tick before
    before = runner.redis.hget(runner.keys.schedules, "blocked")
    runner.redis.hset(runner.keys.schedules, "corrupt", "[1, 2]")
    assert dispatcher.fire_schedules(now) == 1
    assert [runner.redis.llen(runner.keys.q(q) + "pending") for q in ("blocked", "corrupt", "fine")] == [0, 0, 1]
    assert runner.redis.hget(runner.keys.schedules, "blocked") == before  # tried again next pass
    assert codec.loads(runner.redis.hget(runner.keys.schedules, "corrupt"))["cron"] == "* * * * *"


@pytest.mark.parametrize("worker", [["w"], {"w": 1}, None])
def test_a_holding_entry_whose_worker_is_not_a_name_stops_no_harvest(app, worker):
    """held() used to hand an entry's "worker" on as it was: a list or an object there raised
    TypeError (unhashable) in every harvest and every pass that reaped a dead worker. Such
    an entry is not one: left to the deadline sweep, which requeues it."""
    p = app.keys.q("default")
    app.redis.hset(p + "running", "odd", json.dumps({"worker": worker, "attempt": 1}))
    app.redis.hset(p + "running", "fine", json.dumps({"worker": "gone-w", "attempt": 1}))
    app.redis.hset(p + "job:fine", mapping={"state": "running", "attempts": 1, "worker": "gone-w",
                                             "task": "tests.apps.add"})
    app.redis.sadd(p + "processing", "fine")
    assert Dispatcher(app).harvest(["default"]) == {"requeued": 1, "failed": 0, "killed": 0}
    assert app.redis.hkeys(p + "running") == ["odd"]


def wait_failed(app, job_id: str, queue: str = "default") -> JobFailed:
    with pytest.raises(JobFailed) as e:
        app.job(job_id, queue).wait(30)
    return e.value


def test_corrupt_records_fail_or_are_requeued_while_worker_and_dispatcher_run_on(app, stack):
    """Corruption test_api.py does not cover: bytes that are not UTF-8, wrong types, a
    garbage holding entry, control messages, worker info and schedule state."""
    worker = stack.worker(concurrency=2, name="hostile-w")
    dispatcher = stack.dispatcher()
    scheduler = stack.dispatcher(app="tests.cron_app")
    wait_for(lambda: app.redis.zscore(app.keys.workers, "hostile-w"), what="worker heartbeat")
    p, r = app.keys.q("default"), app.redis
    # Junk for every process to read: control messages, worker info, schedule state.
    r.lpush(app.keys.control("hostile-w"), "garbage", '{"kill": [1]}', "[1, 2]", b"\xff\xfe", '{"kill": "x"}')
    r.hset(app.keys.job("default", "types"), "enqueued_at", "yesterday")  # shown as it is
    now = server_time(app.redis)
    for name, info in [("ghost-text", b"not json \xff"), ("ghost-list", "[1, 2]"), ("ghost-types", json.dumps(
            {"host": socket.gethostname(), "pidns": "x", "pid": "abc", "rss": "lots", "queues": 7, "ip": None}))]:
        r.zadd(app.keys.workers, {name: now})
        r.set(app.keys.worker(name), info)
    r.hset(app.keys.schedules, "tests.cron_app.every_second", '{"last": "yesterday"}')
    records = {
        "utf8-args": {"task": "tests.apps.add", "args": b"[\xff]", "kwargs": "{}"},
        "utf8-task": {"task": b"tests.apps.\xffadd", "args": "[1, 2]", "kwargs": "{}"},
        "types": {"task": "tests.apps.boom", "args": '["typed"]', "kwargs": "{}", "retries": "many",
                  "retry_backoff": "slow", "max_lost": "x", "attempts": "x", "timeout_policy": "explode"},
        "sparse": {"task": "tests.apps.add", "args": "[20, 22]"},  # no kwargs, times, settings...
    }
    for job_id, fields in records.items():
        r.hset(p + "job:" + job_id, mapping={"state": "pending", **fields})
        r.sadd(p + "items", job_id)
        r.lpush(p + "pending", job_id)
    assert wait_failed(app, "utf8-args").error_type == "BadArguments"
    assert wait_failed(app, "utf8-task").error_type == "NotRegistered"
    failed = wait_failed(app, "types")
    assert (failed.error_type, failed.message) == ("ValueError", "typed")
    assert app.job("sparse").wait(30) == 42
    # A running job whose holding entry is overwritten: requeued when its deadline passes
    # (nobody can be told to stop it), then run again and completed.
    held = app.enqueue("tests.apps.hold", ["entry", 30], max_duration=0.5, timeout_policy="flag")
    wait_for(lambda: r.hget(p + "running", held.id), what="the job to run")
    r.hset(p + "running", held.id, "garbage{")
    wait_for(lambda: "corrupt" in (held.refresh().data.get("last_lost_reason") or ""), what="requeue")
    r.set(f"{app.settings.prefix}:release:entry", 1)
    assert held.wait(30) == "released"
    wait_for(lambda: r.zscore(app.keys.workers_dead, "ghost-list"), what="ghost workers reaped")
    wait_for(lambda: r.llen(app.keys.q("cron") + "pending"), what="the schedule to fire")
    state = codec.loads(r.hget(app.keys.schedules, "tests.cron_app.every_second"))
    assert isinstance(state["last"], float) and state["next"] > state["last"]
    assert apps.add.delay(2, 3).wait(30) == 5  # and normal work goes on
    for proc in (worker, dispatcher, scheduler):
        assert proc.poll() is None, proc.stdout.read()
    # Pages and commands show every corrupt record as it is.
    r.hset(p + "running", "ghost-job", "[1, 2]")
    web = create_app(app, password="pw").test_client()
    for path in ["/", "/running", "/stuck", "/failed", "/queues/default?state=failed",
                 "/queues/default?state=completed", "/schedules", "/jobs/types", "/jobs/utf8-task", "/jobs/sparse",
                 "/api/overview", "/api/workers"]:
        assert web.get(path).status_code == 200, path
    [ghost] = [row for row in web.get("/api/jobs?state=stuck").get_json() if row["id"] == "ghost-job"]
    assert "its holding entry is not one: '[1, 2]'" in ghost["why"]
    for args in [("workers",), ("jobs",), ("jobs", "--json"), ("status", "types"), ("status", "utf8-task", "--json")]:
        result = cli(app, *args)
        assert result.exit_code == 0, (args, result.output)


def test_nan_backoff_in_a_record_written_by_another_client_still_retries(app):
    """finish.lua computes a retry's due time from the record's retry_backoff; "nan" there
    must not leave the job delayed forever (or fail the script half-way)."""
    r, p = app.redis, app.keys.q("default")
    r.hset(p + "job:nan", mapping={"state": "pending", "task": "t", "args": "[]", "kwargs": "{}", "retries": "1",
                                   "retry_backoff": "nan"})
    r.sadd(p + "items", "nan")
    r.lpush(p + "pending", "nan")
    consumer = Consumer(app, ["default"], name="nan-consumer")
    [delivery] = consumer.claim(1)
    consumer.fail(delivery, "Boom", "retry me")
    state, due = r.hmget(p + "job:nan", "state", "due_at")
    assert state == "pending" or (state == "delayed" and r.zscore(p + "delayed", "nan") is not None
                                  and math.isfinite(float(due))), (state, due)


@pytest.mark.parametrize("url, why", [
    ("redis+sentinel://h1:1,h2/", "the path must be /service or /service/db"),
    ("redis+sentinel://h1/svc/zero", "the path must be /service or /service/db"),
    ("redis+sentinel://h1:70000/svc", "'h1:70000' is not host[:port]"),
    ("redis+sentinel://:secret@h1,,h2/svc", "'' is not host[:port]"),
    ("redis+sentinel://h1/svc?timeout=1", "unknown option 'timeout'"),
    ("redis+sentinel://h1/svc?socket_timeout=soon", "socket_timeout must be a number of seconds"),
    ("redis+cluster://h1:1,h2/0", "a cluster has no path"),
    ("redis+cluster://:secret@h1:70000", "'h1:70000' is not host[:port]"),
    ("redis+cluster://h1?db=1", "unknown option 'db'"),
    # Multi-host URLs, split by hand (urls._split; the good ones in tests/test_urls.py):
    ("redis+cluster://", "no host given"),
    ("redis+cluster:///", "no host given"),
    ("redis+cluster://:secret@/", "no host given"),
    ("redis+cluster://h1,", "'' is not host[:port]"),
    ("redis+cluster://h1:", "'h1:' is not host[:port]"),
    ("redis+cluster://h1:0", "'h1:0' is not host[:port] (a port is 1-65535)"),
    ("redis+cluster://h1:65536", "'h1:65536' is not host[:port] (a port is 1-65535)"),
    ("redis+cluster://h1:123456", "'h1:123456' is not host[:port]"),
    ("redis+cluster://h1:http", "'h1:http' is not host[:port]"),
    ("redis+cluster://h 1", "'h 1' is not host[:port]"),
    ("redis+cluster://::1:7001", "an IPv6 address goes in brackets"),
    ("redis+cluster://[::zz]:7001", "'::zz' is not an IPv6 address"),
    ("redis+cluster://[::1]x:7001", "'[::1]x:7001' is not host[:port]"),
    ("redis+cluster://[::1", "'[::1' is not host[:port]"),
    ("redis+cluster://:secret/x@h1", "must be percent-encoded (%2F, %3F, %23)"),
    ("redis+cluster://:secret?x@h1", "must be percent-encoded (%2F, %3F, %23)"),
    ("redis+cluster://:secret#x@h1", "must be percent-encoded (%2F, %3F, %23)"),
    ("redis+cluster://h1#top", "'#' has no place in it"),
    ("redis+cluster://h1?socket_timeout", "name=value pairs joined by '&'"),
    ("redis+sentinel:h1/svc", "it must start with redis+sentinel://"),
    ("redis+sentinel://h1/svc?sentinel_password=secret&db=1", "unknown option 'db'"),
    ("redis+sentinel://:sec@ret@h1/svc?socket_timeout=-", "socket_timeout must be a number of seconds"),
])
def test_bad_sentinel_and_cluster_urls_say_what_is_expected(url, why):
    with pytest.raises(ValueError) as e:
        connect(url)
    scheme = url.split(":")[0]
    assert why in str(e.value) and f"expected {scheme}://" in str(e.value)
    assert "secret" not in str(e.value) and "ret@" not in str(e.value) and "\n" not in str(e.value)
