"""Workflow links wherever a job is enqueued (docs/PROTOCOL.md, Workflows): depends_on,
on_success and on_failure from the CLI (one job, and --from-file), enqueue_many and the
asyncio client, with real workers; signatures of tasks known by name only."""

from __future__ import annotations

import asyncio
import json

import pytest

from taskrunner import JobFailed, TaskRunner
from taskrunner.client.aio import AsyncClient
from taskrunner.ops import queue as queues
from tests import apps
from tests.conftest import wait_for


def record(app: TaskRunner, queue: str, job_id: str) -> dict[str, str]:
    return app.redis.hgetall(app.keys.job(queue, job_id))


def children(app: TaskRunner, queue: str, job_id: str) -> list[tuple[str, str]]:
    words = record(app, queue, job_id).get("children", "").split()
    return list(zip(words[::2], words[1::2]))


def test_cli_enqueue_depends_on_and_callbacks(app, stack):
    a = stack.cli("enqueue", "-A", "tests.apps", "tests.apps.hold", "--args", '["a"]', check=True).stdout.strip()
    b = stack.cli("enqueue", "-A", "tests.apps", "tests.apps.add", "--args", "[1, 2]", "--depends-on", a,
                  "--on-success", '{"task": "tests.apps.mul", "args": [10]}', "--on-failure", "tests.apps.echo",
                  check=True).stdout.strip()
    assert record(app, "default", b)["state"] == "waiting"
    [(_, success), (_, failure)] = children(app, "default", b)
    stack.worker()
    wait_for(lambda: record(app, "default", a).get("state") == "running", what="a running")
    assert record(app, "default", b)["state"] == "waiting"
    app.redis.set(f"{app.settings.prefix}:release:a", 1)
    assert app.job(b).wait(30) == 3
    assert app.job(success).wait(30) == 30  # its result first in the callback's args
    assert record(app, "default", failure)["state"] == "canceled"
    # on_failure is given how the job failed, first in its args
    bad = stack.cli("enqueue", "-A", "tests.apps", "tests.apps.boom", "--args", '["no"]', "--on-failure",
                    "tests.apps.echo", check=True).stdout.strip()
    [(_, alert)] = children(app, "default", bad)
    got = app.job(alert).wait(30)
    assert (got["id"], got["state"], got["error_type"], got["error"]) == (bad, "failed", "ValueError", "no")
    # Without -A, by names the workers declared
    c = stack.cli("enqueue", "tests.apps.add", "--args", "[2, 2]", "--depends-on", b, "--depends-on", bad)
    assert c.returncode == 2 and "ended failed: the job would never run" in c.stderr
    c = stack.cli("enqueue", "tests.apps.add", "--args", "[2, 2]", "--depends-on", b, check=True).stdout.strip()
    assert app.job(c).wait(30) == 4


def test_cli_enqueue_refuses_bad_links_in_one_line(app, stack):
    r = stack.cli("enqueue", "tests.apps.add", "--depends-on", "nope")
    assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (
        1, "Error: no job nope (never enqueued, or expired after its result TTL)")
    r = stack.cli("enqueue", "tests.apps.add", "--on-success", '{"task": "tests.apps.mul", "argz": []}')
    assert r.returncode == 2 and "unknown fields ['argz'] in --on-success" in r.stderr
    r = stack.cli("enqueue", "tests.apps.add", "--on-failure", "{not json")
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    r = stack.cli("enqueue", "-A", "tests.apps", "tests.apps.add", "--on-success", "tests.apps.nope")
    assert r.returncode == 2 and "task 'tests.apps.nope' is not declared by app tests.apps" in r.stderr
    assert not app.redis.keys(app.keys.q("default") + "job:*")


def test_cli_enqueue_from_file_with_links(app, stack, tmp_path):
    lines = [{"task": "tests.apps.add", "args": [1, 2], "id": "f1"},
             {"task": "tests.apps.add", "args": [3, 4], "id": "f2", "queue": "other"},
             {"task": "tests.apps.record", "args": ["both"], "id": "f3", "depends_on": ["f1", "f2"],
              "on_success": {"task": "tests.apps.echo", "id": "f3-ok"}, "on_failure": "tests.apps.echo"}]
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(map(json.dumps, lines)) + "\n")
    out = stack.cli("enqueue", "-A", "tests.apps", "--from-file", str(path), check=True).stdout.split()
    assert sorted(out) == ["f1", "f2", "f3"]
    assert record(app, "default", "f3")["parents"] == "default f1 other f2"
    stack.worker("-Q", "default,other")
    assert app.job("f3-ok").wait(30) == 1  # record("both") ran once, its result passed on
    assert [record(app, q, i)["state"] for q, i in children(app, "default", "f3")] == ["completed", "canceled"]


def test_enqueue_many_links_earlier_jobs_existing_ones_and_callbacks(app, stack):
    before = apps.add.delay(10, 10)
    seen: list[int] = []
    jobs = app.enqueue_many([
        {"task": "tests.apps.add", "args": [1, 1], "id": "e1", "queue": "other"},
        {"task": "tests.apps.add", "args": [2, 2], "id": "e2", "depends_on": ["e1", before],
         "on_success": apps.mul.s(3)},  # its parent is in this chunk in another queue: the next chunk
        {"task": "tests.apps.add", "args": [3, 3], "id": "e3", "depends_on": ["e2"],
         "on_failure": app.signature("tests.apps.echo", queue="other")},  # a callback in another queue
        {"task": "tests.apps.add", "args": [4, 4], "id": "e4"},
    ], chunk=2, progress=seen.append)
    assert sorted(j.id for j in jobs) == ["e1", "e2", "e3", "e4"] and sum(seen) == 4
    assert record(app, "default", "e2")["parents"] == f"other e1 default {before.id}"
    [tripled] = [i for q, i in children(app, "default", "e2") if record(app, q, i)["task"] == "tests.apps.mul"]
    stack.worker("-Q", "default,other")
    assert app.job("e3").wait(30) == 6
    assert app.job(tripled).wait(30) == 12
    [(q, alert)] = children(app, "default", "e3")
    assert q == "other" and app.job(alert).refresh().state == "canceled"
    with pytest.raises(ValueError, match="job 1: a job with depends_on cannot have a delay"):
        app.enqueue_many([{"task": "tests.apps.add", "args": [1, 1], "depends_on": ["e1"], "delay": 5}])
    with pytest.raises(ValueError, match="job 2: unknown fields \\['nope'\\] in on_success"):
        app.enqueue_many([{"task": "tests.apps.add", "args": [1, 1]},
                          {"task": "tests.apps.add", "args": [1, 1], "on_success": {"task": "x", "nope": 1}}])


def test_asyncio_client_depends_on_and_callbacks(app, stack):
    stack.worker()

    async def main():
        client = AsyncClient(app)
        try:
            first = await client.enqueue("tests.apps.add", [1, 2])
            then = await client.enqueue("tests.apps.add", [3, 4], depends_on=[first],
                                        on_success=app.signature("tests.apps.mul", [10]))
            assert await client.wait(then, 30) == 7
            assert (await client.job(then))["parents"] == [{"queue": "default", "id": first}]
            queues.pause(app, "default")  # else boom may fail first, and a step after it is refused
            bad = await client.enqueue("tests.apps.boom", ["async"])
            after = await client.enqueue("tests.apps.add", [1, 1], depends_on=[bad])
            queues.resume(app, "default")
            with pytest.raises(JobFailed, match=rf"step {bad} \(task tests.apps.boom\) failed: ValueError: async"):
                await client.wait(after, 30)
            return then
        finally:
            await client.close()

    then = asyncio.run(main())
    [(_, success)] = children(app, "default", then)
    assert app.job(success).wait(30) == 70


def test_a_signature_by_name_takes_the_declared_settings(app, stack):
    """A task this app does not declare: its queue and settings come from its declaration
    in Redis, the options given win."""
    app.redis.hset(app.keys.tasks, "far.away", json.dumps({"task": "far.away", "queue": "far", "retries": 4}))
    sig = app.signature("far.away", [1], {"k": 2})
    first = apps.add.delay(1, 1)
    job = app.enqueue("tests.apps.add", [1, 1], depends_on=[first], on_success=sig)
    [(q, callback)] = children(app, "default", job.id)
    assert q == "far"
    d = record(app, "far", callback)
    assert (d["state"], d["args"], d["kwargs"], d["takes"]) == ("waiting", "[1]", '{"k":2}', "result")
    assert app.signature("tests.apps.add", [1, 2]).task is apps.add
    with pytest.raises(TypeError, match="args must be a list"):
        app.signature("far.away", "ab")
