"""What waits must sleep: a worker whose job is flagged stuck, a worker and a dispatcher
backing off while Redis is down, a stopping worker that cannot reach Redis. Each is
measured by the CPU time its process uses over a few seconds (a generous margin: a spin
uses a whole core), and a stopping worker must exit by itself, giving up on Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from taskrunner.ops.redis_server import RedisServer
from tests import apps
from tests.conftest import FAST, Stack, wait_for

#: Share of one core above which a process that only waits is spinning.
BUSY = 0.2


def cpu_share(pid: int, seconds: float = 3.0) -> float:
    """The share of one core the process used over a window of `seconds` (the window is
    the measurement, not a wait for a condition)."""
    p = psutil.Process(pid)
    used, started = sum(p.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    return (sum(p.cpu_times()[:2]) - used) / (time.monotonic() - started)


def _says(p: subprocess.Popen, words: str) -> None:
    """Read the process's output until a line holds `words`."""
    lines: list[str] = []
    wait_for(lambda: lines.append(p.stdout.readline()) or words in lines[-1], what=f"{words!r} in its output")


def test_worker_sleeps_while_its_job_is_flagged_stuck(app, stack):
    """timeout_policy="flag": past its max duration the job is flagged and goes on. Its
    deadline, now past, kept the worker's select timeout at 0: 97-100% of a core."""
    w = stack.worker(concurrency=1)
    job = app.enqueue("tests.apps.nap", [60], max_duration=0.3, timeout_policy="flag")
    wait_for(lambda: job.refresh().data.get("stuck") == "1", what="the job flagged stuck")
    assert job.state == "running"
    assert cpu_share(w.pid) < BUSY


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path, appendonly=False).start()
    yield server
    server.stop()


def test_worker_and_dispatcher_sleep_while_redis_is_down(app, own_redis):
    """Redis down: each backs off between tries, and sleeps meanwhile (the worker's next
    heartbeat, past, kept its select timeout at 0)."""
    app.configure(redis_url=own_redis.url)
    stack = Stack(app, own_redis.url)
    try:
        w, d = stack.worker(concurrency=1), stack.dispatcher()
        _says(w, "children")
        job = app.enqueue("tests.apps.nap", [60], max_duration=0.3, timeout_policy="flag")
        wait_for(lambda: job.refresh().data.get("stuck") == "1", what="the job flagged stuck")
        own_redis.stop()
        _says(w, "Redis unavailable")
        _says(d, "Redis unavailable")
        assert cpu_share(w.pid) < BUSY
        assert cpu_share(d.pid) < BUSY
    finally:
        stack.stop()


@pytest.mark.parametrize("down", ["stopped", "hung"])
def test_stopping_worker_with_redis_down_exits_in_time(app, own_redis, down):
    """SIGTERM while Redis is down (stopped: connections refused; hung, SIGSTOPped: they
    hang) and a job runs: the job gets shutdown_grace, then SIGTERM and kill_grace, and the
    worker gives up reporting 10 s later at most; it sleeps meanwhile and exits (it stayed
    up well past that bound, spinning)."""
    app.configure(redis_url=own_redis.url)
    stack = Stack(app, own_redis.url)
    try:
        w = stack.worker(concurrency=1)
        job = app.enqueue("tests.apps.nap", [60])
        wait_for(lambda: job.state == "running", what="the job to start")
        if down == "stopped":
            own_redis.stop()
        else:
            os.kill(own_redis.proc.pid, signal.SIGSTOP)
        _says(w, "Redis unavailable")
        w.send_signal(signal.SIGTERM)
        share = cpu_share(w.pid)
        bound = float(FAST["TASKRUNNER_SHUTDOWN_GRACE"]) + float(FAST["TASKRUNNER_KILL_GRACE"]) + 10
        assert w.wait(bound + 60) == 0  # a generous deadline for "it exits", not a speed
        rest = w.stdout.read()
        # It left because its own bound passed (it gave up reporting), not because Redis came back.
        assert "could not report every job" in rest or "without saying goodbye" in rest, rest
        assert share < BUSY, share
    finally:
        stack.stop()
        if down == "hung":
            os.kill(own_redis.proc.pid, signal.SIGCONT)


def test_worker_sleeps_while_a_busy_child_cannot_take_more(app, stack):
    """Arguments sent ahead to a child busy in a long job that its pipe cannot hold wait
    in the worker: it waits for the pipe to have room in its select (POLLOUT). It woke every
    10 ms to try again, for as long as the job ran."""
    w = stack.worker(concurrency=1)
    assert [apps.add.delay(i, 1).wait(30) for i in range(20)] == list(range(1, 21))  # short jobs: it sends ahead
    long, big = app.enqueue_many([{"task": "tests.apps.nap", "args": [30]},  # claimed together
                                  {"task": "tests.apps.add", "args": ["x" * 600_000, "y"]}])  # more than a pipe holds
    wait_for(lambda: long.state == "running", what="the long job to start")
    wait_for(lambda: "end:1" in big.refresh().data, what="the job sent ahead to be handed back")  # after HOLD
    p = psutil.Process(w.pid)
    before, started = p.num_ctx_switches().voluntary, time.monotonic()
    time.sleep(3)  # the measurement window
    rate = (p.num_ctx_switches().voluntary - before) / (time.monotonic() - started)
    assert rate < 50, f"{rate:.0f} wake-ups a second"  # heartbeats (5/s here) and their answers


def test_an_idle_dispatchers_passes_between_tidy_passes_only_promote_and_read_deadlines(app):
    """An idle queue cost the dispatcher's every pass (every 0.5 s) four ZREMRANGEBYSCOREs,
    an HMGET of its meta and an XRANGE of its outbox: ~90% of an idle dispatcher's Redis
    work, for trims that nothing needs each half second. A tidy pass (the first, then every
    TIDY_EVERY seconds) trims and reads the outboxes; the passes between call each queue's
    sweep for its promotions and deadlines alone."""
    from taskrunner.ops import queue
    from taskrunner.ops.dispatcher import Dispatcher

    for name in ("a", "b", "c"):
        queue.create(app, name)
    queues = len(app.redis.smembers(app.keys.queues))
    d = Dispatcher(app)
    app.redis.config_resetstat()
    d.run_once()  # the first pass tidies
    tidy = app.redis.info("commandstats")
    app.redis.config_resetstat()
    d.run_once()
    between = app.redis.info("commandstats")
    assert tidy["cmdstat_zremrangebyscore"]["calls"] == 4 * queues and tidy["cmdstat_xrange"]["calls"] == queues
    assert "cmdstat_zremrangebyscore" not in between and "cmdstat_xrange" not in between
    assert between["cmdstat_fcall"]["calls"] == queues  # its sweep, each pass
