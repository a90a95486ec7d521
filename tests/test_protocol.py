"""Conformance: a foreign client that knows only docs/PROTOCOL.md. It uses raw Redis
commands and the documented scripts (the text of _lib.lua, a newline, then the script's
file, loaded with SCRIPT LOAD), never the taskrunner Python API."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from tests import apps
from tests.conftest import ROOT

SCRIPTS = Path(ROOT) / "taskrunner" / "protocol" / "scripts"


class ForeignClient:
    def __init__(self, url: str, prefix: str):
        self.r = redis.Redis.from_url(url)  # bytes in, bytes out: nothing taskrunner-specific
        self.prefix = prefix
        lib = (SCRIPTS / "_lib.lua").read_text()
        self.sha = {name: self.r.execute_command("SCRIPT", "LOAD", lib + "\n" + (SCRIPTS / f"{name}.lua").read_text())
                    for name in ("enqueue", "claim", "finish")}

    def q(self, queue: str) -> str:
        return f"{self.prefix}:{{{queue}}}:"

    def enqueue(self, queue: str, job_id: str, task: str, args: list, kwargs: dict, headers: dict | None = None) -> int:
        fields = ["task", task, "queue", queue, "args", json.dumps(args), "kwargs", json.dumps(kwargs),
                  "max_duration", "30", "retries", "0", "timeout_policy", "kill", "max_lost", "5"]
        if headers is not None:
            fields += ["headers", json.dumps(headers)]
        [answer] = self.r.evalsha(self.sha["enqueue"], 1, self.q(queue), 1, job_id, 0, len(fields) // 2, *fields)
        self.r.sadd(f"{self.prefix}:{{_}}:queues", queue)
        return answer

    def claim(self, queue: str, me: str) -> list:
        head = json.dumps({"worker": me, "host": "foreign-host", "ip": "192.0.2.1"})[:-1]
        return self.r.evalsha(self.sha["claim"], 1, self.q(queue), head, me, "foreign-host", "192.0.2.1", 1, 60,
                              4242, "")

    def finish(self, queue: str, job_id: bytes, attempt: int, result) -> int:
        [answer] = self.r.evalsha(self.sha["finish"], 1, self.q(queue), 3600, 600, 86400, job_id, attempt,
                                  "completed",
                                  "", json.dumps(result), "", "", "")
        return answer

    def record(self, queue: str, job_id: str) -> dict:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.q(queue) + "job:" + job_id).items()}


def test_a_foreign_producer_enqueues_a_job_a_real_worker_runs(app, stack):
    foreign = ForeignClient(stack.url, app.settings.prefix)
    assert foreign.enqueue("default", "foreign-1", "tests.apps.add", [40, 2], {}) == 1
    assert foreign.enqueue("default", "foreign-1", "tests.apps.add", [0, 0], {}) == 0  # ids are enqueued once
    stack.worker()
    assert app.job("foreign-1").wait(30) == 42
    rec = foreign.record("default", "foreign-1")
    assert rec["state"] == "completed" and json.loads(rec["result"]) == 42 and rec["attempts"] == "1"


def test_a_foreign_consumer_takes_and_acks_a_python_job(app):
    foreign = ForeignClient(app.settings.redis_url, app.settings.prefix)
    job = apps.add.delay(20, 22)
    [qi, job_id, attempt, task, args, kwargs, max_duration, policy, headers, soft_limit] = foreign.claim(
        "default", "foreign-worker")
    assert (qi, job_id.decode(), task, json.loads(args), json.loads(kwargs)) == (1, job.id, b"tests.apps.add",
                                                                                [20, 22], {})
    assert (attempt, float(max_duration), policy, headers, soft_limit) == (1, 300.0, b"kill", b"", b"")
    holding = json.loads(foreign.r.hget(foreign.q("default") + "running", job.id))
    assert holding["worker"] == "foreign-worker" and holding["pid"] == 4242 and holding["ip"] == "192.0.2.1"
    assert foreign.finish("default", job_id, attempt, sum(json.loads(args))) == 1
    assert foreign.finish("default", job_id, attempt, 0) == 2  # a repeated ack changes nothing
    assert job.wait(5) == 42
    d = job.refresh().to_dict()
    assert (d["worker"], d["host"], d["pid"]) == ("foreign-worker", "foreign-host", 4242)


def test_headers_travel_from_a_foreign_producer_to_a_foreign_consumer(app):
    foreign = ForeignClient(app.settings.redis_url, app.settings.prefix)
    assert foreign.enqueue("default", "h-1", "tests.apps.add", [1, 2], {}, {"trace": "t-1", "n": [1]}) == 1
    answer = foreign.claim("default", "foreign-worker")
    assert json.loads(answer[8]) == {"trace": "t-1", "n": [1]}
    assert app.job("h-1").to_dict()["headers"] == {"trace": "t-1", "n": [1]}
