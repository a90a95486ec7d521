"""The protocol is language-agnostic: clients/node (Node.js + ioredis, written from
docs/PROTOCOL.md) against real Python workers and dispatchers on a real Redis.

Needs `node` and the client's npm packages (`npm ci --prefix clients/node`, which `make test`
runs). Without them the tests are skipped, except under CI (CI=true), where they fail."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from taskrunner.errors import JobFailed
from tests.conftest import ROOT, Stack, wait_for

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


def spawn_node(stack: Stack, *args: str) -> subprocess.Popen:
    """A Node process in its own process group, stopped (SIGKILL to the group) by the stack."""
    p = subprocess.Popen(["node", *args], cwd=NODE_DIR, env=stack.env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stack.procs.append(p)
    return p


def consumer(stack: Stack, name: str, queues: str = "default") -> subprocess.Popen:
    return spawn_node(stack, "consumer.js", "--name", name, "--queues", queues, "examples/handlers.js")


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
    assert "worker node-1 is dead" in job.data["end:1"]
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
