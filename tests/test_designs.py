"""Every capability taken from the reference designs (shared/seeds), one test each; the
feature table in README.md points here."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from types import SimpleNamespace

import pytest
import redis

from taskrunner import JobFailed, QueueClosed, QueueFull, TaskRunnerError
from taskrunner.client.aio import AsyncClient
from taskrunner.client.consumer import Consumer
from taskrunner.ops import queue
from tests import apps
from tests.conftest import until_logged, wait_for

# -- pressure: bounded, closed, exclusive queues, counters, identities -----------------


def blocked_on(app, key: str) -> bool:
    return any(c.get("cmd") == "brpop" for c in app.redis.client_list())


def test_bounded_queue_blocks_producers_then_fails(app, stack):
    queue.create(app, "b", bound=2)
    apps.add.apply_async([1, 1], queue="b")
    apps.add.apply_async([2, 2], queue="b")
    with pytest.raises(QueueFull):
        apps.add.apply_async([3, 3], queue="b", block_timeout=0)
    with pytest.raises(QueueFull, match="within 0.2s"):
        apps.add.apply_async([3, 3], queue="b", block_timeout=0.2)
    r = stack.cli("enqueue", "tests.apps.add", "-q", "b", "--block-timeout", "0")
    assert r.returncode == 1 and "is full" in r.stderr
    done: list = []
    t = threading.Thread(target=lambda: done.append(apps.add.apply_async([4, 4], queue="b", block_timeout=60)))
    t.start()
    wait_for(lambda: blocked_on(app, "notfull"), what="the producer to block in Redis")
    assert not done
    [d] = Consumer(app, ["b"]).claim(1)  # a consumer takes one: room for the blocked producer
    t.join(30)
    assert done and done[0].created and app.redis.llen(app.keys.q("b") + "pending") == 2
    assert d.args == [1, 1]


def test_closed_queue_refuses_new_jobs_and_runs_queued_ones(app, stack):
    queued = apps.add.apply_async([1, 2], queue="c")
    queue.close(app, "c")
    with pytest.raises(QueueClosed):
        apps.add.apply_async([1, 2], queue="c")
    r = stack.cli("enqueue", "tests.apps.add", "-q", "c")
    assert r.returncode == 1 and "closed" in r.stderr
    stack.worker("-Q", "c")
    assert queued.wait(30) == 3
    assert stack.cli("queue", "close", "nope").returncode == 1


def test_delete_queue_removes_every_key(app, stack):
    c = Consumer(app, ["d"])
    for i in range(5):
        apps.add.apply_async([i, i], queue="d")
    apps.add.apply_async([9, 9], queue="d", delay=100)
    c.claim(1)
    with pytest.raises(TaskRunnerError, match="running"):
        queue.delete(app, "d")
    r = stack.cli("queue", "delete", "d")
    assert r.returncode == 1 and "running" in r.stderr
    assert stack.cli("queue", "delete", "d", "--force", "--yes", check=True).stdout.startswith("queue d: deleted")
    assert list(app.redis.scan_iter(match=app.keys.q("d") + "*")) == []
    assert "d" not in app.queue_names()
    assert stack.cli("queue", "info", "d").returncode == 1


def test_exclusive_queue_runs_one_job_at_a_time_in_order(app, stack):
    assert "exclusive" in stack.cli("queue", "create", "solo", "--exclusive", check=True).stdout
    jobs = [apps.exclusive_probe.delay(i) for i in range(8)]
    stack.worker("-Q", "solo", concurrency=2)
    stack.worker("-Q", "solo", concurrency=2)
    assert [j.wait(60) for j in jobs] == list(range(8))
    p = app.settings.prefix
    assert set(app.redis.lrange(f"{p}:probe:max", 0, -1)) == {"1"}  # never two at once
    assert app.redis.lrange(f"{p}:probe:order", 0, -1) == [str(i) for i in range(8)]  # FIFO


def test_counters_settings_and_identities(app, stack):
    stack.cli("queue", "create", "cnt", "--bound", "100", check=True)
    jobs = [apps.add.apply_async([i, "xy"], queue="cnt") for i in range(3)]
    c = Consumer(app, ["cnt"], name="counter-consumer")
    got = c.claim(2)
    [q] = [q for q in json.loads(stack.cli("queues", "--json", check=True).stdout) if q["name"] == "cnt"]
    size = len('[0,"xy"]') + len("{}")
    assert (q["produced_messages"], q["produced_bytes"]) == (3, 3 * size)
    assert (q["consumed_messages"], q["consumed_bytes"]) == (2, 2 * size)
    assert (q["bound"], q["closed"], q["exclusive"]) == (100, False, False)
    assert "bound=100" in stack.cli("queues", check=True).stdout
    d = jobs[0].refresh().to_dict()
    host, pid, thread = d["producer"].split(":")
    assert (pid, thread) == (str(os.getpid()), str(threading.get_ident()))
    assert (d["worker"], d["host"], d["pid"]) == ("counter-consumer", host, os.getpid())
    assert c.ack(got) == [True, True]


# -- rfq: topics, backlog and in-flight, purge, publish, consume, harvest ---------------


def test_topics_backlog_inflight_and_purge(app, stack):
    ids = [stack.cli("enqueue", "tests.apps.add", "-q", "t", "--args", f"[{i}, 1]", check=True).stdout.strip()
           for i in range(4)]
    Consumer(app, ["t"]).claim(1)
    assert "t" in stack.cli("queues", check=True).stdout
    backlog = json.loads(stack.cli("jobs", "-q", "t", "--state", "pending", "--json", check=True).stdout)
    inflight = json.loads(stack.cli("jobs", "-q", "t", "--state", "running", "--json", check=True).stdout)
    assert [j["id"] for j in backlog] == ids[1:] and [j["id"] for j in inflight] == ids[:1]
    r = stack.cli("purge", "-q", "t", "--yes", check=True)
    assert "3 pending jobs deleted" in r.stdout
    assert json.loads(stack.cli("jobs", "-q", "t", "--state", "pending", "--json", check=True).stdout) == []


def test_consume_from_the_shell(app, stack):
    double = [sys.executable, "-c", "import sys, json; print(json.dumps(json.load(sys.stdin)['args'][0] * 2))"]
    job = apps.add.delay(21, 0)
    r = stack.cli("consume", "-q", "default", "--", *double)
    assert r.returncode == 0 and r.stdout.strip() == "42"
    assert job.refresh().to_dict()["result"] == 42 and job.state == "completed"
    bad = apps.add.delay(1, 0)
    r = stack.cli("consume", "-q", "default", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert r.returncode == 3
    assert bad.refresh().data["error_type"] == "CommandFailed" and bad.state == "failed"
    plain = apps.add.delay(5, 6)
    r = stack.cli("consume", "-q", "default")
    assert json.loads(r.stdout)["args"] == [5, 6] and plain.state == "completed"
    assert stack.cli("consume", "-q", "default", "--timeout", "0.2").returncode == 2


def test_consume_whose_outcome_is_not_recorded_exits_1(app, stack):
    """The job taken back while CMD ran (here CMD itself puts running jobs back in line,
    `taskrunner recover`): CMD's exit 0 is no longer the job's, so consume exits 1 (refused),
    not 0, which says the job was acked; it said so on stderr and exited 0. (Beats 20 s
    apart: the one after CMD's recover would find the job ours no more and stop CMD.)"""
    job = apps.add.delay(2, 2)
    recover = [sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-m', 'taskrunner', "
               "'recover', '-q', 'default', '--older-than', '0'], check=True)"]
    p = stack.spawn("consume", "-q", "default", "--", *recover,
                    env={"TASKRUNNER_HEARTBEAT": "20", "TASKRUNNER_DEAD_AFTER": "120"})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1 and "this outcome was not recorded" in out, (p.returncode, out)
    assert job.state == "pending"


def test_consume_keeps_stdout_that_is_not_strict_json_as_text(app, stack):
    """CMD's stdout is the result when it is JSON, else its text: `{"a": NaN}` (which
    Python's json module reads) was taken for JSON, then refused as a result ("Error: result
    is not JSON", exit 2) with the job left claimed, to be run again once the dispatcher
    found the consumer dead, and refused again each time."""
    job = apps.add.delay(1, 2)
    printer = [sys.executable, "-c", "import sys; sys.stdin.read(); print('{\"a\": NaN}')"]
    r = stack.cli("consume", "-q", "default", "--", *printer)
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    d = job.refresh().to_dict()
    assert (d["state"], d["result"]) == ("completed", '{"a": NaN}\n')


def test_consume_stops_its_command_on_a_kill_and_at_the_max_duration(app, stack):
    """`taskrunner consume -- CMD` honours what docs/PROTOCOL.md asks of every consumer, as
    a worker does: a kill request stops CMD and the job ends killed; a job of policy kill
    is stopped at its max duration and fails with TimeLimitExceeded. It ignored both: CMD
    ran on, and the kill button did nothing. No dispatcher runs here: consume does it."""
    victim = apps.add.apply_async((1, 1), max_duration=120)
    p = stack.spawn("consume", "-q", "default", "--", "sleep", "100")
    wait_for(lambda: victim.refresh().data.get("state") == "running", what="the consumer to take it")
    victim.kill()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and f"job {victim.id} stopped: killed on request" in out, out
    assert victim.refresh().state == "killed"
    late = apps.add.apply_async((1, 1), max_duration=1)
    p = stack.spawn("consume", "-q", "default", "--", "sleep", "100")
    out, _ = p.communicate(timeout=60)
    assert f"job {late.id} stopped: past its max duration (1 s)" in out, out
    d = late.refresh().to_dict()
    assert d["state"] == "failed" and d["error_type"] == "TimeLimitExceeded", d
    assert [w for w in json.loads(stack.cli("workers", "--json", check=True).stdout) if w["state"] == "alive"] == []


def test_consume_checks_at_each_beat_that_the_job_is_still_its_own(app, stack):
    """A kill request whose message never came (kill.lua alone, as after a lost LPUSH) is
    read from the record at the next beat, and a job requeued meanwhile (an operator) is no
    longer ours: either stops CMD, as docs/PROTOCOL.md asks of every consumer (Consumers
    that are not workers, 5; Heartbeat). consume read only its control list: CMD ran on."""
    from taskrunner.protocol import scripts

    victim = apps.add.apply_async((1, 1), max_duration=120)
    p = stack.spawn("consume", "-q", "default", "--", "sleep", "100")
    wait_for(lambda: victim.refresh().data.get("state") == "running", what="the consumer to take it")
    assert scripts.KILL(app.redis, [app.keys.q("default")], [victim.id, "tests", 3600])[0] == "running"
    out, _ = p.communicate(timeout=60)
    assert f"job {victim.id} stopped: killed on request" in out, out
    assert victim.refresh().state == "killed"
    moved = apps.add.apply_async((1, 1), max_duration=120)
    p = stack.spawn("consume", "-q", "default", "--", "sleep", "100")
    wait_for(lambda: moved.refresh().data.get("state") == "running", what="the consumer to take it")
    assert moved.requeue("tests")
    out, _ = p.communicate(timeout=60)
    assert f"job {moved.id} stopped: no longer its own" in out and p.returncode == 128 + signal.SIGTERM, out
    assert moved.refresh().state == "pending"


def test_consume_whose_command_a_kill_stopped_exits_1_whatever_it_exited(app, stack, tmp_path):
    """A CMD that exits 0 on the SIGTERM a kill sends: the job ended killed, so consume
    exits 1, not 0 (which says the job was acked)."""
    victim = apps.add.apply_async((1, 1), max_duration=120)
    ready = tmp_path / "ready"
    polite = [sys.executable, "-c", "import pathlib, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
              f"pathlib.Path({str(ready)!r}).touch()\n"
              "for _ in range(2400): time.sleep(0.05)"]
    p = stack.spawn("consume", "-q", "default", "--", *polite)
    wait_for(ready.exists, what="the command to be ready for SIGTERM")
    victim.kill()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1 and f"job {victim.id} stopped: killed on request" in out, (p.returncode, out)
    assert victim.refresh().state == "killed"


#: A command for `consume` that marks its start in the folder it is given, answers 7 once told
#: to (a file `go` there), and marks a SIGTERM (exiting 0 on it); bounded: 2 minutes at most.
PATIENT = [sys.executable, "-c", "import pathlib, signal, sys, time\n"
           "d = pathlib.Path(sys.argv[1])\n"
           "sys.stdin.read()\n"
           "signal.signal(signal.SIGTERM, lambda *_: ((d / 'termed').touch(), sys.exit(0)))\n"
           "(d / 'started').touch()\n"
           "for _ in range(2400):\n"
           "    if (d / 'go').exists(): print(7); sys.exit(0)\n"
           "    time.sleep(0.05)"]


def test_consume_on_sigterm_lets_its_command_finish_within_the_shutdown_grace(app, stack, tmp_path):
    """SIGTERM (a platform stopping the process, `kill PID`) is a worker's stop for consume's
    one job: CMD finishes within the shutdown grace, untouched, and its outcome is recorded
    (exit 0, acked); a repeated SIGTERM changes nothing. consume died on SIGTERM, leaving CMD
    running on its own and the job held, to be run again once the consumer was found dead."""
    job = apps.add.delay(3, 4)
    p = stack.spawn("consume", "-q", "default", "--", *PATIENT, str(tmp_path),
                    env={"TASKRUNNER_SHUTDOWN_GRACE": "120"})
    wait_for((tmp_path / "started").exists, what="the command to start")
    p.send_signal(signal.SIGTERM)
    until_logged(p, "SIGTERM: letting the command finish")
    p.send_signal(signal.SIGTERM)
    until_logged(p, "SIGTERM again")
    (tmp_path / "go").touch()
    out, _ = p.communicate(timeout=60)
    assert (p.returncode, out.strip()) == (0, "7"), (p.returncode, out)
    assert not (tmp_path / "termed").exists()
    assert job.refresh().state == "completed" and job.to_dict()["result"] == 7


def test_consume_on_sigterm_stops_its_command_past_the_grace_and_hands_the_job_back(app, stack, tmp_path):
    """Past the shutdown grace CMD gets SIGTERM (a worker's stop of a job that did not finish)
    and the job goes back to its queue, next in line: exit 143 (128 + SIGTERM), whatever CMD
    exited, as 130 says Ctrl-C handed it back."""
    victim, behind = apps.add.delay(1, 1), apps.add.delay(2, 2)
    p = stack.spawn("consume", "-q", "default", "--", *PATIENT, str(tmp_path),
                    env={"TASKRUNNER_SHUTDOWN_GRACE": "0.5"})
    wait_for((tmp_path / "started").exists, what="the command to start")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and f"job {victim.id} is back in its queue" in out, (p.returncode, out)
    assert (tmp_path / "termed").exists()
    assert victim.refresh().state == "pending" and victim.data["attempts"] == "1", victim.data
    assert [w for w in json.loads(stack.cli("workers", "--json", check=True).stdout) if w["state"] == "alive"] == []
    assert [d.id for d in Consumer(app, ["default"]).claim(2)] == [victim.id, behind.id]  # next in line


def test_consume_on_sigterm_while_it_waits_for_a_job_leaves_the_workers_and_exits_143(app, stack):
    """SIGTERM while consume waits for its job (--timeout): it stops waiting, hands back
    anything its claim held (a claim answered as the signal came) and leaves the list of
    workers, exit 143. Its handler came only with the job: it died of the signal, listed
    among the workers (then as a dead one), a job its claim had taken held until found dead."""
    p = stack.spawn("consume", "-q", "default", "--timeout", "120", "--", "cat")
    wait_for(lambda: app.redis.zcard(app.keys.workers) == 1, what="consume to beat")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "SIGTERM" in out, (p.returncode, out)
    assert app.redis.zcard(app.keys.workers) == 0


def test_consume_exits_as_its_job_was_recorded_when_a_kill_comes_as_its_command_exits(app, stack, tmp_path,
                                                                                      monkeypatch):
    """A kill request read just as CMD exits 0: the job is recorded either stopped (exit 1) or
    acked (exit 0), and the exit code says which. The watcher could decide to stop CMD after
    consume had read "not stopped" and acked the job, then the exit code read its decision:
    exit 1 for an acked job. Forced here: the watcher's look at "CMD exited" is held until
    consume records the outcome, and answers what it saw before (the race's interleaving)."""
    from taskrunner.cli import consume

    job = apps.add.delay(3, 4)
    armed, recording = threading.Event(), threading.Event()

    class SeenLate(threading.Event):
        """CMD's exit as the watcher sees it once armed: what it was at the first look,
        answered once consume records the outcome."""

        seen: bool | None = None

        def is_set(self) -> bool:
            if threading.current_thread() is threading.main_thread() or not armed.is_set():
                return super().is_set()
            if self.seen is None:
                self.seen = super().is_set()
                recording.wait(30)
            return self.seen

    class Recorded(consume.Held):
        def watch(self, *args):  # type: ignore[no-untyped-def]
            self.watcher = threading.current_thread()
            super().watch(*args)

        def record(self, *args):  # type: ignore[no-untyped-def]
            recording.set()
            self.watcher.join(30)  # the watcher decided, late
            return super().record(*args)

    monkeypatch.setattr(consume, "threading", SimpleNamespace(Event=SeenLate, Thread=threading.Thread,
                                                              Lock=threading.Lock))
    c = Consumer(app, ["default"])
    [delivery] = c.claim(1)
    held, exited = Recorded(app, c, delivery), []

    def run() -> None:
        try:
            held.hand_to((*PATIENT, str(tmp_path)))
        except SystemExit as e:
            exited.append(e.code)

    runner = threading.Thread(target=run)
    runner.start()
    wait_for((tmp_path / "started").exists, what="the command to start")
    armed.set()
    job.kill()
    (tmp_path / "go").touch()
    runner.join(60)
    state = job.refresh().state
    assert exited == [0 if state == "completed" else 1] and state == "completed", (exited, state)


def test_consume_with_no_job_leaves_no_worker_behind(app, stack):
    """`consume` that finds no job leaves the list of workers as it entered it: it stayed
    there, found dead by the dispatcher, then listed as a dead worker for an hour."""
    queue.create(app, "quiet", 0, False)
    r = stack.cli("consume", "-q", "quiet", "--timeout", "0.2")
    assert r.returncode == 2 and r.stderr == "no job\n", r
    assert app.redis.zrange(app.keys.workers, 0, -1) == [] and list(app.redis.scan_iter(app.keys.g + "worker:*")) == []


def test_harvest_returns_dead_consumers_jobs(app, stack):
    job = apps.add.delay(1, 1)
    p = stack.spawn("consume", "-q", "default", "--", "sleep", "60")
    wait_for(lambda: job.refresh().data.get("state") == "running", what="the consumer to take it")
    os.killpg(p.pid, signal.SIGKILL)
    wait_for(lambda: "requeued=1" in stack.cli("harvest", "-q", "default", check=True).stdout,
             what="harvest once the consumer's heartbeat expired")
    d = job.refresh().to_dict()
    assert d["state"] == "pending" and "harvested" in d["last_lost_reason"]


# -- RedisRQ: push many, pop COUNT from several queues with BLOCK, ack many, recover, inspect


def test_enqueue_many_and_from_file(app, stack, tmp_path):
    jobs = app.enqueue_many([{"task": "tests.apps.add", "args": [i, 1], "queue": "m1" if i % 2 else "m2"}
                             for i in range(2500)])
    assert len(jobs) == 2500 and all(j.created for j in jobs)
    assert app.redis.llen(app.keys.q("m1") + "pending") == 1250
    lines = [json.dumps({"task": "tests.apps.add", "args": [i, 2], "kwargs": {}, "queue": "f", "delay": 0,
                         "max_duration": 5, "id": f"file-{i}"}) for i in range(30)]
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    r = stack.cli("enqueue", "--from-file", str(path), check=True)
    assert r.stdout.split() == [f"file-{i}" for i in range(30)]
    assert app.job("file-7").to_dict()["max_duration"] == 5
    path.write_text(lines[0] + "\n{oops\n")
    r = stack.cli("enqueue", "--from-file", str(path))
    assert r.returncode == 2 and "line 2" in r.stderr
    # An error is one line on stderr: the progress bar's label is for a terminal (it came first).
    path.write_text(json.dumps({"task": "tests.apps.add", "urgency": 1}) + "\n")
    r = stack.cli("enqueue", "--from-file", str(path))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "Error: job 1: unknown fields ['urgency'] (0 of the 0 before it enqueued, none after)\n"
    with pytest.raises(ValueError, match="job 1: unknown fields"):
        app.enqueue_many([{"task": "tests.apps.add", "urgency": 1}])
    path.write_text("\n\n")  # nothing to enqueue: nothing printed (it printed an empty line, an empty id to read)
    r = stack.cli("enqueue", "--from-file", str(path), check=True)
    assert r.stdout == "", repr(r.stdout)


def test_claim_count_from_several_queues_with_block(app):
    c = Consumer(app, ["hi", "lo"])
    lo = [apps.add.apply_async([i, 0], queue="lo").id for i in range(3)]
    hi = [apps.add.apply_async([i, 0], queue="hi").id for i in range(2)]
    got = c.claim(4)
    assert [(d.queue, d.id) for d in got] == [("hi", hi[0]), ("hi", hi[1]), ("lo", lo[0]), ("lo", lo[1])]
    assert len(c.claim(5)) == 1 and c.claim(5, block=0.2) == []
    later: list = []
    t = threading.Thread(target=lambda: later.extend(c.claim(1, block=30)))
    t.start()
    wait_for(lambda: blocked_on(app, "wake"), what="the claim to block in Redis")
    job = apps.add.apply_async([7, 7], queue="lo")
    t.join(30)
    assert [d.id for d in later] == [job.id]


def test_a_consumer_whose_claim_answer_was_lost_hands_the_job_back(app, tmp_path):
    """A claim that ran while its answer was lost (Redis stopped past the socket timeout)
    leaves a delivery held by the consumer's name that it never got: its next claim hands
    it back first (finish "return", docs/PROTOCOL.md, Consumers that are not workers, 6),
    so the job runs. It was held for good: a live consumer is never found dead, and at the
    deadline the dispatcher only flags it stuck (fails before: the next claim gets nothing)."""
    from taskrunner.ops.redis_server import RedisServer

    server = RedisServer(tmp_path, appendonly=False).start()
    try:
        app.configure(redis_url=server.url + "?socket_timeout=0.5")
        c = Consumer(app, ["default"])
        assert c.claim(1) == []  # beats, reads the shard counts: the claim call is the next command
        job = apps.add.delay(1, 2)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(redis.RedisError):
                c._claim(1, 0)  # the claim, without claim()'s heartbeat before it
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        wait_for(lambda: job.refresh().data.get("state") == "running", what="the claim sent to run")
        got = c.claim(1)
        assert [(d.id, d.attempt) for d in got] == [(job.id, "2")], got
        assert c.ack(got, [3]) == [True] and job.wait(5) == 3
        assert "never got it" in job.refresh().data["end:1"]
        c.close()
    finally:
        server.stop()


def test_ack_many_says_which_were_acked(app, stack):
    c = Consumer(app, ["default"])
    for i in range(3):
        apps.add.delay(i, 0)
    got = c.claim(3)
    assert app.job(got[0].id).requeue("test")  # put back meanwhile (as recover or an operator would)
    assert c.ack(got, [0, 1, 2]) == [False, True, True]
    assert app.job(got[0].id).data["state"] == "pending"


def test_recover_and_inspect(app, stack):
    c = Consumer(app, ["default"])
    jobs = [apps.add.delay(i, 0) for i in range(3)]
    c.claim(2)
    insp = json.loads(stack.cli("inspect", "-q", "default", "--running", "--json", check=True).stdout)
    assert [(r["id"], r["deliveries"]) for r in insp] == [(jobs[0].id, 1), (jobs[1].id, 1)]
    assert all(r["age"] >= 0 and r["last_delivery"] for r in insp)
    assert stack.cli("recover", "-q", "default", "--older-than", "1h", check=True).stdout.strip() == \
        "nothing to recover"
    r = stack.cli("recover", "-q", "default", "--older-than", "0s", "--count", "1", check=True)
    assert r.stdout.split() == [jobs[0].id]
    again = c.claim(1)
    assert again[0].id == jobs[0].id and again[0].attempt == "2"  # the delivery count went up
    pend = json.loads(stack.cli("inspect", "-q", "default", "--json", check=True).stdout)
    assert [(r["id"], r["deliveries"]) for r in pend] == [(jobs[2].id, 0)]
    assert "ID" in stack.cli("inspect", "-q", "default", check=True).stdout
    assert stack.cli("recover", "-q", "default", "--older-than", "soon").returncode == 2


# -- torrelque: results for a TTL, per-job counters, asyncio client ---------------------


def test_results_expire_after_their_ttl(app, stack):
    stack.worker(env={"TASKRUNNER_RESULT_TTL": "1"})
    job = apps.add.delay(1, 1)
    assert job.wait(30) == 2
    wait_for(lambda: not app.redis.exists(app.keys.job("default", job.id)), what="the result to expire")


def test_per_job_counters_in_status(app, stack):
    stack.worker()
    stack.dispatcher()
    job = apps.requeue_me.delay("cnt", 1)
    job.wait(30)
    d = json.loads(stack.cli("status", job.id, "--json", check=True).stdout)
    # torrelque: enqueue time, dequeue count, requeue count, last dequeue/requeue time, release time
    assert d["enqueued_at"] <= d["last_requeued_at"] <= d["started_at"] <= d["finished_at"]
    assert (d["attempts"], d["requeues"]) == (2, 1)


def test_asyncio_client(app, stack):
    stack.worker()

    async def main():
        client = AsyncClient(app)
        try:
            job_id = await client.enqueue("tests.apps.add", [2, 3])
            assert await client.wait(job_id, timeout=30) == 5
            assert (await client.job(job_id))["state"] == "completed"
            failing = await client.enqueue("tests.apps.boom", ["async"])
            with pytest.raises(JobFailed, match="async"):
                await client.wait(failing, timeout=30)
            later = await client.enqueue("tests.apps.add", [1, 1], delay=100)
            assert await client.kill(later) == "killed"
        finally:
            await client.close()

    asyncio.run(main())
