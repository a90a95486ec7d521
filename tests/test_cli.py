"""The CLI contract, run as a user would: real processes, real Redis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any

import pytest

from tests import apps
from tests.conftest import ROOT, free_port, wait_for


def test_enqueue_status_wait(app, stack):
    r = stack.cli("enqueue", "tests.apps.add", "--args", "[1, 2]", check=True)
    job_id = r.stdout.strip()
    assert len(job_id) == 26 and "\n" not in job_id
    st = json.loads(stack.cli("status", job_id, "--json", check=True).stdout)
    for k in ("id", "task", "queue", "state", "stuck", "attempts", "result", "error", "worker", "host", "pid",
              "enqueued_at", "started_at", "finished_at"):
        assert k in st, k
    assert st["state"] == "pending" and st["stuck"] is False
    assert stack.cli("wait", job_id, "--timeout", "0.2").returncode == 2
    stack.worker()
    r = stack.cli("wait", job_id, "--timeout", "30")
    assert (r.returncode, r.stdout.strip()) == (0, "3")
    text = stack.cli("status", job_id, check=True).stdout
    assert "completed" in text and "result  3" in text


def test_status_says_when_a_delayed_job_is_due(app, stack):
    """A delayed job (delay=, a retry's backoff, Retry(delay=)) said neither when it runs nor
    that it waits for a time: its status showed enqueued, and dashes (--json has due_at)."""
    job = apps.add.apply_async([1, 2], delay=3600)
    due = json.loads(stack.cli("status", job.id, "--json", check=True).stdout)["due_at"]
    text = stack.cli("status", job.id, check=True).stdout
    stamp = datetime.fromtimestamp(due, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert re.search(rf"^ +due  {stamp}$", text, re.M), text


def test_wait_says_all_that_its_exit_1_means(app, stack):
    """wait exits 1 for a workflow step canceled by its parent's failure, and for no such
    job, as for a failed or killed one: its help and README said "1 failed or killed"."""
    handle = (apps.boom.si("bad") | apps.add.s(1)).delay()
    stack.worker()
    r = stack.cli("wait", handle.id, "--timeout", "30")
    assert r.returncode == 1 and r.stderr.startswith("canceled: Canceled: step"), r.stderr
    r = stack.cli("wait", "no-such-job")
    assert r.returncode == 1 and "no job no-such-job" in r.stderr, r.stderr
    said = " ".join(stack.cli("wait", "--help", check=True).stdout.split())
    assert "1 failed, killed or canceled" in said and "no such job, or a result that is not JSON" in said, said


def test_retry_of_a_canceled_step_names_the_step_to_retry(app, stack):
    """A canceled workflow step cannot be retried; the step whose end canceled it can, and
    brings it back: `retry` said only "only failed or killed jobs can be retried"."""
    handle = (apps.boom.si("bad") | apps.add.s(1)).delay()
    stack.worker()
    assert stack.cli("wait", handle.id, "--timeout", "30").returncode == 1
    failed = app.job(handle.id).data["canceled_by"].split()[1]
    r = stack.cli("retry", handle.id)
    assert r.returncode == 1 and f"retry {failed}" in r.stderr, r.stderr
    assert stack.cli("retry", failed, check=True).stdout.strip() == f"{failed}: queued again"


def test_enqueue_options_and_failure_exit_code(app, stack):
    r = stack.cli("enqueue", "tests.apps.boom", "--kwargs", '{"message": "bad"}', "-q", "q2", "--delay", "0",
                  "--max-duration", "5", "--retries", "0", "--id", "cli-1", check=True)
    assert r.stdout.strip() == "cli-1"
    stack.worker("-Q", "q2")
    r = stack.cli("wait", "cli-1", "--timeout", "30")
    assert r.returncode == 1 and "ValueError: bad" in r.stderr
    again = stack.cli("enqueue", "tests.apps.boom", "--args", '["x"]', "--id", "cli-1", "-q", "q2", check=True)
    assert again.stdout.strip() == "cli-1" and "exists already" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--args", "[1,"], "not valid JSON"),
    (["--args", '{"a": 1}'], "must be a JSON array"),
    (["--kwargs", "[1]"], "must be a JSON object"),
    (["-q", "bad queue"], "invalid queue name"),
])
def test_enqueue_bad_input(app, stack, args, message):
    r = stack.cli("enqueue", "tests.apps.add", *args)
    assert r.returncode != 0 and message in r.stderr
    assert app.queue_names() in ([], ["default"])


def test_kill_jobs_queues_workers(app, stack):
    ids = [stack.cli("enqueue", "tests.apps.add", "--args", f"[{i}, 0]", check=True).stdout.strip()
           for i in range(3)]
    r = stack.cli("kill", ids[0], check=True)
    assert "killed" in r.stdout
    listed = json.loads(stack.cli("jobs", "--state", "pending", "--json", check=True).stdout)
    assert [j["id"] for j in listed] == ids[1:]  # oldest first
    killed = json.loads(stack.cli("jobs", "-q", "default", "--state", "killed", "--json", check=True).stdout)
    assert [j["id"] for j in killed] == ids[:1] and killed[0]["state"] == "killed"
    [q] = json.loads(stack.cli("queues", "--json", check=True).stdout)
    assert {k: q[k] for k in ("name", "pending", "delayed", "running", "completed", "failed", "killed")} == {
        "name": "default", "pending": 2, "delayed": 0, "running": 0, "completed": 0, "failed": 0, "killed": 1}
    assert "default" in stack.cli("queues", check=True).stdout
    stack.worker(name="cli-w")
    ws = wait_for(lambda: json.loads(stack.cli("workers", "--json", check=True).stdout), what="worker listed")
    w = ws[0]
    assert w["name"] == "cli-w" and w["state"] == "alive" and w["concurrency"] == 2 and len(w["children"]) == 2
    for k in ("host", "ip", "pid", "queues", "busy", "rss", "cpu", "heartbeat_age"):
        assert k in w
    assert "cli-w" in stack.cli("workers", check=True).stdout
    assert "no job" in stack.cli("kill", "nope").stderr


def test_a_kill_of_an_ended_job_says_it_had_ended(app, stack):
    """`kill` of a job that had already ended says so on stderr, exit 1 (refused, as `retry`
    of a job in the wrong state), and changes nothing: for a killed job it printed "killed",
    exit 0, as if it had just killed it (found by the newcomer sweep)."""
    pending = apps.add.delay(1, 2)
    r = stack.cli("kill", pending.id)
    assert (r.returncode, r.stdout) == (0, f"{pending.id}: killed\n"), r.stderr
    for state, job in stack.ended_jobs().items():
        r = stack.cli("kill", job.id)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", f"job {job.id} already ended: {state}\n")
        assert job.refresh().state == state


def test_exit_codes_follow_one_scheme(app, stack):
    """One scheme a script can rely on (README, *Exit codes*): 1 refused because of a state
    (`retry` of a pending job, `kill` of an ended one), 2 a mistake in what was given, 3
    Redis unreachable, whichever the command. `kill` of an ended job exited 3 (what `wait`
    says of an unreachable Redis), any other command 1 with Redis unreachable (as a refusal),
    and `wait` 3 for a URL naming a database the server lacks (a mistake: 2)."""
    pending = apps.add.delay(1, 2)
    r = stack.cli("retry", pending.id)
    assert (r.returncode, r.stdout) == (1, ""), r
    assert pending.kill("tests") == "killed"
    assert stack.cli("kill", pending.id).returncode == 1
    down = f"redis://127.0.0.1:{free_port()}/0"
    for args in (["status", pending.id], ["kill", pending.id], ["retry", pending.id], ["queues"], ["jobs"],
                 ["wait", pending.id, "--timeout", "0.5"]):
        r = stack.cli(*args, "--redis-url", down)
        assert r.returncode == 3 and one_line_error(r).startswith("Error: cannot reach Redis"), (args, r)
    wrong_db = stack.url.rsplit("/", 1)[0] + "/99" if stack.url.startswith("redis://") else None
    if wrong_db:
        r = stack.cli("wait", pending.id, "--redis-url", wrong_db)
        assert r.returncode == 2 and "has no such database" in one_line_error(r), r
    r = stack.cli("kill")
    assert r.returncode == 2 and "Missing argument" in r.stderr


def test_a_redis_failing_over_exits_3(app, stack, tmp_path):
    """An error a failover answers with (READONLY from a primary demoted to a replica; also
    MASTERDOWN, CLUSTERDOWN, TRYAGAIN, BUSY) is Redis unreachable for now, exit 3 ("try
    again"), as the producer's own retries take it: it exited 1 ("Redis answered with an
    error"), which the scheme says is a refusal, and `wait` 1, which says the job failed."""
    import redis

    from taskrunner.ops.redis_server import RedisServer

    server = RedisServer(tmp_path, appendonly=False).start()
    try:
        with redis.Redis(unix_socket_path=str(server.socket)) as admin:
            admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a primary nobody answers for
        env = {**stack.env, "REDIS_URL": server.url, "TASKRUNNER_ENQUEUE_RETRY": "0.3"}
        for args in (["enqueue", "tests.apps.add", "--args", "[1, 2]"], ["queue", "create", "fo"]):
            r = subprocess.run([sys.executable, "-m", "taskrunner", "-A", "tests.apps", *args], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 3 and "READONLY" not in r.stdout and "try again" in r.stderr, (args, r)
    finally:
        server.stop()


def test_ctrl_c_exits_130(app, stack):
    """Ctrl-C on a command (here `wait`, blocked in Redis) exits 130, as a shell says an
    interrupted command ended: click's "Aborted!" exited 1, which `wait` says of a job that
    failed."""
    import signal

    job = apps.add.delay(1, 1)  # no worker: it stays pending
    p = stack.spawn("wait", job.id)
    wait_for(lambda: any(c.get("cmd") == "blpop" for c in app.redis.client_list()), what="wait to block in Redis")
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 130 and "interrupted" in out and "Traceback" not in out, (p.returncode, out)


def test_unknown_job_and_bad_url(app, stack):
    r = stack.cli("status", "nope")
    assert r.returncode == 1 and "no job nope" in r.stderr
    r = stack.cli("status", "x", "--redis-url", "nonsense")
    assert r.returncode == 2 and "bad Redis URL" in r.stderr
    r = stack.cli("queues", "--redis-url", "redis://127.0.0.1:1/0")
    assert r.returncode == 3 and "cannot reach Redis" in r.stderr


def test_help_teaches(stack):
    out = stack.cli("--help", check=True).stdout
    for cmd in ("enqueue", "status", "wait", "kill", "jobs", "queues", "workers", "worker", "dispatcher", "up"):
        assert cmd in out
    assert "priority order" in stack.cli("worker", "--help", check=True).stdout
    # An enqueue that ran out of TASKRUNNER_ENQUEUE_RETRY exits 3 (README's exit codes), as
    # test_exit_codes_follow_one_scheme checks: its help said 1.
    assert "fails (exit 3" in " ".join(stack.cli("enqueue", "--help", check=True).stdout.split())
    r = stack.cli("worker")
    assert r.returncode == 2 and "needs your app" in r.stderr


def cli_options():
    """(`taskrunner COMMAND`, option) for every option of every command, subcommands included."""
    import click

    from taskrunner.cli import main

    def commands(cmd: click.Command, path: str):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from commands(sub, f"{path} {name}")
        else:
            yield path, cmd

    return [(path, p) for path, cmd in commands(main, "taskrunner") for p in cmd.params if isinstance(p, click.Option)]


def test_every_option_of_every_command_says_what_it_does():
    """`COMMAND --help` explains each option: `jobs --limit`, `--offset`, the `--json` of
    jobs, queues, workers, schedule list, queue info, inspect and history status/compact,
    `up -c` and the `-q` of purge, recover and inspect were listed bare."""
    assert [f"{path} {p.opts[-1]}" for path, p in cli_options() if not p.help] == []


def test_the_readme_names_every_option_of_every_command():
    """README's CLI table lists each command's options: `enqueue --priority` and `--unique-*`,
    `jobs --limit`/`--offset`, `worker`'s and `dispatcher`'s `--name`, `up --exit`, `schedule
    add --missed` and `inspect --limit` were in `--help` only."""
    readme = (ROOT / "README.md").read_text()
    missing = [(path, p.opts) for path, p in cli_options()
               if not any(o in readme for o in p.opts + p.secondary_opts if o.startswith("--"))]
    assert missing == []


# -- queue open, and destructive commands that ask (issue 14) ---------------------------


def run_cli(stack, *args: str, stdin: Any = None, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`taskrunner ARGS` with stdin a pipe fed `input`, or the file descriptor `stdin` (a
    pty); `env` added to the stack's environment."""
    return subprocess.run([sys.executable, "-m", "taskrunner", *args], cwd=ROOT, env={**stack.env, **(env or {})},
                          stdin=stdin, input=input, capture_output=True, text=True, timeout=60)


def test_queue_open_undoes_close(app, stack):
    from taskrunner.errors import QueueClosed
    from taskrunner.ops import queue

    apps.add.apply_async([1, 2], queue="shut")
    assert "queue open shut" in stack.cli("queue", "close", "shut", check=True).stdout
    assert stack.cli("enqueue", "tests.apps.add", "-q", "shut").returncode == 1
    assert stack.cli("queue", "open", "shut", check=True).stdout.strip() == "queue shut: open"
    stack.cli("enqueue", "tests.apps.add", "-q", "shut", check=True)
    queue.close(app, "shut")
    with pytest.raises(QueueClosed):
        apps.add.apply_async([1, 2], queue="shut")
    queue.open(app, "shut")
    apps.add.apply_async([1, 2], queue="shut")
    assert app.redis.llen(app.keys.q("shut") + "pending") == 3 and not queue.info(app, "shut")["closed"]
    r = stack.cli("queue", "open", "nope")
    assert r.returncode == 1 and "no queue 'nope'" in r.stderr


def test_destructive_commands_need_yes_when_they_cannot_ask(app, stack):
    for i in range(5):
        apps.add.apply_async([i, i], queue="keep")
    pending = app.keys.q("keep") + "pending"
    for args in (["purge", "-q", "keep"], ["queue", "delete", "keep"]):
        r = run_cli(stack, *args, input="n\n")  # `echo n | taskrunner purge -q keep`
        assert r.returncode == 2 and "--yes" in r.stderr and "delete" in r.stderr, r.stderr
        r = run_cli(stack, *args, input="y\n")  # nobody asked, so no answer counts
        assert r.returncode == 2 and app.redis.llen(pending) == 5
    r = run_cli(stack, "purge", "-q", "keep", "--yes", input="")
    assert r.returncode == 0 and "5 pending jobs deleted" in r.stdout and app.redis.llen(pending) == 0
    assert r.stderr == ""  # a progress bar is for a terminal (its label was written alone here)
    r = run_cli(stack, "queue", "delete", "keep", "--yes", input="")
    assert r.returncode == 0 and "keep" not in app.queue_names()


def test_destructive_commands_ask_at_a_terminal(app, stack):
    for i in range(3):
        apps.add.apply_async([i, i], queue="asked")
    pending = app.keys.q("asked") + "pending"

    def at_a_terminal(*args: str, answer: str) -> subprocess.CompletedProcess:
        leader, follower = os.openpty()
        try:
            os.write(leader, f"{answer}\n".encode())
            return run_cli(stack, *args, stdin=follower)
        finally:
            os.close(leader)
            os.close(follower)

    r = at_a_terminal("queue", "delete", "asked", answer="n")
    assert "delete queue asked and its 3 pending, 0 delayed, 0 waiting, 0 running, 0 finished jobs?" in r.stdout
    assert r.returncode == 1 and "asked" in app.queue_names()
    r = at_a_terminal("purge", "-q", "asked", answer="n")
    assert "delete 3 pending jobs of asked?" in r.stdout and r.returncode == 1 and app.redis.llen(pending) == 3
    r = at_a_terminal("purge", "-q", "asked", answer="y")
    assert r.returncode == 0 and app.redis.llen(pending) == 0, r.stderr


# -- one line, exit 2, for a mistake in the configuration (issue 14) --------------------


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr) < 600, r.stderr
    return r.stderr


def test_redis_url_mistakes_are_one_line_and_exit_2(app, stack, tmp_path):
    from tests.topologies import DATA_NODE, Topology

    with Topology(tmp_path) as topology:
        plain = topology.start(*DATA_NODE)
        sentinel = topology.start("--sentinel", conf=f"sentinel monitor other 127.0.0.1 {plain.port} 1\n")
        mistakes = {
            f"redis://127.0.0.1:{plain.port}/99": "has no such database (DB index is out of range",
            f"redis://127.0.0.1:{plain.port}/abc": "the database 'abc' is not a number",
            f"rediss://127.0.0.1:{plain.port}/0": f"127.0.0.1:{plain.port} is a plain Redis, not TLS",
            f"redis+sentinel://127.0.0.1:{plain.port}/mymaster": f"127.0.0.1:{plain.port} is not a sentinel",
            f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster": "does not monitor it (it monitors other)",
        }
        for url, message in mistakes.items():
            r = stack.cli("jobs", "--redis-url", url)
            assert r.returncode == 2 and message in one_line_error(r), (url, r.stderr)
        # Processes that run until stopped do not start on such a mistake either.
        for command in (["worker", "-A", "tests.apps"], ["dispatcher"]):
            r = stack.cli(*command, "--redis-url", f"redis+sentinel://127.0.0.1:{plain.port}/mymaster")
            assert r.returncode == 2 and "is not a sentinel" in one_line_error(r)
    r = stack.cli("jobs", "--redis-url", f"redis://127.0.0.1:{plain.port}/0")  # an outage: exit 3
    assert r.returncode == 3 and "cannot reach Redis at redis://127.0.0.1:" in one_line_error(r)
    r = stack.cli("jobs", "--redis-url", f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster")
    assert r.returncode == 3 and "is unreachable" in one_line_error(r)


def test_an_app_that_cannot_be_imported_is_one_line_and_exit_2(stack):
    r = stack.cli("jobs", "-A", "no_such_module")
    assert r.returncode == 2
    assert one_line_error(r) == "Error: cannot import app module 'no_such_module': No module named 'no_such_module'\n"
    r = stack.cli("worker", "-A", "tests.apps:nothing")
    assert r.returncode == 2 and "'nothing' is not a TaskRunner" in one_line_error(r)


def test_redis_url_and_app_before_the_command(app, stack):
    job = apps.add.delay(1, 2)
    wrong = {"REDIS_URL": "redis://127.0.0.1:1/0"}
    for args in (["--redis-url", stack.url, "jobs", "--json"],
                 ["--redis-url", "redis://127.0.0.1:1/0", "jobs", "--json", "--redis-url", stack.url]):
        r = run_cli(stack, *args, env=wrong)
        assert r.returncode == 0 and [j["id"] for j in json.loads(r.stdout)] == [job.id], r.stderr
    r = run_cli(stack, "--redis-url", stack.url, "queue", "info", "default", "--json", env=wrong)
    assert r.returncode == 0 and json.loads(r.stdout)["pending"] == 1, r.stderr
    r = run_cli(stack, "-A", "no_such_module", "jobs")
    assert r.returncode == 2 and "no_such_module" in r.stderr
    r = run_cli(stack, "-A", "tests.apps", "--redis-url", stack.url, "enqueue", "tests.apps.add", "--args", "[1, 2]",
                env=wrong)
    assert r.returncode == 0 and app.job(r.stdout.strip()).queue == "default", r.stderr


# -- what the tables say (issue 14) -----------------------------------------------------


def test_times_say_utc_jobs_explains_stuck_workers_show_cpu(app, stack):
    job = app.enqueue("tests.apps.hold", ["flagged", 30], max_duration=0.3, timeout_policy="flag")
    assert "* stuck" not in stack.cli("jobs", check=True).stdout  # no marker, no legend
    status = stack.cli("status", job.id, check=True).stdout
    assert re.search(r"enqueued  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$", status, re.M), status
    inspect = stack.cli("inspect", "-q", "default", check=True).stdout
    assert "LAST DELIVERY" in inspect
    stack.worker(name="cpu-w", concurrency=1)
    wait_for(lambda: job.refresh().data.get("stuck") == "1", what="the job flagged stuck")
    out = stack.cli("jobs", "--state", "running", check=True).stdout
    assert "running*" in out and "* stuck: ran past its max duration" in out, out
    status = stack.cli("status", job.id, check=True).stdout
    assert re.search(r"started  \S+ \S+ UTC$", status, re.M) and "    state  running (stuck)\n" in status, status
    workers = stack.cli("workers", check=True).stdout.splitlines()
    assert "CPU %" in workers[0]
    [row] = [line for line in workers if line.startswith("cpu-w")]
    assert re.search(r" \d+\.\d +default,", row), row
    app.redis.set(f"{app.settings.prefix}:release:flagged", 1)
    job.wait(30)
    # Finished, it is stuck no more: it ran past its max duration (it said "completed (stuck)").
    assert "    state  completed (ran past its max duration)\n" in stack.cli("status", job.id, check=True).stdout
    from dashboard import create_app

    page = create_app(app).test_client().get(f"/jobs/{job.id}").get_data(as_text=True)
    assert ">overran</span>" in page and ">stuck</span>" not in page


def test_commands_on_a_queue_refuse_a_name_no_queue_has(app, stack):
    """A typo in -q must not look like an empty queue ("0 pending jobs deleted")."""
    apps.add.delay(1, 2)
    for args in (["purge", "-q", "defualt", "--yes"], ["inspect", "-q", "defualt"], ["jobs", "-q", "defualt"],
                 ["recover", "-q", "defualt", "--older-than", "5m"], ["harvest", "-q", "default,defualt"],
                 ["queue", "info", "defualt"]):
        r = stack.cli(*args)
        assert r.returncode == 1 and "no queue 'defualt' (see `taskrunner queues`)" in one_line_error(r), args
    for args in (["jobs", "--limit", "-1"], ["jobs", "--offset", "-5"], ["inspect", "-q", "default", "--limit", "0"],
                 ["recover", "-q", "default", "--older-than", "5m", "--count", "0"]):
        r = stack.cli(*args)
        assert r.returncode == 2 and "Invalid value" in r.stderr, args
    assert app.redis.llen(app.keys.q("default") + "pending") == 1


def test_a_bad_name_or_value_in_the_arguments_exits_2(app, stack):
    """Exit 2 is "a mistake in what the command was given" (README): a queue name with a
    space, arguments over the payload limit and a bad --since exited 1, as an outage does."""
    r = stack.cli("queue", "create", "bad name")
    assert r.returncode == 2 and "invalid queue name 'bad name'" in one_line_error(r)
    r = stack.cli("enqueue", "tests.apps.add", "-q", "bad name")
    assert r.returncode == 2 and "invalid queue name" in one_line_error(r)
    stack.env["TASKRUNNER_MAX_PAYLOAD"] = "100"
    r = stack.cli("enqueue", "tests.apps.add", "--args", json.dumps(["x" * 200]))
    assert r.returncode == 2 and "bytes" in one_line_error(r), r.stderr
    r = stack.cli("analyze", "--since", "7x")
    assert r.returncode == 2 and "bad duration '7x'" in r.stderr, r.stderr
    assert app.redis.keys(app.settings.prefix + ":{bad name}*") == []


@pytest.mark.parametrize("args", [
    ["worker", "-A", "tests.apps", "--log-level", "loud"], ["dispatcher", "--log-level", "verbose"],
    ["worker", "-A", "tests.apps", "-c", "0"], ["up", "-A", "tests.apps", "-c", "0"],
    ["dashboard", "--port", "99999"], ["up", "-A", "tests.apps", "--port", "0"],
    ["history", "archive", "--batch", "0"], ["history", "compact", "--target-mb", "0"],
    ["queue", "create", "q", "--bound", "-1"],
    ["consume", "-q", "default", "--timeout", "-1"], ["wait", "someid", "--timeout", "-1"]])
def test_option_out_of_range_is_a_usage_error(stack, args):
    """A value an option cannot take is refused before anything runs: exit 2, one Error line,
    the option named. `--log-level loud` printed a traceback, `dashboard --port 99999` served
    on port 34463 and said so, `history archive --batch 0` printed Redis's XRANGE complaint,
    `-c 0`, `--bound -1` and the negative timeouts were taken (exit 1, or "no job")."""
    r = stack.cli(*args, timeout=60)
    assert r.returncode == 2, (args, r)
    assert "Traceback" not in r.stderr and r.stdout == "", r
    [error] = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert "Invalid value for" in error and args[-2] in error, error


@pytest.mark.parametrize("args", [
    ["wait", "someid", "--timeout", "nan"], ["wait", "someid", "--timeout", "inf"],
    ["consume", "-q", "default", "--timeout", "nan"], ["consume", "-q", "default", "--timeout", "inf"],
    ["worker", "-A", "tests.apps", "--max-memory-per-child", "nan"],
    ["history", "compact", "--target-mb", "nan"],
    ["schedule", "add", "s", "tests.apps.add", "--every", "5s", "--args", "[1, 2]", "--jitter", "nan"]])
def test_an_option_that_takes_seconds_or_megabytes_refuses_nan_and_infinity(app, stack, args):
    """A newcomer's sweep: click's FloatRange takes NaN (it compares false with either bound)
    and the infinities: `wait ID --timeout nan` and `consume --timeout nan` waited forever, a
    worker with `--max-memory-per-child nan` never replaced a child, `history compact
    --target-mb nan` said "cannot convert float NaN to integer"."""
    r = stack.cli(*args, timeout=20)
    assert (r.returncode, r.stdout) == (2, ""), r
    [error] = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert error.startswith(f"Error: Invalid value for '{args[-2]}'") and "finite" in error, error


def test_values_taskrunner_refuses_are_usage_errors(app, stack):
    """README: exit 2 is a mistake in what the command was given. An invalid queue name or
    job id, a negative delay or retries exited 1, as if Redis had failed."""
    add = ["enqueue", "tests.apps.add", "--args", "[1, 2]"]
    for args, said in ([*add, "-q", ""], "invalid queue name ''"), ([*add, "--id", "a b"], "invalid job id"), \
            ([*add, "--delay", "-5"], "delay must be"), ([*add, "--retries", "-1"], "retries must be"), \
            ([*add, "--max-duration", "0"], "max_duration must be"), (["queue", "create", "a b"], "invalid queue"):
        r = stack.cli(*args)
        assert r.returncode == 2 and one_line_error(r).startswith(f"Error: {said}"), (args, r)
    assert app.queue_names() == []


def test_durations_the_scripts_cannot_store_are_refused_before_redis(app, stack):
    """A newcomer's sweep: `enqueue --delay 1e300` (or --max-duration) passed the client's
    check (a finite number) and came back from enqueue.lua as "Error: job 01M8...: delay must
    be ... < 2^53", naming a job id the user never saw; the API raised the same. The client
    now refuses what the scripts refuse (2^53 s and more), in its own words."""
    add = ["enqueue", "tests.apps.add", "--args", "[1, 2]"]
    for option, name, least in (("--delay", "delay", ">= 0"), ("--max-duration", "max_duration", "> 0")):
        r = stack.cli(*add, option, "1e300")
        assert (r.returncode, r.stdout, one_line_error(r)) == (
            2, "", f"Error: {name} must be a finite number of seconds {least} and < 2^53, not 1e+300\n"), r
    with pytest.raises(ValueError, match=r"^delay must be a finite number of seconds >= 0 and < 2\^53, not 9"):
        apps.add.apply_async((1, 2), delay=2.0**53)
    assert apps.add.apply_async((1, 2), delay=2.0**53 - 1).created  # the largest the scripts take
    assert app.queue_names() == ["default"]


@pytest.mark.parametrize("value", ["-5m", "-1", "nan", "inf", "1e400", "soon", ""])
def test_recover_refuses_an_age_that_is_no_duration(app, stack, value):
    """A newcomer's sweep: `recover --older-than -5m` was taken (a cutoff 5 minutes in the
    future) and put back every running job, one delivered a second before included, whose
    live worker went on running it: the job then ran twice. nan and inf were taken too (and
    recovered nothing), and a value that is no number was read only after Redis was asked
    (`-q nope --older-than soon` said no queue), in an error that did not name the option."""
    r = stack.cli("recover", "-q", "nope", "--older-than", value)
    assert (r.returncode, r.stdout) == (2, ""), r
    [error] = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert error.startswith("Error: Invalid value for '--older-than': ") and "90s, 5m, 2h" in error, error


def test_the_recover_script_refuses_an_age_or_count_that_is_none(app, stack):
    """recover.lua too (another client may call it): a negative age put back every running
    job, one its live worker had just started included."""
    from taskrunner.protocol import scripts

    stack.worker(name="holder")
    job = apps.hold.delay("recover-me", 30)
    wait_for(lambda: job.refresh().state == "running", what="the job to start")
    for age, count, said in ((-300, 10, "the age (ARGV[1])"), ("nan", 10, "the age"), ("inf", 10, "the age"),
                             ("soon", 10, "the age"), (60, 0, "the count (ARGV[2])"), (60, 1.5, "the count")):
        with pytest.raises(ValueError, match=re.escape(f"recover: {said}")):
            scripts.RECOVER(app.redis, [app.keys.q("default")], [age, count, "test"])
    assert (job.refresh().state, job.data["attempts"]) == ("running", "1")  # not put back
    assert scripts.RECOVER(app.redis, [app.keys.q("default")], [0, 10, "test"]) == [job.id]  # 0: every one


def test_a_delay_with_depends_on_is_refused_in_the_callers_words(app, stack):
    """A newcomer's sweep: `enqueue T --depends-on ID --delay 5` came back from enqueue.lua
    as "Error: job 01M8...: a job with parents cannot have a delay", naming a job id the user
    never saw (enqueue_many said it in its own words already); apply_async the same."""
    parent = apps.add.delay(1, 2)
    r = stack.cli("enqueue", "tests.apps.add", "--args", "[1, 2]", "--depends-on", parent.id, "--delay", "5")
    assert (r.returncode, r.stdout, one_line_error(r)) == (
        2, "", "Error: a job with depends_on cannot have a delay (it runs once its parents completed)\n"), r
    with pytest.raises(ValueError, match="^a job with depends_on cannot have a delay"):
        apps.add.apply_async((1, 2), depends_on=[parent], delay=5)
    assert app.redis.llen(app.keys.q("default") + "pending") == 1  # the parent alone


def test_tables_stay_aligned_with_long_ids_and_queue_names(app, stack):
    """A cron tick's id (cron.<task>.<tick>) or a queue name longer than the usual pushed
    the next columns of `jobs` and `inspect` out of line with their headings."""
    apps.add.delay(1, 1)
    apps.add.apply_async((1, 2), job_id="cron.tests.apps.add.1795539420", queue="a-rather-long-queue-name")
    head, *rows = stack.cli("jobs", check=True).stdout.splitlines()
    at = head.index("STATE")
    assert len(rows) == 2 and all(row[at:].split()[0] == "pending" for row in rows), (head, rows)
    head, *rows = stack.cli("inspect", "-q", "a-rather-long-queue-name", check=True).stdout.splitlines()
    at = head.index("DELIVERIES")  # right-aligned, 10 wide
    assert len(rows) == 1 and rows[0][at:at + 10] == " " * 9 + "0", (head, rows)


def _commands_in_docs() -> list[tuple[str, str]]:
    """(file, command line) of every `taskrunner ...` in README.md, docs/ and the Node
    client's README: in backticks, and the lines of code blocks that run it (a Procfile's
    included)."""
    found = []
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "clients/node/README.md"]:
        text = f.read_text()
        found += [(f.name, m.group(1)) for m in re.finditer(r"`(taskrunner [^`]*)`", text)]
        for block in re.findall(r"(?ms)^```[a-z]*\n(.*?)^```", text):
            found += [(f.name, m.group(1).strip()) for m in re.finditer(r"(?m)^(?:\w+: )?(taskrunner [^#\n]*)", block)]
    return found


def test_every_command_and_option_the_docs_name_exists():
    """docs/PROTOCOL.md said a full Redis is emptied with `taskrunner queue purge`, which
    is no command (`taskrunner purge -q Q` is): each command the docs name is looked up in
    the CLI, and each of its options in that command's."""
    import click

    from taskrunner.cli import main

    wrong = []
    for name, line in _commands_in_docs():
        words = re.sub(r"[\[\]()]", " ", line.replace("\\|", " ")).split()[1:]
        command: Any = main
        while isinstance(command, click.Group) and words and not words[0].startswith("-") and not words[0].isupper():
            command = command.commands.get(words.pop(0))
        if command is None:
            wrong.append(f"{name}: {line}: no such command")
            continue
        options = {o for p in (*main.params, *command.params) for o in (*p.opts, *p.secondary_opts)} | {"--help", "--"}
        wrong += [f"{name}: {line}: no option {o}" for w in words if w.startswith("-")
                  for o in (part.split("=")[0].rstrip(".,;:") for part in w.split("/")) if o and o not in options]
    assert len(_commands_in_docs()) > 50 and not wrong, wrong


def test_every_test_the_docs_cite_exists():
    """README's feature table cited test_cluster.py::test_a_chain_in_one_queue_runs_and_one_
    over_slots_is_refused, which no file has (renamed long ago): each `test_x.py::name` in
    README.md and docs/ must name a test (or class) defined in that file."""
    import ast

    cited = set()
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        cited |= set(re.findall(r"(test_\w+\.py)::(\w+)", f.read_text()))
    wrong = []
    for module, name in sorted(cited):
        path = ROOT / "tests" / module
        tree = ast.parse(path.read_text()) if path.exists() else ast.Module(body=[], type_ignores=[])
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        if name not in defined:
            wrong.append(f"{module}::{name}")
    assert len(cited) > 30 and not wrong, wrong


def test_wait_on_a_result_that_is_not_json_is_an_error_not_a_timeout(app, stack):
    """A completed job whose result another client wrote as no JSON (the Node consumer left
    a function's result empty) makes `wait` exit 1 with a line saying so: it exited 2, which
    `wait` means as "still not ended after --timeout", with the JSON parser's words alone."""
    job = apps.add.delay(1, 2)
    app.redis.hset(app.keys.job(job.queue, job.id), mapping={"state": "completed", "result": ""})
    r = stack.cli("wait", job.id, "--timeout", "5")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.startswith(f"Error: job {job.id} completed, but its result is not JSON (")
    assert stack.cli("wait", "bad id").returncode == 2  # a mistake in the arguments stays 2
