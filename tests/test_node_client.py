"""The protocol is language-agnostic: clients/node (Node.js + ioredis, written from
docs/PROTOCOL.md) against real Python workers and dispatchers on a real Redis.

Needs `node` and the client's npm packages (`npm ci --prefix clients/node`, which `make test`
runs). Without them the tests are skipped, except under CI (CI=true), where they fail."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from taskrunner.client import arguments
from taskrunner.client.flow import unique_key_of
from taskrunner.errors import BadArguments, JobFailed
from taskrunner.ops import listing
from taskrunner.ops import queue as queues
from taskrunner.ops.redis_server import RedisServer
from tests.conftest import ROOT, Stack, free_port, wait_for

NODE_DIR = ROOT / "clients" / "node"


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing() -> str | None:
    """Why the Node client cannot run here, or None."""
    if shutil.which("node") is None:
        return "no `node` on PATH: install Node.js >= 18 (apt-get install nodejs npm)"
    if not (NODE_DIR / "node_modules" / "ioredis").is_dir():
        return "the Node client's packages are not installed: npm ci --prefix clients/node"
    return None


def need_node() -> None:
    """Skip the test when the Node client cannot run here (fail it under CI)."""
    why = missing()
    if why:
        if on_ci():
            pytest.fail(f"CI is set, so the Node client tests must run: {why}", pytrace=False)
        pytest.skip(why)


@pytest.fixture(scope="module", autouse=True)
def node() -> None:
    need_node()


def spawn_node(stack: Stack, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A Node process in its own process group, stopped (SIGKILL to the group) by the stack."""
    p = subprocess.Popen(["node", *args], cwd=NODE_DIR, env={**stack.env, **(env or {})}, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stack.procs.append(p)
    return p


def consumer(stack: Stack, name: str, queues: str = "default", env: dict[str, str] | None = None) -> subprocess.Popen:
    return spawn_node(stack, "consumer.js", "--name", name, "--queues", queues, "examples/handlers.js", env=env)


def produce(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["node", "producer.js", *args], cwd=NODE_DIR, env=stack.env, capture_output=True, text=True,
                          timeout=60)


def stop(p: subprocess.Popen) -> str:
    """SIGTERM, then its output once it has exited (within a generous deadline)."""
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    return out


def running_on(app, job, worker: str) -> bool:
    d = job.refresh().to_dict()
    return d["state"] == "running" and d["worker"] == worker


def test_a_job_enqueued_from_node_runs_on_a_python_worker(app, stack):
    r = produce(stack, "--id", "from-node", "tests.apps.add", "[40, 2]")
    assert (r.returncode, r.stdout.strip()) == (0, "from-node"), r.stderr
    assert app.redis.sismember(app.keys.queues, "default")
    stack.worker(name="py-w")
    job = app.job("from-node")
    assert job.wait(30) == 42
    d = job.to_dict()
    assert d["worker"] == "py-w" and d["attempts"] == 1
    # The producer can wait for the result too (watch.lua, then BLPOP on notify:<id>).
    r = produce(stack, "--wait", "30", "--queue", "default", "tests.apps.add", "[1, 2]")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert (record["state"], json.loads(record["result"]), record["worker"]) == ("completed", 3, "py-w")


def test_a_job_enqueued_from_python_runs_on_the_node_consumer(app, stack):
    node_c = consumer(stack, "node-c")
    job = app.enqueue("node.echo", [1, "two", None], {"three": 3.5}, headers={"trace": "t-1"})
    assert job.wait(30) == {"args": [1, "two", None], "kwargs": {"three": 3.5}, "attempt": 1,
                            "headers": {"trace": "t-1"}, "runtime": "node"}
    d = job.to_dict()
    assert (d["worker"], d["pid"]) == ("node-c", node_c.pid)
    # An error is retried as the job says (the dispatcher promotes the delayed retry), then
    # fails with the JavaScript error's name.
    stack.dispatcher()
    failing = app.enqueue("node.boom", ["bad input"], retries=1, retry_backoff=0.1)
    with pytest.raises(JobFailed) as e:
        failing.wait(30)
    assert (e.value.error_type, e.value.message) == ("TypeError", "bad input")
    assert failing.refresh().data["failures"] == "2" and "handlers.js" in e.value.traceback
    info = json.loads(app.redis.get(app.keys.worker("node-c")))
    assert info["pid"] == node_c.pid and info["queues"] == ["default"]
    out = stop(node_c)
    assert "stopped after 3 jobs" in out
    assert app.redis.zscore(app.keys.workers, "node-c") is None and not app.redis.exists(app.keys.worker("node-c"))


def test_the_node_consumer_honours_kill_requests_and_max_duration(app, stack):
    consumer(stack, "node-k")
    job = app.enqueue("node.slow_add", [1, 2, 120])
    wait_for(lambda: running_on(app, job, "node-k"), what="the job running on Node")
    assert job.kill("tester") == "running"  # a kill message on control:node-k
    with pytest.raises(JobFailed) as e:
        job.wait(30)
    assert (e.value.state, e.value.error_type) == ("killed", "Killed")
    # Past its max duration a job of policy "kill" is stopped by the consumer itself.
    slow = app.enqueue("node.slow_add", [1, 2, 120], max_duration=1)
    with pytest.raises(JobFailed) as e:
        slow.wait(30)
    assert (e.value.state, e.value.error_type) == ("failed", "TimeLimitExceeded")
    # The consumer goes on with the next job.
    assert app.enqueue("tests.apps.add", [2, 3]).wait(30) == 5


def test_a_node_consumer_sigkilled_mid_job_has_its_job_run_again(app, stack):
    stack.dispatcher()
    first = consumer(stack, "node-1")
    job = app.enqueue("node.slow_add", [20, 22, 300])  # max duration 300 s: the deadline cannot requeue it
    wait_for(lambda: running_on(app, job, "node-1"), what="the job running on node-1")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    # The dispatcher (same machine: pidns and boot_id match) sees node-1's PID gone.
    wait_for(lambda: job.refresh().state == "pending", what="the dispatcher requeueing the job")
    # refresh() read the record before .state read the state: read the requeued record again
    assert "worker node-1 is dead" in job.refresh().data["end:1"]
    consumer(stack, "node-2")
    assert job.wait(30) == 42
    d = job.refresh().to_dict()
    assert (d["worker"], d["attempts"]) == ("node-2", 2)


def test_a_node_consumer_stopped_mid_job_puts_it_back_and_leaves(app, stack):
    """SIGTERM: the running job gets shutdown_grace (5 s here), then goes back next in line
    at once (not at its deadline), and the consumer leaves the worker list."""
    node_s = consumer(stack, "node-s")
    job = app.enqueue("node.slow_add", [1, 2, 300])
    wait_for(lambda: running_on(app, job, "node-s"), what="the job running on Node")
    out = stop(node_s)
    assert "stopped after 1 jobs" in out
    d = job.refresh().to_dict()
    assert (d["state"], d["attempts"]) == ("pending", 1) and "node-s shutting down" in job.data["end:1"]
    assert app.redis.lrange(app.keys.q("default") + "pending", -1, -1) == [job.id]
    assert app.redis.zscore(app.keys.workers, "node-s") is None and not app.redis.exists(app.keys.worker("node-s"))


def node_script(stack: Stack, source: str) -> dict:
    """Run `source` (it may await; `tr` is a TaskRunner) with node; what it printed, as JSON."""
    program = ("const { TaskRunner, Consumer } = require('./taskrunner');\n"
               "(async () => { const tr = new TaskRunner();\n"
               f"try {{ {source} }} finally {{ tr.redis.disconnect(); }} }})()"
               ".catch((e) => { console.error(e.message); process.exitCode = 2; });")
    r = subprocess.run(["node", "-e", program], cwd=NODE_DIR, env=stack.env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_node_kill_of_an_ended_job_answers_already_and_its_state(app, stack):
    """The Node client's kill answers as Python's Job.kill: "killed" for a job it killed,
    "already <state>" for one that had already ended (it answered "killed" for a killed
    job, as for one it killed)."""
    jobs = stack.ended_jobs()
    later = app.enqueue("tests.apps.add", [1, 1], delay=100)  # not claimed: the worker runs meanwhile
    ids = [later.id, *(job.id for job in jobs.values())]
    got = node_script(stack, f"const out = []; for (const id of {json.dumps(ids)}) "
                             "out.push(await tr.kill(id, 'default', 'node')); console.log(JSON.stringify(out));")
    assert got == ["killed", *(f"already {state}" for state in jobs)]
    assert [app.job(i).state for i in ids] == ["killed", *jobs]


def test_workflows_enqueued_from_node_run_on_python_workers(app, stack):
    """A chain, a group, a chord and depends_on with callbacks, written by the Node client with
    the fields Python writes (docs/PROTOCOL.md, Workflows), run by a Python worker."""
    got = node_script(stack, """
      const last = await tr.chain([{ task: 'tests.apps.add', args: [1, 2] },
        { task: 'tests.apps.mul', args: [10], queue: 'other' }, { task: 'tests.apps.add', args: [5] },
        { task: 'tests.apps.mul', args: [2, 2], immutable: true }]);
      const members = await tr.group([{ task: 'tests.apps.add', args: [1, 1] },
        { task: 'tests.apps.add', args: [2, 2], queue: 'other' }]);
      const chord = await tr.chord([{ task: 'tests.apps.add', args: [3, 3] }, { task: 'tests.apps.boom', args: ['x'] }],
        { task: 'tests.apps.tsum' }, { onMemberFailure: 'continue' });
      const first = await tr.enqueue('tests.apps.add', [1, 1]);
      const after = await tr.enqueue('tests.apps.add', [2, 2], {}, { dependsOn: [first, members[1].id],
        onSuccess: { task: 'tests.apps.mul', args: [3] }, onFailure: { task: 'tests.apps.echo' } });
      const bad = await tr.enqueue('tests.apps.boom', ['no']);
      const never = await tr.enqueue('tests.apps.add', [1, 1], {}, { dependsOn: [bad] });
      console.log(JSON.stringify({ last, members, chord, first, after, bad, never }));""")
    last = record(app, "default", got["last"]["id"])
    assert (last["state"], last["waiting_on"], "takes" in last) == ("waiting", "1", False)  # immutable
    q, mul = last["parents"].split()
    assert (q, record(app, "default", mul)["takes"]) == ("default", "result")
    chord = record(app, "default", got["chord"]["id"])
    assert (chord["takes"], chord["on_parent_failure"], len(chord["parents"].split())) == ("results", "continue", 4)
    after = app.job(got["after"]["id"]).refresh()
    assert after.data["parents"] == f"default {got['first']['id']} other {got['members'][1]['id']}"
    stack.worker("-Q", "default,other")
    assert app.job(got["last"]["id"]).wait(30) == 4
    steps = []
    job = app.job(got["last"]["id"]).refresh()
    while job.data.get("parents"):
        q, i = job.data["parents"].split()
        job = app.job(i, q).refresh()
        steps.append((job.queue, job.result))
    assert steps == [("default", 35), ("other", 30), ("default", 3)]  # (1 + 2) * 10 + 5, then 2 * 2
    assert [app.job(m["id"]).wait(30) for m in got["members"]] == [2, 4]
    assert app.job(got["chord"]["id"]).wait(30) == 6  # [6, null]: the failed member gives null
    assert app.job(got["after"]["id"]).wait(30) == 4
    [success, failure] = [app.job(i, q) for q, i in zip(*[iter(after.refresh().data["children"].split())] * 2)]
    assert success.wait(30) == 12 and failure.refresh().state == "canceled"
    with pytest.raises(JobFailed, match=rf"step {got['bad']['id']} \(task tests.apps.boom\) failed"):
        app.job(got["never"]["id"]).wait(30)
    # the producer CLI: --depends-on, repeatable; --wait on a canceled job exits 1
    r = produce(stack, "--depends-on", got["bad"]["id"], "tests.apps.add", "[1, 1]")
    assert r.returncode == 2 and "ended failed: the job would never run" in r.stderr
    r = produce(stack, "--wait", "30", "--depends-on", got["last"]["id"], "--depends-on", got["chord"]["id"],
                "tests.apps.add", "[20, 22]")
    assert r.returncode == 0, r.stderr
    assert json.loads(json.loads(r.stdout)["result"]) == 42


def record(app, queue: str, job_id: str) -> dict[str, str]:
    return app.redis.hgetall(app.keys.job(queue, job_id))


# -- flow control (issue 17) from Node: priorities, unique jobs, concurrency keys, pause, rate limits --


def refusal(stack: Stack, opts: str) -> str:
    """The error Node's enqueue of tests.apps.add with `opts` (JavaScript) throws."""
    r = subprocess.run(["node", "-e", "const { TaskRunner } = require('./taskrunner'); const tr = new TaskRunner();"
                        f"tr.enqueue('tests.apps.add', [1, 1], {{}}, {opts})"
                        ".catch((e) => console.error(e.message)).finally(() => tr.redis.disconnect());"],
                       cwd=NODE_DIR, env=stack.env, capture_output=True, text=True, timeout=60)
    return r.stderr.strip()


def started(app) -> list[str]:
    """Keys of the `tests.apps.hold` jobs in the order they started."""
    return [s.rsplit(":", 1)[0] for s in app.redis.lrange(f"{app.settings.prefix}:started", 0, -1)]


def test_node_priorities_are_claimed_first_by_a_python_worker(app, stack):
    got = node_script(stack, """
      const ids = [];
      for (let i = 0; i < 4; i++) ids.push(await tr.enqueue('tests.apps.hold', [`low${i}`, 0]));
      ids.push(await tr.enqueue('tests.apps.hold', ['zero', 0], {}, { priority: 0 }));  // the same as none
      ids.push(await tr.enqueue('tests.apps.hold', ['mid', 0], {}, { priority: 5 }));
      ids.push(await tr.enqueue('tests.apps.hold', ['high', 0], {}, { priority: 9 }));
      console.log(JSON.stringify(ids));""")
    assert [record(app, "default", j["id"]).get("priority") for j in got] == [None] * 5 + ["5", "9"]
    assert queues.info(app, "default")["priorities"] == [9, 5]
    stack.worker(concurrency=1)
    for j in got:
        app.job(j["id"]).wait(30)
    assert started(app) == ["high", "mid", "low0", "low1", "low2", "low3", "zero"]
    # Refused in the caller's process, one line each.
    for opts, why in (("{ priority: 10 }", "priority must be a whole number from 0 to 9, not 10"),
                      ("{ priority: 1.5 }", "priority must be a whole number from 0 to 9, not 1.5"),
                      ("{ priority: '9' }", 'priority must be a whole number from 0 to 9, not "9"')):
        assert refusal(stack, opts) == why
    r = produce(stack, "--priority", "7", "tests.apps.add", "[1, 2]")
    assert r.returncode == 0, r.stderr
    assert record(app, "default", r.stdout.strip())["priority"] == "7"


# Arguments whose canonical JSON is easy to get wrong: key order (by code point, so astral
# characters after U+FFFF), escapes, non-ASCII text, numbers (ints as digits, up to 2^53 as
# JavaScript holds them exactly; floats as orjson writes them: "1e+20", "1e-7", "0.00001",
# "1.5e+300"), nesting.
TRICKY_ARGS = [1, -7, 0, 2**53 + 2, -(2**53), 0.1, -2.5, 1e-7, 1e-5, 123.456, 1.5e300, 1e20, 5e-324, True, None,
               "", "é ✓ 😀 \u2028", "quote\" back\\ slash/ \x00\x1f\x7f \b\f\n\r\t", [], {}, [[1, {"z": 1, "a": [2]}]]]
TRICKY_KWARGS = {"b": 2, "a": {"y": [1.25, "x"], "x": None}, "B": 3, "\uffff": 4, "\U00010000": 5, "_": 6, "é": 7,
                 "10": 8, "9": 9}


def test_a_node_duplicate_gets_the_python_jobs_id_and_the_reverse(app, stack):
    """unique_for alone: both producers derive the key from [task, args, kwargs] the same way
    (SHA-1 of its canonical JSON), so each one's duplicate is answered the other's job."""
    py = app.enqueue("tests.apps.anything", TRICKY_ARGS, dict(reversed(list(TRICKY_KWARGS.items()))), unique_for=600)
    source = f"""
      const args = JSON.parse({json.dumps(orjson.dumps(TRICKY_ARGS).decode())});
      const kwargs = JSON.parse({json.dumps(orjson.dumps(TRICKY_KWARGS).decode())});
      const dup = await tr.enqueue('tests.apps.anything', args, kwargs, {{ uniqueFor: 600 }});
      const mine = await tr.enqueue('tests.apps.anything', [...args, 'node'], kwargs, {{ uniqueFor: 600 }});
      const keyed = await tr.enqueue('tests.apps.anything', [1], {{}},
                                     {{ uniqueKey: 'report:7', uniqueUntil: 'start' }});
      const again = await tr.enqueue('tests.apps.anything', [2], {{}}, {{ uniqueKey: 'report:7' }});
      console.log(JSON.stringify({{ dup, mine, keyed, again }}));"""
    got = node_script(stack, source)
    assert got["dup"] == {"id": py.id, "queue": "default", "created": False, "duplicate": True}
    assert got["mine"]["created"] is True and got["mine"]["id"] != py.id
    assert got["keyed"]["created"] is True and got["again"] == {**got["keyed"], "created": False, "duplicate": True}
    mine = record(app, "default", got["mine"]["id"])
    assert (mine["unique_key"], mine["unique_for"]) == (unique_key_of("tests.apps.anything", [*TRICKY_ARGS, "node"],
                                                                      TRICKY_KWARGS), "600")
    keyed = record(app, "default", got["keyed"]["id"])
    assert (keyed["unique_key"], keyed["unique_until"], "unique_for" in keyed) == ("report:7", "start", False)
    # Python's duplicate of the Node job gets the Node job's id.
    again = app.enqueue("tests.apps.anything", [*TRICKY_ARGS, "node"], TRICKY_KWARGS, unique_for=600)
    assert (again.id, again.created) == (got["mine"]["id"], False)
    assert queues.info(app, "default")["duplicates"] == {"tests.apps.anything": 3}
    # The producer CLI: the holder's id, and a line saying nothing was added.
    r = produce(stack, "--unique-for", "600", "tests.apps.anything", orjson.dumps(TRICKY_ARGS).decode(),
                orjson.dumps(TRICKY_KWARGS).decode())
    assert (r.returncode, r.stdout.strip()) == (0, py.id), r.stderr
    assert f"a job with its unique key exists: {py.id} (not enqueued)" in r.stderr
    r = produce(stack, "--unique-key", "report:7", "--unique-until", "finish", "tests.apps.anything", "[3]")
    assert (r.returncode, r.stdout.strip()) == (0, got["keyed"]["id"]), r.stderr
    # Checked before Redis, one line each; a unique job is no workflow's part.
    for opts, why in (("{ uniqueFor: 0 }", "uniqueFor must be a whole number from 1 to 2147483647, not 0"),
                      ("{ uniqueKey: 'a b' }", 'uniqueKey must be 1-200 printable ASCII characters without spaces, '
                                                'not "a b"'),
                      ("{ uniqueKey: 'k', uniqueUntil: 'later' }", 'uniqueUntil must be "start" or "finish", '
                                                                    'not "later"'),
                      ("{ uniqueUntil: 'start' }", "uniqueUntil needs uniqueKey or uniqueFor"),
                      ("{ uniqueFor: 5, onSuccess: { task: 'tests.apps.add' } }", "a unique job cannot be part of a "
                       "workflow (a chain, group or chord, dependsOn, onSuccess, onFailure)")):
        assert refusal(stack, opts) == why


def test_the_node_unique_key_is_pythons_for_the_job_python_reads(stack):
    """The key Node derives is unique_key_of(task, args, kwargs) of the job as a Python worker
    reads it (orjson.loads of the text Node wrote), for values from both sides."""
    got = node_script(stack, f"""
      const {{ uniqueKeyOf }} = require('./taskrunner');
      const values = JSON.parse({json.dumps(orjson.dumps([*TRICKY_ARGS, TRICKY_KWARGS]).decode())});
      for (let e = -330; e <= 310; e += 7) values.push(1.2345678901234567 * 10 ** e, -(3 * 10 ** e), 10 ** e);
      for (let i = 0; i < 300; i++) values.push(Math.random() * 10 ** (Math.floor(Math.random() * 60) - 30));
      values.push(2 ** 64, 2 ** 64 - 2048, -(2 ** 63), -(2 ** 63) - 4096, 1e21, 123456789012345680000, -0,
        1e15 + 0.5, 9007199254740993, 0.1 + 0.2, String.fromCharCode(0xd7ff, 0xe000, 0xfffd),
        {{ '\\ud83d\\ude00': 1, '\\uffff': 2 }});
      const out = values.map((v) => [JSON.stringify([v]), JSON.stringify({{ k: v }}),
        uniqueKeyOf('t', [v], {{ k: v }})]);
      console.log(JSON.stringify(out));""")
    assert len(got) > 400
    wrong = [(a, k) for a, k, key in got if key != unique_key_of("t", orjson.loads(a), orjson.loads(k))]
    assert not wrong, wrong[:5]


def test_a_node_job_with_a_concurrency_key_respects_the_tasks_cap(app, stack):
    """tests.flow_apps.capped has max_concurrency=2, declared by the Python workers; Node's
    jobs name their key, and enqueue.lua fills the cap in from the declaration."""
    stack.worker(app="tests.flow_apps", concurrency=4, name="c1")
    stack.worker(app="tests.flow_apps", concurrency=4, name="c2")
    wait_for(lambda: app.redis.hexists(app.keys.q("default") + "tasks", "tests.flow_apps.capped"),
             what="the workers' declarations")
    got = node_script(stack, """
      const jobs = [];
      for (let i = 0; i < 5; i++) {
        for (const key of ['customer:1', 'customer:2']) {
          jobs.push(await tr.enqueue('tests.flow_apps.capped', [key, 0.3], {}, { concurrencyKey: key }));
        }
      }
      console.log(JSON.stringify(jobs));""")
    assert {record(app, "default", j["id"])["concurrency_key"] for j in got} == {"customer:1", "customer:2"}
    assert {record(app, "default", j["id"])["max_concurrency"] for j in got} == {"2"}
    for j in got:
        app.job(j["id"]).wait(60)
    spans: dict[str, list[tuple[float, float]]] = {}
    for raw in app.redis.lrange(f"{app.settings.prefix}:spans", 0, -1):
        key, start, end = raw.split()
        spans.setdefault(key, []).append((float(start), float(end)))
    assert sorted(spans) == ["customer:1", "customer:2"] and [len(s) for s in spans.values()] == [5, 5]
    for key, ss in spans.items():
        most = max(sum(1 for a, b in ss if a <= t < b) for t, _ in ss)
        assert most <= 2, (key, most)
    assert not app.redis.exists(app.keys.q("default") + "slots:customer:1", app.keys.q("default") + "slots:customer:2")
    # A key on a task without a cap is refused by the script (one line), a bad name by Node.
    r = produce(stack, "--concurrency-key", "customer:1", "tests.apps.add", "[1, 2]")
    assert r.returncode == 2 and "concurrency_key needs max_concurrency" in r.stderr
    r = produce(stack, "--concurrency-key", "a b", "tests.flow_apps.capped", '["x", 0]')
    assert r.returncode == 2 and 'invalid concurrency key name "a b"' in r.stderr


def test_the_node_consumer_respects_pause_and_priorities(app, stack):
    """A paused queue gives the Node consumer nothing (its other queue is served); after
    resume its jobs run highest priority first, FIFO within one."""
    queues.create(app, "held")
    queues.pause(app, "held")
    got = node_script(stack, """
      const ids = [];
      for (const [i, priority] of [[0, 0], [1, 3], [2, 0], [3, 9], [4, 3]]) {
        ids.push((await tr.enqueue('tests.apps.add', [i, 0], {}, { queue: 'held', priority })).id);
      }
      console.log(JSON.stringify(ids));""")
    consumer(stack, "node-p", "held,other")
    assert app.enqueue("node.echo", ["past the paused queue"], queue="other").wait(30)["runtime"] == "node"
    assert [app.job(i, "held").refresh().state for i in got] == ["pending"] * 5
    queues.resume(app, "held")
    for i in got:
        app.job(i, "held").wait(30)
    recs = [record(app, "held", i) for i in got]
    assert {r["worker"] for r in recs} == {"node-p"}
    order = [r["args"] for r in sorted(recs, key=lambda r: float(r["started_at"]))]
    assert order == ["[3,0]", "[1,0]", "[4,0]", "[0,0]", "[2,0]"]  # as Node wrote them


def test_the_node_consumer_on_a_rate_limited_queue_starts_jobs_spaced_by_the_limit(app, stack):
    """A queue limited to 2 starts a second: the claim holds jobs back and answers when the
    next token is due (its last value); the consumer comes back then, neither earlier (each
    start at least 0.5 s after the one before, Redis's clock) nor after its idle block (5 s
    here): the starts of 6 jobs span about 2.5 s."""
    queues.create(app, "paced", rate="2/s")
    jobs = [app.enqueue("tests.apps.add", [i, 1], queue="paced") for i in range(6)]
    node_c = consumer(stack, "node-r", "paced", env={"TASKRUNNER_IDLE_BLOCK": "5"})
    for j in jobs:
        j.wait(60)
    starts = [float(j.refresh().data["started_at"]) for j in jobs]
    assert starts == sorted(starts)  # FIFO
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 0.5 - 1e-5, gaps
    assert max(gaps) < 2.5, gaps  # a consumer that missed the wait would sleep its idle block: 5 s
    assert starts[-1] - starts[0] < 5.5, gaps
    assert all(j.data["attempts"] == "1" and j.data["worker"] == "node-r" for j in jobs)
    assert "stopped after 6 jobs" in stop(node_c)


# -- a job's arguments against the task's declared params -----------------------------------


def test_the_node_check_of_arguments_says_what_pythons_does():
    """checkArguments binds as Python's Signature.bind (taskrunner/client/arguments.py) and
    says it in Python's words, for every kind of parameter and mix of arguments; params not
    as Python writes them check nothing, where Python's producer checks nothing."""
    def f(a, /, b, c=1, *, d, **kw): ...

    def g(*args, z=2): ...

    def kwdefault(a, *, k=1): ...

    def catchall(a, /, **kw): ...

    declared = [arguments.params(arguments.shape_of(fn).signature) for fn in
                (f, g, kwdefault, catchall, lambda: 0, lambda a, b, /: 0, lambda a, b=1, c=2: 0,
                 lambda a, *rest: 0, lambda a, *, k: 0, lambda *args, **kwargs: 0)]
    declared += [["a", "*"], ["a", "a"], ["a=", "b"], ["no such"], ["class"], ["**"], ["*a", "*b"], ["é", "x="],
                 ["*", "k", "/", "x"], ["a", "/", "/"], [1], "a", None]
    keywords = [{}, {"a": 1}, {"b": 1}, {"k": 1}, {"a": 1, "b": 2}, {"b": 1, "k": 2}, {"c": 1, "k": 1},
                {"z": 1}, {"rest": 1}, {"kw": 1}, {"d": 1, "b": 2}, {"x": 1, "a": 1}]
    cases = [(params, n, kwargs, fed) for params in declared for n in range(4) for kwargs in keywords
             for fed in (False, True)]
    python = []
    for params, n, kwargs, fed in cases:
        try:
            arguments.check("t.x", arguments.from_declaration({"params": params}), list(range(n)), dict(kwargs), fed)
            python.append(None)
        except BadArguments as e:  # the Node client's immutable steps are {immutable: true}, not .si()
            python.append(str(e).replace("an immutable step, .si(),", "an immutable step, immutable: true,"))
    program = ("const { checkArguments } = require('./taskrunner');\n"
               "const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));\n"
               "console.log(JSON.stringify(cases.map(([params, n, kwargs, fed]) => {\n"
               "  try { checkArguments('t.x', params, [...Array(n).keys()], kwargs, fed); return null; }\n"
               "  catch (e) { return e.name === 'BadArguments' ? e.message : `not BadArguments: ${e}`; } })));")
    r = subprocess.run(["node", "-e", program], cwd=NODE_DIR, input=json.dumps(cases), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    node = json.loads(r.stdout)
    assert sum(m is not None for m in python) > 200  # the table refuses many
    assert [(c, m) for c, m, p in zip(cases, node, python) if m != p] == []


def test_the_node_producer_checks_arguments_where_it_read_the_declaration(app, stack):
    """Where the Node producer reads a task's declaration anyway (to place a job on a sharded
    queue's shard) or read it less than 10 s ago, the declared params refuse arguments that
    do not fit, before anything is written, in the Python producer's words; a plain queue's job
    of a task it did not read is not checked (no command is spent on it: Python's rule)."""
    queues.create(app, "ck", shards=2)
    stack.worker("-Q", "ck", name="declarer")  # publishes the declarations of tests.apps, `params` among them
    wait_for(lambda: app.redis.zscore(app.keys.workers, "declarer"), what="the worker's first heartbeat")
    got = node_script(stack, """
      const attempt = async (f) => { try { return await f(); } catch (e) { return `${e.name}: ${e.message}`; } };
      const unread = await tr.enqueue('tests.apps.add', [1], {}, { queue: 'plainq' });
      const refused = [
        await attempt(() => tr.enqueue('tests.apps.add', [1], {}, { queue: 'ck' })),
        await attempt(() => tr.chain([{ task: 'tests.apps.add', args: [1, 2], queue: 'ck' },
          { task: 'tests.apps.mul', args: [3, 4], queue: 'ck' }])),
        await attempt(() => tr.enqueue('tests.apps.add', [1, 2], {}, { queue: 'ck',
          onSuccess: { task: 'tests.apps.mul', args: [3, 4], queue: 'ck' } })),
        await attempt(() => tr.chord([{ task: 'tests.apps.add', args: [1, 2], queue: 'ck' }],
          { task: 'tests.apps.mul', args: [1, 2], queue: 'ck' })),
        await attempt(() => tr.enqueue('tests.apps.add', [1], { c: 2 }, { queue: 'plainq' })),  // read just now
      ];
      const fits = await tr.chain([{ task: 'tests.apps.add', args: [1, 2], queue: 'ck' },
        { task: 'tests.apps.mul', args: [3], queue: 'ck' }, { task: 'tests.apps.mul', args: [1, 2], immutable: true,
        queue: 'ck' }]);
      console.log(JSON.stringify({ unread, refused, fits }));
    """)
    assert got["unread"]["created"] is True
    fed = (" (counting the value it is given first, its parent's result or error; an immutable step, immutable: "
           "true, is given none)")
    assert got["refused"] == [
        "BadArguments: tests.apps.add(a, b): missing a required argument: 'b'",
        "BadArguments: tests.apps.mul(a, b): too many positional arguments" + fed,
        "BadArguments: tests.apps.mul(a, b): too many positional arguments" + fed,
        "BadArguments: tests.apps.mul(a, b): too many positional arguments" + fed,
        "BadArguments: tests.apps.add(a, b): missing a required argument: 'b'"]
    assert app.job(got["fits"]["id"], got["fits"]["queue"]).wait(30) == 2
    # The refused ones left nothing behind: the chain's 3 jobs, on every shard (`jobs -q ck`), ran.
    assert len(listing.list_jobs(app, "ck", "completed", limit=10)) == 3
    assert queues.unfinished(app, ["ck", "ck~1"]) == 0
    r = produce(stack, "--queue", "ck", "tests.apps.add", "[1]")  # as the Python CLI says it
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "Error: tests.apps.add(a, b): missing a required argument: 'b'\n"


def test_the_node_producer_waits_for_a_job_on_the_shard_it_was_put_on(app, stack):
    """`producer.js --wait` on a sharded queue waits where the job is, the shard enqueue
    answered (`Q~i`): it looked in `Q` alone, so a job put on another shard was `no job ...
    in queue Q` (exit 2) while it ran."""
    queues.create(app, "nsq", shards=3)
    stack.worker("-Q", "nsq")
    put: set[str] = set()
    for i in range(20):  # each producer's round robin starts at a shard of its own: until one is not shard 0
        r = produce(stack, "--queue", "nsq", "--wait", "30", "tests.apps.add", f"[{i}, 1]")
        assert r.returncode == 0, r.stderr
        record = json.loads(r.stdout)
        assert (record["state"], json.loads(record["result"])) == ("completed", i + 1)
        put.add(record["queue"])
        if put - {"nsq"}:
            break
    assert put - {"nsq"} <= {"nsq~1", "nsq~2"} and put - {"nsq"}


def test_a_node_job_given_no_queue_goes_to_the_queue_its_task_declared(app, stack):
    """As with Python's producer (`app.enqueue("name")`, `taskrunner enqueue` without -A), a
    job the Node client is given no queue for goes to the task's queue as its workers
    declared it (read at most once per 10 s per task), else `default`: it always went to
    `default`, where a worker of the task's queue never looked, with the settings declared
    for `default`. Its arguments are checked with the declaration read."""
    stack.worker("-Q", "high", name="high-w")
    wait_for(lambda: app.redis.hexists(app.keys.tasks, "tests.apps.high"), what="the declarations")
    r = produce(stack, "--wait", "30", "tests.apps.high", '["from-node"]')
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["queue"], got["state"], got["worker"]) == ("high", "completed", "high-w")
    got = node_script(stack, """
      const chained = await tr.chain([{ task: 'tests.apps.high', args: ['step'] },
        { task: 'tests.apps.add', args: [1] }]);
      const plain = await tr.enqueue('tests.apps.add', [1, 2]);  // its workers declared no queue: default
      let refused = '';
      try { await tr.enqueue('tests.apps.high', []); } catch (e) { refused = `${e.name}: ${e.message}`; }
      console.log(JSON.stringify({ chained, plain, refused }));""")
    assert got["plain"]["queue"] == "default"
    assert got["refused"] == "BadArguments: tests.apps.high(key): missing a required argument: 'key'"
    first = app.job(got["chained"]["id"], "default").refresh().data["parents"].split()
    assert first[0] == "high"
    assert app.job(first[1], "high").wait(30) == 1


@pytest.mark.parametrize("flag,value", [("--delay", "abc"), ("--delay", "-5"), ("--delay", ""), ("--wait", "abc"),
                                        ("--wait", "-1"), ("--wait", "1e999")])
def test_the_node_producer_refuses_bad_seconds_before_it_enqueues(app, stack, flag, value):
    """A --delay or --wait that is not a number of seconds >= 0 is one line (exit 2) and
    enqueues nothing: `--delay abc` enqueued the job to run at once, and `--wait abc` (or -1)
    enqueued it and then failed (exit 2), leaving the job behind."""
    r = produce(stack, f"{flag}={value}", "--queue", "badsec", "tests.apps.add", "[1, 2]")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"Error: {flag} must be a number of seconds >= 0, not {json.dumps(value)}\n"
    assert not app.redis.sismember(app.keys.queues, "badsec")


def test_the_node_scripts_teach_with_help_and_refuse_mistakes_in_one_line(stack, tmp_path):
    """`--help` prints each script's usage, with an example (it was an "Unknown option"
    error, and the consumer's a stack trace); the consumer's mistakes (an unknown option, a
    handlers module that is missing or exports no handlers, an invalid queue or worker name)
    are one line, exit 2, not a stack trace."""
    for script in ("producer.js", "consumer.js"):
        r = subprocess.run(["node", script, "--help"], cwd=NODE_DIR, env=stack.env, capture_output=True, text=True,
                           timeout=60)
        assert (r.returncode, r.stderr) == (0, ""), r.stderr
        assert r.stdout.startswith(f"usage: node {script} ") and "\n  e.g. node " in r.stdout
    (tmp_path / "five.js").write_text("module.exports = 5;\n")
    for args, line in (
            (["--bogus"], "Unknown option '--bogus'"),
            (["nosuch.js"], "no handlers module nosuch.js"),
            ([str(tmp_path / "five.js")], "must export an object of task names to handlers, not number"),
            (["--queues", "a,bad{q}", "examples/handlers.js"], 'invalid queue name "bad{q}"'),
            (["--name", "a b", "examples/handlers.js"], 'invalid worker name "a b"')):
        r = subprocess.run(["node", "consumer.js", *args], cwd=NODE_DIR, env=stack.env, capture_output=True, text=True,
                           timeout=60)
        assert (r.returncode, r.stdout) == (2, ""), r.stderr
        assert r.stderr.startswith("Error: ") and line in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_the_node_producer_gives_up_on_an_unreachable_redis_in_one_line(stack):
    """With Redis unreachable the producer tries for TASKRUNNER_ENQUEUE_RETRY seconds (15 by
    default), then says so in one line (exit 3), as the Python producer does. It printed
    ioredis's "Unhandled error event" and a stack at each try; and ioredis failed the request
    at its own limit first (its 20 tries, about 11.5 s against a refused port): "Reached the
    max retries per request limit" (exit 2), the setting never reached."""
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in stack.env.items() if k != "TASKRUNNER_ENQUEUE_RETRY"}
    env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    r = subprocess.run(["node", "producer.js", "--queue", "q", "tests.apps.add", "[1, 2]"], cwd=NODE_DIR, env=env,
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (3, ""), r.stderr
    assert r.stderr == f"Error: cannot reach Redis: connect ECONNREFUSED 127.0.0.1:{port} (for 15s; set REDIS_URL)\n"


def test_the_node_producer_says_a_mistake_of_its_own_setup_is_one_exit_2(stack):
    """A scripts directory that is not there (TASKRUNNER_SCRIPTS) is a mistake (exit 2): any
    system error counted as Redis unavailable (exit 3, "try again"), a file's too (review)."""
    env = {**stack.env, "TASKRUNNER_SCRIPTS": "/nonexistent"}
    r = subprocess.run(["node", "producer.js", "--queue", "q", "tests.apps.add", "[1, 2]"], cwd=NODE_DIR, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "ENOENT" in r.stderr, r


def test_the_node_producer_gives_up_on_a_redis_that_does_not_answer(stack, tmp_path):
    """A Redis that takes the connection but answers nothing (stopped: SIGSTOP, a hung host)
    fires no error: the producer waited for good. It gives up as for one it cannot reach,
    after TASKRUNNER_ENQUEUE_RETRY and a socket timeout (5 s) more, in one line, exit 3."""
    server = RedisServer(tmp_path, appendonly=False, port=free_port()).start()
    try:
        server.proc.send_signal(signal.SIGSTOP)
        env = {**stack.env, "REDIS_URL": f"redis://127.0.0.1:{server.port}/0", "TASKRUNNER_ENQUEUE_RETRY": "1"}
        r = subprocess.run(["node", "producer.js", "--queue", "q", "tests.apps.add", "[1, 2]"], cwd=NODE_DIR, env=env,
                           capture_output=True, text=True, timeout=120)
        assert (r.returncode, r.stdout) == (3, ""), r.stderr
        assert r.stderr.startswith("Error: cannot reach Redis: it did not answer (for 6s; set REDIS_URL)"), r.stderr
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.stop()


def test_the_node_producer_waits_out_an_outage_until_its_wait_ends(app, tmp_path):
    """`--wait` rides out a Redis outage, as Python's `wait` does: a wait that ends during it
    says the job's state is unknown in one line (exit 3), one that lasts longer gets the job's
    record once Redis is back. Both gave up after TASKRUNNER_ENQUEUE_RETRY (1 s here), whatever
    --wait said, printing ioredis's "Unhandled error event" and a stack for their blocking
    connection."""
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    stack = Stack(app, server.url)
    env = {"TASKRUNNER_ENQUEUE_RETRY": "1"}
    try:
        app.configure(redis_url=server.url)
        short = spawn_node(stack, "producer.js", "--wait", "5", "--id", "short", "--queue", "outage", "tests.apps.add",
                           "[1, 2]", env=env)
        long = spawn_node(stack, "producer.js", "--wait", "120", "--id", "long", "--queue", "outage", "tests.apps.add",
                          "[3, 4]", env=env)
        wait_for(lambda: record(app, "outage", "short") and record(app, "outage", "long"), what="both jobs enqueued")
        server.stop()
        out, _ = short.communicate(timeout=60)  # the outage lasts longer than its wait
        assert short.returncode == 3, out
        assert out.startswith("Error: cannot reach Redis, the state of job short is unknown: ") and out.count("\n") == 1
        server.start()
        stack.worker("-Q", "outage")
        out, _ = long.communicate(timeout=90)
        assert long.returncode == 0, out
        assert (json.loads(out)["state"], json.loads(out)["result"]) == ("completed", "7")
    finally:
        stack.stop()
        server.stop()


def test_a_node_job_of_a_task_named_queue_is_enqueued(app, stack):
    """A task named "queue" given no queue goes to default: the producer took the task's name
    for the record's `queue` field when it put the job in its task's queue ("unknown field
    default", exit 2)."""
    r = produce(stack, "queue", "[1]")
    assert r.returncode == 0, r.stderr
    assert record(app, "default", r.stdout.strip())["task"] == "queue"


def test_the_node_producer_exits_as_the_cli_does(app, stack, tmp_path):
    """The producer's exit codes are the CLI's (README, Exit codes): 1 a refusal (a closed
    queue), 2 a mistake in what was given (a wrong password), 3 a Redis unavailable for now
    (a replica whose primary is gone answers MASTERDOWN); every failure was exit 2."""
    queues.create(app, "shut")
    queues.close(app, "shut")
    r = produce(stack, "--queue", "shut", "tests.apps.add", "[1, 2]")
    assert (r.returncode, r.stdout, r.stderr) == (1, "", "Error: queue shut is closed\n")
    server = RedisServer(tmp_path / "redis", appendonly=False, port=free_port()).start()
    try:
        admin = redis.Redis(unix_socket_path=str(server.socket))
        admin.config_set("replica-serve-stale-data", "no")
        admin.replicaof("127.0.0.1", free_port())  # a primary nothing answers at: the link stays down
        env = {**stack.env, "REDIS_URL": f"redis://127.0.0.1:{server.port}/0"}
        run = ["node", "producer.js", "--queue", "q", "tests.apps.add", "[1, 2]"]
        r = subprocess.run(run, cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (3, "") and r.stderr.startswith("Error: MASTERDOWN "), r.stderr
        admin.config_set("requirepass", "right")
        env["REDIS_URL"] = f"redis://:wrong@127.0.0.1:{server.port}/0"
        r = subprocess.run(run, cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (2, "") and r.stderr.startswith("Error: WRONGPASS "), r.stderr
    finally:
        server.stop()


@pytest.mark.parametrize("given,line", [
    (["[1,"], "ARGS_JSON is not JSON ("),
    (["{}"], "ARGS_JSON must be a JSON array, not {}"),
    (["[1]", "[2]"], "KWARGS_JSON must be a JSON object, not [2]"),
    (["[1]", "null"], "KWARGS_JSON must be a JSON object, not null")])
def test_the_node_producer_names_arguments_that_are_not_json_of_their_kind(app, stack, given, line):
    """ARGS_JSON and KWARGS_JSON are checked before Redis is asked, in one line naming which
    (JSON.parse's message alone, or the script's "ERR taskrunner: NotJSON: job ...: kwargs
    is not a JSON object"); nothing is enqueued."""
    r = produce(stack, "--queue", "notjson", "tests.apps.add", *given)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.startswith(f"Error: {line}") and r.stderr.count("\n") == 1, r.stderr
    assert not app.redis.sismember(app.keys.queues, "notjson")


def test_the_node_consumer_records_whatever_a_handler_throws_or_returns(app, stack, tmp_path):
    """A handler that throws something other than an Error fails its job with that value's
    text (`throw null` broke the consumer's reading of it, leaving the job claimed for good;
    a thrown string was "Error: undefined"; one neither JSON nor String() takes threw in the
    consumer, and its job stayed running for good), and one that returns a value JSON has no form
    for (a function) completes with null, as undefined (its result was left empty, which no
    reader takes for JSON)."""
    handlers = tmp_path / "odd.js"
    handlers.write_text("module.exports = {\n"
                        "  'odd.null': async () => { throw null; },\n"
                        "  'odd.text': async () => { throw 'out of paper'; },\n"
                        "  'odd.object': async () => { throw { code: 7 }; },\n"
                        "  'odd.fn': async () => () => 1,\n"
                        "  'odd.loop': async () => { const o = Object.create(null); o.o = o; throw o; },\n"
                        "};\n")
    spawn_node(stack, "consumer.js", "--name", "odd-c", "--queues", "odd", str(handlers))
    for task, message in (("odd.null", "null"), ("odd.text", "out of paper"), ("odd.object", '{"code":7}'),
                          ("odd.loop", "[object Object]")):
        job = app.enqueue(task, queue="odd")
        with pytest.raises(JobFailed) as e:
            job.wait(30)
        assert (e.value.error_type, e.value.message) == ("Error", message)
    job = app.enqueue("odd.fn", queue="odd")
    assert job.wait(30) is None and job.refresh().data["result"] == "null"



def test_the_node_producer_refuses_an_empty_queue_name(app, stack):
    """`--queue ''` (a variable left empty) is an invalid queue name, as Python's producer
    says it (exit 2, nothing enqueued); it was taken for no queue, and the job went to
    default."""
    r = produce(stack, "--queue", "", "tests.apps.add", "[1, 2]")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", 'Error: invalid queue name ""\n')
    assert not app.redis.sismember(app.keys.queues, "default")


@contextlib.contextmanager
def consumer_on_a_redis_of_its_own(app, tmp_path, name: str, up: bool = True, handlers: str = "examples/handlers.js",
                                   env: dict[str, str] | None = None,
                                   ) -> Iterator[tuple[RedisServer, subprocess.Popen, Path]]:
    """A Node consumer of `default` on a Redis of its own (to stop and start again; `up`:
    started before the consumer, which has beaten once), its output in a file (read while
    it runs): the server, the process, the file."""
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always")
    if up:
        server.start()
    log = tmp_path / "consumer.log"
    stack = Stack(app, server.url)
    try:
        app.configure(redis_url=server.url)
        with log.open("w") as out:
            p = subprocess.Popen(["node", "consumer.js", "--name", name, handlers], cwd=NODE_DIR,
                                 env={**stack.env, **(env or {})}, start_new_session=True, stdout=out,
                                 stderr=subprocess.STDOUT)
        stack.procs.append(p)
        if up:
            wait_for(lambda: app.redis.zscore(app.keys.workers, name), what="the consumer's first heartbeat")
        yield server, p, log
    finally:
        stack.stop()
        server.stop()


def test_the_node_consumer_tells_a_redis_outage_in_two_lines_and_goes_on(app, tmp_path):
    """A Redis outage under the Node consumer is one line when Redis stops answering and one
    when it answers again, as taskrunner's processes say it; ioredis's reconnection errors
    went unheard, each printed with its stack ("[ioredis] Unhandled error event": about a
    hundred lines in 8 s)."""
    with consumer_on_a_redis_of_its_own(app, tmp_path, "outage-c") as (server, p, log):
        server.stop()
        wait_for(lambda: "Redis unavailable" in log.read_text() or "Unhandled" in log.read_text(),
                 what="the consumer to find Redis gone")
        server.start()
        assert app.enqueue("node.echo", [1]).wait(30)["args"] == [1]
        stop(p)
        lines = log.read_text().splitlines()
        assert lines[0] == "consumer outage-c: queues default"
        assert lines[-1] == "consumer outage-c: stopped after 1 jobs"
        assert lines[1].startswith("outage-c: Redis unavailable (")
        assert lines[1].endswith("); trying again until it answers")
        assert lines[2].startswith("outage-c: Redis answers again (unavailable for ")
        assert not [line for line in lines if "Unhandled" in line or " Redis " in line][2:], lines


def test_the_node_consumer_outlives_an_outage_longer_than_ioredis_retries(app, tmp_path):
    """After about 10 s of outage ioredis fails the requests it holds (its 20 retries per
    request): the consumer tries again, saying the first such failure, and takes jobs once
    Redis is back. The wait for kill requests did not catch it: its unawaited promise was
    rejected, and Node ended the process."""
    with consumer_on_a_redis_of_its_own(app, tmp_path, "long-c") as (server, p, log):
        server.stop()
        wait_for(lambda: "max retries per request" in log.read_text() or p.poll() is not None, timeout=90,
                 what="ioredis to give up on the requests it held")
        server.start()
        assert app.enqueue("node.echo", [2]).wait(60)["args"] == [2], log.read_text()
        stop(p)
        failed = [line for line in log.read_text().splitlines() if "max retries per request" in line]
        assert len(failed) == 1 and failed[0].endswith("; trying again"), log.read_text()


def test_the_node_consumer_stopped_while_redis_is_down_stops_at_once(app, tmp_path):
    """SIGTERM while Redis is down: the consumer stops within about a heartbeat (exit 0), in
    one line more, as a worker does, rather than waiting for Redis: it waited for ioredis's
    tries of its claim, then of its leaving (a minute and more), and then ended on "Error:
    Reached the max retries per request limit" (exit 1)."""
    with consumer_on_a_redis_of_its_own(app, tmp_path, "down-c") as (server, p, log):
        server.stop()
        wait_for(lambda: "Redis unavailable" in log.read_text(), what="the consumer to find Redis gone")
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
        lines = log.read_text().splitlines()
        assert p.returncode == 0, lines
        assert lines[-2:] == ["down-c: stopping without leaving the worker list: Redis is unavailable (the dispatcher "
                              "finds us dead)", "consumer down-c: stopped after 0 jobs"], lines


def test_the_node_consumer_started_before_redis_waits_for_it(app, tmp_path):
    """A consumer started while its Redis is down waits for it, as taskrunner's worker does;
    it said it would try again, then stopped at once: "Error: Connection is closed." (exit 1)."""
    with consumer_on_a_redis_of_its_own(app, tmp_path, "early-c", up=False) as (server, p, log):
        wait_for(lambda: "Redis unavailable" in log.read_text() or p.poll() is not None,
                 what="the consumer to find no Redis")
        server.start()
        assert app.enqueue("node.echo", [3]).wait(60)["args"] == [3], log.read_text()
        stop(p)
        lines = log.read_text().splitlines()
        assert lines[1].startswith("early-c: Redis unavailable (connect ENOENT ") and "Error" not in log.read_text()
        assert lines[2].startswith("early-c: Redis answers again (unavailable for "), lines


def test_the_node_consumer_refused_by_redis_stops_in_one_line(tmp_path):
    """A Redis that answers but refuses the consumer (a wrong password) is no outage: one line,
    the refusal, and it stops (exit 1); it said "Connection is closed." alone."""
    server = RedisServer(tmp_path / "redis", appendonly=False, port=free_port()).start()
    try:
        redis.Redis(unix_socket_path=str(server.socket)).config_set("requirepass", "right")
        env = {**os.environ, "REDIS_URL": f"redis://:wrong@127.0.0.1:{server.port}/0"}
        r = subprocess.run(["node", "consumer.js", "--name", "refused-c", "examples/handlers.js"], cwd=NODE_DIR,
                           env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stderr) == (1, "Error: WRONGPASS invalid username-password pair or user is "
                                               "disabled.\n"), r.stderr
    finally:
        server.stop()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-job"])
def test_the_node_consumer_stopped_while_redis_is_stopped_stops_in_bounded_time(app, tmp_path, busy):
    """SIGTERM while Redis is stopped (SIGSTOP: the connection stays open, nothing answers,
    no error comes): the consumer stops within the worker's bound, shutdown_grace (5 s here) +
    kill_grace (1 s) + 10 s, idle as soon as a PING has gone 5 s unanswered, saying so in one
    line (exit 0). It waited for good: only an error told it Redis was unavailable."""
    with consumer_on_a_redis_of_its_own(app, tmp_path, "hung-c") as (server, p, log):
        if busy:
            job = app.enqueue("node.slow_add", [1, 2, 300])
            wait_for(lambda: running_on(app, job, "hung-c"), what="the job running on Node")
        server.proc.send_signal(signal.SIGSTOP)
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        lines = log.read_text().splitlines()
        assert p.returncode == 0, lines
        said = (f"reporting job {job.id} or leaving the worker list, 16s after the stop: Redis did not answer for 5s"
                if busy else "leaving the worker list: Redis did not answer for 5s")
        assert lines[-2:] == [f"hung-c: stopping without {said} (the dispatcher finds us dead)",
                              f"consumer hung-c: stopped after {int(busy)} jobs"], lines


HELD = """// A handler that holds the consumer when its job is told to stop (synchronously, in the abort
// event, before the consumer sends the job's finish) until the file $HELD.go is there.
const fs = require('fs');
module.exports = {
  'node.held': async (args, kwargs, ctx) => {
    ctx.signal.addEventListener('abort', () => {
      fs.writeFileSync(`${process.env.HELD}.stopped`, '');
      const until = Date.now() + 60000;
      while (!fs.existsSync(`${process.env.HELD}.go`) && Date.now() < until) {
        Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 20);
      }
    });
    await new Promise(() => {}); // runs until stopped
  },
};
"""


def test_a_node_job_killed_during_an_outage_is_reported_at_a_stop_as_a_worker_does(app, tmp_path):
    """A job killed just before Redis went down, its finish not sent: SIGTERM then gives it the
    worker's bound (shutdown_grace + kill_grace + 10 s) to report it, as a worker keeps its
    outbox until then; Redis back meanwhile, the job ends killed and the consumer leaves. A
    stopped job counted as nothing to report: the consumer gave up at the next beat, the job
    left running under a consumer gone."""
    (tmp_path / "held.js").write_text(HELD)
    held = tmp_path / "held"
    env = {"HELD": str(held), "TASKRUNNER_SHUTDOWN_GRACE": "30"}
    with consumer_on_a_redis_of_its_own(app, tmp_path, "kill-c", handlers=str(tmp_path / "held.js"),
                                        env=env) as (server, p, log):
        job = app.enqueue("node.held", [])
        wait_for(lambda: running_on(app, job, "kill-c"), what="the job running on Node")
        assert job.kill("tester") == "running"
        wait_for(lambda: Path(f"{held}.stopped").exists(), what="the consumer told to stop the job")
        server.stop()
        Path(f"{held}.go").write_text("")
        wait_for(lambda: "Redis unavailable" in log.read_text(), what="the consumer to find Redis gone")
        p.send_signal(signal.SIGTERM)
        wait_for(lambda: "consumer kill-c: stopping" in log.read_text() or p.poll() is not None,
                 what="the consumer to take the stop")
        server.start()
        p.wait(timeout=60)
        lines = log.read_text().splitlines()
        assert p.returncode == 0 and lines[-1] == "consumer kill-c: stopped after 1 jobs", lines
        d = job.refresh().to_dict()
        assert (d["state"], d["error_type"]) == ("killed", "Killed"), lines
        assert app.redis.zscore(app.keys.workers, "kill-c") is None


def test_the_node_consumer_leaves_no_timer_once_it_has_left(stack):
    """A consumer stopped cleanly leaves no timer of its own behind: the watch stop() set on
    Redis re-armed itself at every beat for good after the leave (unref'd, so that the process
    could exit, but work for nothing in a program that goes on)."""
    got = node_script(stack, """
      const live = new Set(); // the timers the client set itself (not ioredis's) that are still due
      const [set, clear] = [global.setTimeout, global.clearTimeout];
      global.setTimeout = (fn, ms, ...args) => {
        const t = set(() => { live.delete(t); fn(...args); }, ms);
        if (new Error().stack.split('\\n')[2].includes('/clients/node/taskrunner.js:')) live.add(t);
        return t;
      };
      global.clearTimeout = (t) => { live.delete(t); clear(t); };
      const c = new Consumer(tr, {}, { name: 'left-c' });
      const started = c.start();
      for (const until = Date.now() + 30000; Date.now() < until;) { // its first beat, 30 s at most
        if (await tr.redis.zscore(tr.g + 'workers', 'left-c')) break;
        await new Promise((r) => set(r, 20));
      }
      c.stop();
      await started;
      const left = await tr.redis.zscore(tr.g + 'workers', 'left-c') === null;
      tr.redis.disconnect();
      console.log(JSON.stringify({ left, timers: live.size }));
    """)
    assert got == {"left": True, "timers": 0}


def test_the_node_consumer_keeps_nothing_of_the_requests_it_waited_for(stack):
    """What the consumer waits for (answered(): a request, or nothing once it gave up on Redis)
    is let go once answered: a Promise.race with a promise settled only when giving up kept
    about 300 bytes per wait for good, two or more per job (over 60 MB for 200,000 waits)."""
    program = ("const { TaskRunner, Consumer } = require('./taskrunner');\n"
               "(async () => { const c = new Consumer(new TaskRunner(), {}, { name: 'mem-c' });\n"
               "global.gc(); const before = process.memoryUsage().heapUsed;\n"
               "for (let i = 0; i < 200000; i++) await c.answered(Promise.resolve(i));\n"
               "global.gc(); console.log(process.memoryUsage().heapUsed - before); })();")
    r = subprocess.run(["node", "--expose-gc", "-e", program], cwd=NODE_DIR, env=stack.env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) < 10_000_000, f"{int(r.stdout) / 1e6:.1f} MB kept after 200,000 waits"


def test_the_node_producer_says_why_it_could_not_read_a_tasks_declaration(app, tmp_path):
    """Redis's answer to the read of a task's declaration (its queue, its parameters) is told,
    as Python's producer tells it: here a user whose ACL does not cover the declarations, one
    line, exit 1 as the CLI's (an error Redis answered with), for the enqueue's own NOPERM
    too. The error was taken for "nothing declared": the job went to default, where the task's
    workers do not look, unchecked (exit 0); a NOPERM exited 2, a mistake in what was given."""
    server = RedisServer(tmp_path / "redis", appendonly=False, port=free_port()).start()
    try:
        r = redis.Redis(unix_socket_path=str(server.socket), decode_responses=True)
        p = app.settings.prefix
        r.hset(f"{p}:{{_}}:tasks", "shop.report", json.dumps({"queue": "reports", "params": ["n"]}))
        r.acl_setuser("producer", enabled=True, passwords=["+pw"], commands=["+@all"],
                      keys=[f"{p}:{{default}}:*", f"{p}:{{reports}}:*", f"{p}:{{_}}:queues"])
        env = {**os.environ, "TASKRUNNER_PREFIX": p, "REDIS_URL": f"redis://producer:pw@127.0.0.1:{server.port}/0"}
        for given in ([], ["--queue", "other"]):
            got = subprocess.run(["node", "producer.js", *given, "shop.report", "[7]"], cwd=NODE_DIR, env=env,
                                 capture_output=True, text=True, timeout=60)
            assert (got.returncode, got.stdout) == (1, ""), got
            assert got.stderr.startswith("Error: NOPERM ") and got.stderr.count("\n") == 1, got.stderr
        assert not r.exists(f"{p}:{{default}}:pending")
        cli = subprocess.run([sys.executable, "-m", "taskrunner", "enqueue", "shop.report", "--args", "[7]"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert (cli.returncode, cli.stderr.startswith("Error: Redis answered with an error: ")) == (1, True), cli
    finally:
        server.stop()


def test_the_node_consumer_refuses_a_name_a_live_worker_holds(app, stack):
    """A second consumer given the name of a live one is refused in one line (exit 2), as a
    worker is: both ran, popping each other's kill requests, and one handed the other's job
    back as never begun, so that a job killed while running ran again. dead_after is 60 s here:
    with the tests' 1.5 s, the first one stalled that long on a loaded machine counts as dead."""
    live = {"TASKRUNNER_DEAD_AFTER": "60"}
    consumer(stack, "twin", env=live)
    wait_for(lambda: app.redis.zscore(app.keys.workers, "twin"), what="the first consumer's heartbeat")
    r = subprocess.run(["node", "consumer.js", "--name", "twin", "examples/handlers.js"], cwd=NODE_DIR,
                       env={**stack.env, **live}, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (2, "consumer twin: queues default\n"), r
    assert re.fullmatch(r'Error: worker name "twin" is in use by a live worker \(heartbeat \d+\.\ds ago\); '
                        r"pick another name \(--name\)\n", r.stderr), r.stderr


def test_the_node_producer_sends_expires_and_a_python_worker_never_runs_the_job_past_it(app, stack):
    """`--expires S` (enqueue()'s `expires`: seconds or a Date) is stored as Redis's now + S,
    named in `opt`; once it passed, a Python worker's claim ends the job killed, Expired,
    without running it. A bad value is one line before anything is enqueued (exit 2)."""
    r = produce(stack, "--expires", "0.05", "--queue", "default", "tests.apps.record", '["node expired"]')
    assert r.returncode == 0, r.stderr
    job = app.job(r.stdout.strip(), "default")
    assert job.data["opt"] == "expires"
    expiry = float(job.data["expires"])
    assert expiry - float(job.data["enqueued_at"]) == pytest.approx(0.05, abs=1e-5)
    wait_for(lambda: sum(x / 10 ** (6 * i) for i, x in enumerate(app.redis.time())) >= expiry, what="its expiry")
    stack.worker()
    with pytest.raises(JobFailed, match="killed: Expired: not started before it expired at "):
        job.wait(30)
    assert app.redis.get(f"{app.settings.prefix}:ledger:node expired") is None
    got = node_script(stack, "const out = []; const { id } = await tr.enqueue('tests.apps.add', [1, 2], {}, "
                             "{ queue: 'default', expires: new Date(Date.now() + 3600e3) }); out.push(id); "
                             "for (const expires of [new Date(Date.now() - 1000), 0, -1, '5']) { try { "
                             "await tr.enqueue('tests.apps.add', [1, 2], {}, { queue: 'badexp', expires }); "
                             "out.push('enqueued'); } catch (e) { out.push(e.message.split(' not ')[0]); } } "
                             "console.log(JSON.stringify(out));")
    rec = app.job(got[0], "default").data
    assert 3000 < float(rec["expires"]) - float(rec["enqueued_at"]) <= 3600 + 1e-5
    assert got[1].startswith("expires ") and got[1].endswith("has passed: the job could never run")
    assert got[2:] == ["expires must be seconds from now (a finite number > 0 and < 2^53) or a Date,"] * 3
    for bad in ("0", "-1", "abc"):
        r = produce(stack, f"--expires={bad}", "--queue", "badexp", "tests.apps.add", "[1, 2]")
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr == f"Error: --expires must be a number of seconds > 0, not {json.dumps(bad)}\n"
    assert not app.redis.sismember(app.keys.queues, "badexp")


def test_a_node_job_claimed_as_the_stop_arrives_gets_the_grace_and_goes_back(app, stack):
    """A stop that arrives while a claim is in flight (here: as its answer comes back, before
    the consumer runs the job it brings) gives that job the rest of shutdown_grace (5 s
    here), then puts it back next in line, as a worker's claim in flight lands under its
    stop_at. The grace was armed only for a job running at the stop: this one ran on, and
    at shutdown_grace + kill_grace + 10 s the consumer gave up on a Redis that answered
    ("Redis did not answer"), leaving the job claimed by a consumer gone."""
    job = app.enqueue("node.held", [])
    got = node_script(stack, """
      const c = new Consumer(tr, { 'node.held': (args, kwargs, ctx) => new Promise((resolve) => {
        ctx.signal.addEventListener('abort', resolve); // runs until stopped
      }) }, { name: 'late-c' });
      const claim = c.claim.bind(c);
      c.claim = async () => { const d = await claim(); if (d) c.stop(); return d; };
      await c.start();
      console.log(JSON.stringify({ abandoned: c.abandoned, processed: c.processed }));
    """)
    assert got == {"abandoned": None, "processed": 1}
    d = job.refresh().to_dict()
    assert (d["state"], d["attempts"]) == ("pending", 1) and "late-c shutting down" in job.data["end:1"]
    assert app.redis.zscore(app.keys.workers, "late-c") is None


def led_node(app, server: RedisServer, program: str) -> subprocess.Popen:
    """`program` run by node on `server`, led a step at a time: lines to its stdin, from its stdout."""
    return subprocess.Popen(["node", "-e", program], cwd=NODE_DIR, env=Stack(app, server.url).env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_node_consumer_given_up_on_redis_sends_nothing_after(app, tmp_path):
    """A program that runs a Consumer (the library, not consumer.js), stopped while its Redis
    is stopped (SIGSTOP), goes on once start() has ended and closes its connection: nothing
    the consumer sent is left to fail, and the stop's line is its last. It sent its leave
    after giving up on Redis and no longer listened for the answer: the close failed the
    request, unhandled, and Node ended the program ("Error: Connection is closed.", exit 1; a
    Redis down: at ioredis's 20th try). Then its kill requests' BRPOP, never closed, kept the
    program from ending, and the heartbeats sent one a beat on the silent Redis each said
    "trying again" after the stop's line."""
    server = RedisServer(tmp_path / "redis", appendonly=False, port=free_port()).start()
    program = """
      const { TaskRunner, Consumer, sleep } = require('./taskrunner');
      (async () => {
        const tr = new TaskRunner();
        const c = new Consumer(tr, {}, { name: 'lib-c' });
        const started = c.start();
        for (const until = Date.now() + 30000; Date.now() < until;) { // its first beat, 30 s at most
          if (await tr.redis.zscore(tr.g + 'workers', 'lib-c')) break;
          await sleep(0.02);
        }
        console.log('beaten');
        await new Promise((resolve) => process.stdin.once('data', resolve)); // Redis stopped
        process.stdin.destroy();
        c.stop();
        await started;
        tr.redis.disconnect(); // what it held fails as the socket closes (the program lives until then)
        console.log(JSON.stringify({ abandoned: c.abandoned }));
      })();
    """
    try:
        p = led_node(app, server, program)
        try:
            assert p.stdout is not None and p.stdout.readline() == "beaten\n"
            server.proc.send_signal(signal.SIGSTOP)
            try:
                out, err = p.communicate("go\n", timeout=60)
            finally:
                server.proc.send_signal(signal.SIGCONT)
        finally:
            p.kill()
            p.wait()
        assert p.returncode == 0, err
        assert json.loads(out) == {"abandoned": "leaving the worker list: Redis did not answer for 5s (the "
                                                "dispatcher finds us dead)"}, err
        assert err == ("lib-c: stopping without leaving the worker list: Redis did not answer for 5s (the "
                       "dispatcher finds us dead)\n"), err
    finally:
        server.stop()


def test_a_node_consumer_stopped_once_redis_is_back_leaves(app, tmp_path):
    """A stop once Redis is back, while a connection of the consumer's (its kill requests',
    its wake lists') still waits to try again, leaves the worker list: the outage lasts until
    every connection is back, and the consumer took it for Redis unavailable and gave up
    without leaving (a job it had just reported killed stayed listed under a consumer gone).
    Those connections try again every 6 s here, the one that leaves at once (ioredis's)."""
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always").start()
    program = """
      const { TaskRunner, Consumer, sleep } = require('./taskrunner');
      const line = () => new Promise((resolve) => process.stdin.once('data', resolve));
      const until = async (what) => { // 30 s at most
        for (const end = Date.now() + 30000; Date.now() < end && !(await what());) await sleep(0.02);
      };
      (async () => {
        const tr = new TaskRunner();
        const duplicate = tr.connection.bind(tr);
        const slow = (times) => (times === 1 ? 50 : 6000); // first try: Redis down; the next: Redis back
        tr.connection = () => { const conn = duplicate(); conn.options.retryStrategy = slow; return conn; };
        const c = new Consumer(tr, {}, { name: 'back-c' });
        const started = c.start();
        await until(async () => await tr.redis.zscore(tr.g + 'workers', 'back-c'));
        console.log('beaten');
        await line(); // Redis stopped
        await until(() => tr.outage.down.size === 3); // the one that leaves, the kill requests', the wake lists'
        console.log('unavailable');
        await line(); // Redis started again
        process.stdin.destroy();
        await until(() => tr.redis.status === 'ready');
        c.stop();
        await started;
        const left = await tr.redis.zscore(tr.g + 'workers', 'back-c') === null;
        tr.redis.disconnect();
        console.log(JSON.stringify({ abandoned: c.abandoned, left }));
      })();
    """
    try:
        p = led_node(app, server, program)
        try:
            assert p.stdout is not None and p.stdout.readline() == "beaten\n"
            server.stop()
            assert p.stdin is not None
            p.stdin.write("stopped\n")
            p.stdin.flush()
            assert p.stdout.readline() == "unavailable\n"
            server.start()
            out, err = p.communicate("started\n", timeout=60)
        finally:
            p.kill()
            p.wait()
        assert p.returncode == 0, err
        assert json.loads(out) == {"abandoned": None, "left": True}, err
    finally:
        server.stop()
