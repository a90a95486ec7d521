"""Task declarations and the defensive enqueue script (docs/PROTOCOL.md, "Enqueue" and
"Task declarations"): what enqueue.lua refuses by itself, whatever client calls it; that
it registers its queue; that workers publish their tasks' settings and every producer,
the CLI without -A and raw EVALSHA callers included, gets them."""

from __future__ import annotations

import json

import orjson
import pytest
import redis

from taskrunner.client import declarations
from taskrunner.errors import InvalidName, NotJSONError, PayloadTooLarge
from taskrunner.protocol import scripts
from tests import declared_app
from tests.conftest import ROOT, wait_for

SCRIPTS = ROOT / "taskrunner" / "protocol" / "scripts"


class Raw:
    """A producer that knows only the protocol: raw EVALSHA of enqueue.lua."""

    def __init__(self, url: str, prefix: str):
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.bytes = redis.Redis.from_url(url)
        self.prefix = prefix
        source = (SCRIPTS / "_lib.lua").read_text() + "\n" + (SCRIPTS / "enqueue.lua").read_text()
        self.sha = self.r.script_load(source)

    def q(self, queue: str) -> str:
        return f"{self.prefix}:{{{queue}}}:"

    def enqueue(self, keys: list[str], *argv) -> list[int]:
        return self.r.evalsha(self.sha, len(keys), *keys, *argv)

    def job(self, job_id: str, *fields: str) -> list:
        """ARGV of one job: its id, delay 0, then the field/value pairs given."""
        return [1, job_id, 0, len(fields) // 2, *fields]

    def snapshot(self) -> dict[str, bytes]:
        """Every key of the prefix with its content: what a refused call must leave as it was."""
        return {k: self.bytes.dump(k) for k in self.bytes.scan_iter(match=f"{self.prefix}:*")}


GOOD = ("task", "t.good", "args", "[1]", "kwargs", "{}")


@pytest.fixture
def raw(app) -> Raw:
    return Raw(app.settings.redis_url, app.settings.prefix)


BAD = [  # (what the call is, KEYS' queue, ARGV of one job after GOOD's job, kind, words of the message)
    ("bad job id", "default", ["bad id!", 0, 1, "task", "t"], "InvalidName", "invalid job id"),
    ("empty job id", "default", ["", 0, 1, "task", "t"], "InvalidName", "invalid job id"),
    ("job id of 201 characters", "default", ["x" * 201, 0, 1, "task", "t"], "InvalidName", "1-200"),
    ("no task", "default", ["j2", 0, 1, "args", "[]"], "BadCall", "task field is required"),
    ("bad task name", "default", ["j2", 0, 1, "task", "-t"], "InvalidName", "invalid task name"),
    ("args not JSON", "default", ["j2", 0, 2, "task", "t", "args", "[1,"], "NotJSON", "args is not JSON"),
    ("args NaN", "default", ["j2", 0, 2, "task", "t", "args", "[NaN]"], "NotJSON", "args is not JSON"),
    ("args overflow a double", "default", ["j2", 0, 2, "task", "t", "args", "[1e999]"], "NotJSON", "too large"),
    ("args an object", "default", ["j2", 0, 2, "task", "t", "args", '{"a": 1}'], "NotJSON", "not a JSON array"),
    ("args a string", "default", ["j2", 0, 2, "task", "t", "args", '"x"'], "NotJSON", "not a JSON array"),
    ("kwargs an array", "default", ["j2", 0, 2, "task", "t", "kwargs", "[1]"], "NotJSON", "not a JSON object"),
    ("kwargs not JSON", "default", ["j2", 0, 2, "task", "t", "kwargs", "{a}"], "NotJSON", "kwargs is not JSON"),
    ("headers an array", "default", ["j2", 0, 2, "task", "t", "headers", "[1]"], "NotJSON",
     "headers is not a JSON object"),
    ("headers not JSON", "default", ["j2", 0, 2, "task", "t", "headers", "{a}"], "NotJSON", "headers is not JSON"),
    ("headers empty", "default", ["j2", 0, 2, "task", "t", "headers", ""], "NotJSON", "headers is not a JSON object"),
    ("negative max_duration", "default", ["j2", 0, 2, "task", "t", "max_duration", "-1"], "BadValue",
     "max_duration must be a number of seconds > 0"),
    ("zero max_duration", "default", ["j2", 0, 2, "task", "t", "max_duration", "0"], "BadValue", "max_duration"),
    ("text max_duration", "default", ["j2", 0, 2, "task", "t", "max_duration", "soon"], "BadValue", "max_duration"),
    ("nan max_duration", "default", ["j2", 0, 2, "task", "t", "max_duration", "nan"], "BadValue", "max_duration"),
    ("infinite max_duration", "default", ["j2", 0, 2, "task", "t", "max_duration", "inf"], "BadValue",
     "max_duration"),
    ("max_duration past 2^53", "default", ["j2", 0, 2, "task", "t", "max_duration", "1e300"], "BadValue",
     "< 2^53"),
    ("zero soft_limit", "default", ["j2", 0, 2, "task", "t", "soft_limit", "0"], "BadValue",
     "soft_limit must be a number of seconds > 0"),
    ("soft_limit past max_duration", "default", ["j2", 0, 3, "task", "t", "max_duration", "10", "soft_limit", "10"],
     "BadValue", "soft_limit (10s) must be less than max_duration (10s)"),
    ("fractional retries", "default", ["j2", 0, 2, "task", "t", "retries", "1.5"], "BadValue", "whole number"),
    ("negative retries", "default", ["j2", 0, 2, "task", "t", "retries", "-1"], "BadValue", "retries"),
    ("retries past 2^31", "default", ["j2", 0, 2, "task", "t", "retries", "2147483648"], "BadValue", "retries"),
    ("zero max_lost", "default", ["j2", 0, 2, "task", "t", "max_lost", "0"], "BadValue", "max_lost"),
    ("negative backoff", "default", ["j2", 0, 2, "task", "t", "retry_backoff", "-0.5"], "BadValue",
     "retry_backoff"),
    ("unknown policy", "default", ["j2", 0, 2, "task", "t", "timeout_policy", "maybe"], "BadValue", "kill or flag"),
    ("a field the script owns", "default", ["j2", 0, 2, "task", "t", "state", "completed"], "BadCall",
     "unknown field"),
    ("a field twice", "default", ["j2", 0, 2, "task", "t", "task", "u"], "BadCall", "given twice"),
    ("another queue's name", "default", ["j2", 0, 2, "task", "t", "queue", "other"], "BadValue", "queue"),
    ("text delay", "default", ["j2", "later", 1, "task", "t"], "BadValue", "delay"),
    ("negative delay", "default", ["j2", -5, 1, "task", "t"], "BadValue", "delay"),
    ("fewer pairs than K", "default", ["j2", 0, 3, "task", "t"], "BadCall", "field/value pairs"),
    ("bad queue name", "-bad", ["j2", 0, 1, "task", "t"], "InvalidName", "queue name"),
    ("empty queue name", "", ["j2", 0, 1, "task", "t"], "InvalidName", "queue name"),
]


@pytest.mark.parametrize("what,queue,job,kind,words", BAD, ids=[b[0] for b in BAD])
def test_enqueue_script_refuses_bad_input_clearly_and_changes_nothing(raw, what, queue, job, kind, words):
    """Each bad job, sent after a good one in the same call: one clear error naming what is
    wrong, and not even the good job is written."""
    raw.r.hset(raw.q(queue) + "meta", "bound", 0)  # the queue exists, so a change would show
    before = raw.snapshot()
    with pytest.raises(redis.ResponseError) as e:
        raw.enqueue([raw.q(queue)], 2, "j1", 0, len(GOOD) // 2, *GOOD, *job)
    message = str(e.value)
    assert message.startswith(f"taskrunner: {kind}: ") and words in message and "\n" not in message, message
    assert "script:" not in message  # a reply of ours, not a Lua error with its location
    assert raw.snapshot() == before


def test_keys_and_argv_layout_are_checked(raw):
    before = raw.snapshot()
    for keys, argv, words in [
        ([raw.q("default")], ["x"], r"ARGV\[1\] must be the number of jobs"),
        ([raw.q("default"), raw.q("other") + "queues"], [1, "j", 0, 1, "task", "t"], r"KEYS\[2\] must be"),
        (["no-braces"], [1, "j", 0, 1, "task", "t"], r"KEYS\[1\] must be"),
        ([raw.q("default")], [1, "j", 0, 1, "task", "t", 100, "extra"], "only the payload limit"),
        ([raw.q("default")], [1, "j", 0, 1, "task", "t", "lots"], "only the payload limit"),
    ]:
        with pytest.raises(redis.ResponseError, match=words):
            raw.enqueue(keys, *argv)
    assert raw.snapshot() == before


def test_payload_limit_is_enforced_by_the_script(raw):
    before = raw.snapshot()
    big = json.dumps(["x" * (1 << 20)])  # over the default limit of 1 MiB
    with pytest.raises(redis.ResponseError, match=r"PayloadTooLarge: job j: args, kwargs and headers take "
                                                  r"1048582 bytes; the limit is 1048576"):
        raw.enqueue([raw.q("default")], *raw.job("j", "task", "t", "args", big))
    with pytest.raises(redis.ResponseError, match="the limit is 100"):  # a producer's own, lower limit
        raw.enqueue([raw.q("default")], *raw.job("j", "task", "t", "args", json.dumps(["x" * 100])), 100)
    assert raw.snapshot() == before
    assert raw.enqueue([raw.q("default")], *raw.job("j", "task", "t", "args", json.dumps(["x" * 90])), 100) == [1]


def test_python_sees_a_script_refusal_as_its_usual_exception(app):
    """A refusal reaching Python (a check only the script makes, or a caller of the script
    itself) is raised as the exception Python's own checks raise."""
    q = app.keys.q("default")
    for argv, kind in [([1, "bad id", 0, 1, "task", "t"], InvalidName),
                       ([1, "j", 0, 2, "task", "t", "args", "[NaN]"], NotJSONError),
                       ([1, "j", 0, 2, "task", "t", "args", "[1]", 2], PayloadTooLarge),
                       ([1, "j", 0, 2, "task", "t", "retries", "x"], ValueError)]:
        with pytest.raises(kind, match="^job|^invalid"):
            scripts.ENQUEUE(app.redis, [q], argv)
        batch = scripts.Batch(app.redis)
        batch.call(scripts.ENQUEUE, [q], argv)
        with pytest.raises(kind):
            batch.execute()


NOT_STRICT = ["[+1]", "[ +1]", "[0x10]", "[-0X10]", "[01]", "[-01]", "[1, 00]", "[Infinity]", "[-Infinity]", "[inf]",
              "[-inF]", "[NaN]", "[nan]", "[-nan]", '{"a": +1}', '{"a":0x1}', '{"a":\n\tInf}', "[1e999]", "[1E+400]",
              "[-1e999]", '["x", 1, 0x1]']
STRICT = ['["+1", "0x10", "Infinity", "nan", "01", "inf"]', "[0, -0, 0.5, -0.5, 0e1, null, 1e308, 10, 100, -1]",
          '{"inf": "NaN", "n": null, "z": 0}', '[{"a": 0}, [0], true, false]', '["a,+1", "b:0x1", "[nan"]']


@pytest.mark.parametrize("text", NOT_STRICT)
def test_args_and_kwargs_must_be_strict_json_wherever_a_number_may_start(raw, text):
    """cjson's shared decoder takes +1, hex, leading zeros, inf and nan; the script uses it
    only for text where none of those can be, and the strict decoder for the rest: each of
    these is refused, as args and as kwargs."""
    field, value = ("kwargs", text) if text.startswith("{") else ("args", text)
    with pytest.raises(redis.ResponseError, match=f"NotJSON: job j: {field} (is not JSON|holds a number too large)"):
        raw.enqueue([raw.q("default")], *raw.job("j", "task", "t", field, value))
    assert raw.snapshot() == {}


def test_strict_json_with_those_characters_elsewhere_is_taken_as_sent(raw):
    for n, text in enumerate(STRICT):
        field = "kwargs" if text.startswith("{") else "args"
        assert raw.enqueue([raw.q("default")], *raw.job(f"j{n}", "task", "t", field, text)) == [1]
        assert raw.r.hget(raw.q("default") + f"job:j{n}", field) == text


def test_a_batch_past_a_chunk_keeps_order_bound_and_counts(raw):
    """The script pushes the ids of a batch's pending jobs a chunk (1000) at a time: what a
    call of 2500 jobs leaves is what 2500 lone enqueues would, bound and duplicates included."""
    q = raw.q("default")
    raw.r.hset(q + "meta", "bound", 2200)
    argv = [2502]
    for n in range(2500):
        argv += [f"j{n}", 0, 2, "task", "t", "args", f"[{n}]"]
    argv += ["j5", 0, 1, "task", "t", "late", 60, 1, "task", "t"]  # a duplicate id; a delayed job
    answer = raw.enqueue([q], *argv)
    assert answer == [1] * 2200 + [-1] * 300 + [0, 1]
    assert raw.r.lrange(q + "pending", 0, -1) == [f"j{n}" for n in reversed(range(2200))]
    assert raw.r.scard(q + "items") == 2200 and raw.r.lrange(q + "wake", 0, -1) == ["1"]
    assert raw.r.zrange(q + "delayed", 0, -1) == ["late"] and raw.r.hget(q + "job:late", "state") == "delayed"
    assert raw.r.hmget(q + "meta", "produced_messages", "produced_bytes") == ["2201", str(
        sum(len(f"[{n}]") + 2 for n in range(2200)) + 4)]
    assert not raw.r.exists(q + "job:j2200")


def test_numbers_survive_the_round_trip(app, raw):
    """args and kwargs are stored as sent, digit for digit (the script checks them, never
    re-encodes them); number fields are written in plain decimal, as the claim reads them."""
    args = "[9007199254740993, 18446744073709551615, -9223372036854775808, 1.7976931348623157e308, 5e-324, 0.1]"
    fields = ["task", "t", "args", args, "kwargs", '{"big": 123456789012345678901234567890}',
              "max_duration", "2.5e3", "retries", "3.0", "retry_backoff", "0.00001", "max_lost", "0x10"]
    assert raw.enqueue([raw.q("default")], *raw.job("n1", *fields)) == [1]
    record = raw.r.hgetall(raw.q("default") + "job:n1")
    assert record["args"] == args and record["kwargs"] == '{"big": 123456789012345678901234567890}'
    assert orjson.loads(record["args"])[:3] == [2**53 + 1, 2**64 - 1, -(2**63)]  # exact in a Python consumer
    assert (record["max_duration"], record["retries"], record["retry_backoff"], record["max_lost"]) == \
        ("2500", "3", "0.00001", "16")
    # What Python producers send comes back as the same number.
    job = app.enqueue("tests.apps.add", [2**63, 0.1], max_duration=0.1, retries=7)
    assert (job.refresh().data["max_duration"], job.data["retries"]) == ("0.1", "7")
    assert orjson.loads(job.data["args"]) == [2**63, 0.1]


def test_a_raw_delayed_job_is_registered_by_the_script_and_promoted(app, stack, raw):
    """A producer that never SADDs the queue set: the script registers the queue (KEYS[2]),
    so a real dispatcher sweeps it and the delayed job becomes pending when due."""
    assert not raw.r.sismember(app.keys.queues, "rawq")
    stack.dispatcher()
    keys = [raw.q("rawq"), app.keys.queues]
    assert raw.enqueue(keys, 1, "late", 0.3, 1, "task", "t") == [1]
    assert raw.r.sismember(app.keys.queues, "rawq")
    wait_for(lambda: raw.r.hget(raw.q("rawq") + "job:late", "state") == "pending", what="the delayed job promoted")
    assert raw.r.lrange(raw.q("rawq") + "pending", 0, -1) == ["late"]


def test_cli_without_app_gets_the_declared_settings_from_a_running_worker(app, stack):
    """Bug 4: `taskrunner enqueue TASK` without -A ran a task declared max_duration=10 with
    300 s and one declared retries=3 with none. A real worker declares its tasks; the CLI
    (no app) and a raw producer get every setting they did not set, and the queue."""
    stack.worker(app="tests.declared_app", concurrency=1, name="declarer")
    stack.dispatcher(app="tests.declared_app")  # it promotes the retries when due
    wait_for(lambda: app.redis.zscore(app.keys.workers, "declarer"), what="the worker's first heartbeat")
    r = stack.cli("enqueue", "tests.declared_app.flaky", "--args", '["cli", 3]', check=True)
    assert r.stderr == ""  # no warning: the task is declared
    job = app.job(r.stdout.strip())
    assert job.queue == "lane"
    d = job.data
    assert (d["max_duration"], d["retries"], d["retry_backoff"], d["timeout_policy"], d["max_lost"]) == \
        ("10", "3", "0.05", "flag", "2")
    wait_for(lambda: job.state not in ("pending", "delayed", "running"), what="the job to end")
    job.refresh()  # one read of the ended record (refresh().state read the state after the rest: a race)
    assert (job.data["state"], job.data.get("result")) == ("completed", '"ok on try 3"')  # retried as declared
    # What the producer sets is kept; the rest is still the declaration's.
    r = stack.cli("enqueue", "tests.declared_app.quick", "--args", "[1]", "--max-duration", "7", "-q", "lane",
                  check=True)
    job = app.job(r.stdout.strip())
    assert (job.queue, job.data["max_duration"], job.data["retries"]) == ("lane", "7.0", "0")
    assert job.wait(30) == 1
    declared = app.declared("tests.declared_app.flaky")
    assert {k: declared[k] for k in ("queue", "max_duration", "retries", "retry_backoff", "timeout_policy",
                                      "max_lost", "worker")} == {
        "queue": "lane", "max_duration": 10, "retries": 3, "retry_backoff": 0.05, "timeout_policy": "flag",
        "max_lost": 2, "worker": "declarer"}
    # A raw producer gets the same, with no field but the task.
    raw = Raw(app.settings.redis_url, app.settings.prefix)
    assert raw.enqueue([raw.q("lane"), app.keys.queues], *raw.job("raw-1", "task", "tests.declared_app.flaky",
                                                                        "args", '["raw", 1]')) == [1]
    assert raw.r.hget(raw.q("lane") + "job:raw-1", "retries") == "3"
    # The asyncio client and the Python API, for a task they do not import: the same.
    import asyncio

    from taskrunner.client.aio import AsyncClient

    async def enqueue() -> str:
        client = AsyncClient(app)
        try:
            return await client.enqueue("tests.declared_app.flaky", ["aio", 1])
        finally:
            await client.redis.aclose()

    for job in (app.job(asyncio.run(enqueue())), app.enqueue("tests.declared_app.flaky", ["api", 1])):
        assert (job.queue, job.refresh().data["retries"], job.data["max_duration"]) == ("lane", "3", "10")
    # Known tasks are listed by the dashboard.
    from dashboard import create_app

    web = create_app(app).test_client()
    listed = {t["task"]: t for t in web.get("/api/tasks").get_json()}
    assert listed["tests.declared_app.quick"]["max_duration"] == 0.25
    assert listed["tests.declared_app.flaky"]["queue"] == "lane" and listed["tests.declared_app.flaky"]["worker"]
    page = web.get("/tasks").get_data(as_text=True)
    assert "tests.declared_app.flaky" in page and "lane" in page


def test_cli_warns_about_a_task_no_worker_declared_and_still_enqueues_it(app, stack):
    r = stack.cli("enqueue", "nobody.declares.this", "--args", "[1]")
    assert r.returncode == 0, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith("warning: no worker has declared task 'nobody.declares.this'") and "default" in line
    assert app.job(r.stdout.strip()).queue == "default"
    lines = '{"task": "nobody.x", "queue": "q1"}\n{"task": "nobody.x", "queue": "q2"}\n{"task": "nobody.y"}\n'
    r = subprocess_input(stack, lines, "enqueue", "--from-file", "-")
    assert r.returncode == 0 and len(r.stdout.split()) == 3
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: no worker has declared task 'nobody.x' (a typo, or none of its workers started "
                        "yet): enqueued into q1, q2 with default settings",
                        "warning: no worker has declared task 'nobody.y' (a typo, or none of its workers started "
                        "yet): enqueued into default with default settings"]


def test_cli_with_app_refuses_a_task_the_app_does_not_declare(app, stack):
    """With -A, a name the app does not declare used to be enqueued and fail later with
    NotRegistered: now exit 2, one line, nothing enqueued."""
    r = stack.cli("enqueue", "-A", "tests.declared_app", "tests.declared_app.nope", "--args", "[1]")
    assert r.returncode == 2 and r.stdout == ""
    [line] = r.stderr.splitlines()
    assert line.startswith("Error: task 'tests.declared_app.nope' is not declared by app tests.declared_app")
    assert app.queue_names() == []  # not even its queue
    lines = '{"task": "tests.declared_app.quick", "args": [1]}\n{"task": "tests.declared_app.typo"}\n'
    r = subprocess_input(stack, lines, "enqueue", "-A", "tests.declared_app", "--from-file", "-")
    assert r.returncode == 2 and "'tests.declared_app.typo' is not declared" in r.stderr
    assert app.queue_names() == []


def subprocess_input(stack, text: str, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "taskrunner", *args], cwd=ROOT, env=stack.env, input=text,
                          capture_output=True, text=True, timeout=60)


def test_the_worker_started_last_wins_and_older_ones_only_restore_missing_declarations(app):
    """Two versions of one task during a deploy: the declaration of the worker that started
    last stays; an older worker's periodic refresh puts back only what is missing."""
    ours = declared_app.app  # its task changes between the two publications, as code does in a deploy
    ours.configure(redis_url=app.settings.redis_url, prefix=app.settings.prefix)
    task = ours.tasks["tests.declared_app.quick"]
    declarations.publish(ours, ["default"], "old-worker", 1.0)
    task.spec = task.spec.merged(max_duration=99)
    try:
        declarations.publish(ours, ["default"], "new-worker", 2.0)
        task.spec = task.spec.merged(max_duration=0.25)
        declarations.publish(ours, ["default"], "old-worker", 3.0, overwrite=False)
        for key in (app.keys.tasks, app.keys.q("default") + "tasks"):
            d = json.loads(app.redis.hget(key, "tests.declared_app.quick"))
            assert (d["worker"], d["max_duration"], d["declared_at"]) == ("new-worker", 99, 2.0)
        app.redis.delete(app.keys.q("default") + "tasks")  # e.g. the queue was deleted
        declarations.publish(ours, ["default"], "old-worker", 3.0, overwrite=False)
        assert json.loads(app.redis.hget(app.keys.q("default") + "tasks", "tests.declared_app.quick"))["worker"] == \
            "old-worker"
    finally:
        task.spec = task.spec.merged(max_duration=0.25)


def test_a_corrupt_declaration_is_refused_by_name(app, raw):
    raw.r.hset(raw.q("default") + "tasks", mapping={"t.corrupt": "{not json", "t.wrong": '{"retries": -2}'})
    before = raw.snapshot()
    with pytest.raises(redis.ResponseError, match=r"declaration of task t.corrupt in .*tasks is not a JSON object"):
        raw.enqueue([raw.q("default")], *raw.job("c1", "task", "t.corrupt"))
    with pytest.raises(redis.ResponseError, match="declaration of task t.wrong.*retries must be a whole number"):
        raw.enqueue([raw.q("default")], *raw.job("c2", "task", "t.wrong"))
    assert raw.snapshot() == before
    # A producer that sets the field itself does not depend on it.
    assert raw.enqueue([raw.q("default")], *raw.job("c3", "task", "t.wrong", "retries", "1")) == [1]


def test_a_foreign_producer_gets_the_declared_soft_limit(app, raw):
    raw.r.hset(raw.q("default") + "tasks", mapping={"t.soft": '{"max_duration": 30, "soft_limit": 2.5}',
                                                    "t.none": '{"max_duration": 30, "soft_limit": null}',
                                                    "t.over": '{"max_duration": 3, "soft_limit": 5}'})
    assert raw.enqueue([raw.q("default")], *raw.job("s1", "task", "t.soft")) == [1]
    assert raw.enqueue([raw.q("default")], *raw.job("s2", "task", "t.none")) == [1]
    assert app.redis.hmget(app.keys.job("default", "s1"), "soft_limit", "max_duration") == ["2.5", "30"]
    assert app.redis.hget(app.keys.job("default", "s2"), "soft_limit") is None
    with pytest.raises(redis.ResponseError, match=r"job s3: soft_limit \(5s\) must be less than max_duration"):
        raw.enqueue([raw.q("default")], *raw.job("s3", "task", "t.over"))
