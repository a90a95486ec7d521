"""Waiting: for a result (Job.wait, AsyncClient.wait, `taskrunner wait`), for room in a
bounded queue, for a job to consume. A wait lasts as long as the caller asks, whatever the
connection's socket_timeout (redis-py 6 and later default it to 5 s), blocks in Redis
rather than polling, and outlives a Redis outage: it reconnects and looks again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from taskrunner import QueueFull
from taskrunner.client.aio import AsyncClient
from taskrunner.client.consumer import Consumer
from taskrunner.ops import queue
from taskrunner.ops.redis_server import RedisServer
from taskrunner.protocol.connection import SOCKET_TIMEOUT, ClusterURL, connect, connect_async
from tests import apps
from tests.conftest import ROOT, Stack, wait_for


def _in_thread(fn, *args) -> dict:
    """Run fn(*args) in a thread; the dict gets its result or its exception."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  # the test asserts on it
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _async_wait(app, job_id: str, timeout: float | None = None):
    async def main():
        client = AsyncClient(app)
        try:
            return await client.wait(job_id, timeout)
        finally:
            await client.close()

    return asyncio.run(main())


def _joined(out: dict, timeout: float = 60) -> object:
    out["thread"].join(timeout)
    assert not out["thread"].is_alive(), "the waiter is still waiting"
    if "error" in out:
        raise out["error"]
    return out["result"]


def _blpops(app) -> int:
    return app.redis.info("commandstats").get("cmdstat_blpop", {}).get("calls", 0)


def test_waits_on_a_seven_second_job_with_default_settings(app, stack):
    """The first hour's report: `taskrunner wait ID --timeout 20` on a 7 s job, and
    job.wait() with no timeout, died after 5 s with `TimeoutError: Timeout reading from
    socket`. Each blocks in Redis: a handful of BLPOPs in 7 s, not a poll loop."""
    stack.worker()
    job = apps.nap.delay(7)
    wait_for(lambda: job.state == "running", what="the job to start")
    before = _blpops(app)
    sync = _in_thread(apps.app.job(job.id).wait)
    aio = _in_thread(_async_wait, app, job.id)
    cli = stack.cli("wait", job.id, "--timeout", "20")
    assert (cli.returncode, cli.stdout.strip(), cli.stderr) == (0, "7", "")
    assert _joined(sync) == 7 and _joined(aio) == 7
    assert _blpops(app) - before < 20  # 3 waiters, one BLPOP each per 5 s (and per wake-up)


def test_every_blocking_wait_outlasts_a_short_socket_timeout(app, stack, redis_server):
    """socket_timeout=0.5 in the URL bounds each answer Redis owes at once, never a wait the
    caller asked for: a result wait, an asyncio one, a consumer's wait for a job, a
    producer's wait for room in a full bounded queue (sync and asyncio)."""
    app.configure(redis_url=redis_server.url + "?socket_timeout=0.5")
    stack.worker()
    job = apps.nap.delay(2)
    aio = _in_thread(_async_wait, app, job.id, 30)
    assert job.wait(30) == 2
    assert _joined(aio) == 2

    started = time.monotonic()
    assert Consumer(app, ["nothing-here"], name="c-idle").claim(1, block=1.5) == []
    assert time.monotonic() - started >= 1.5

    queue.create(app, "full", bound=1)
    apps.add.apply_async([1, 1], queue="full")
    with pytest.raises(QueueFull):
        apps.add.apply_async([1, 2], queue="full", block_timeout=1.5)

    async def aio_full() -> None:
        client = AsyncClient(app)
        try:
            await client.enqueue("tests.apps.add", [1, 3], queue="full", block_timeout=1.5)
        finally:
            await client.close()

    with pytest.raises(QueueFull):
        asyncio.run(aio_full())


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path, appendonly=True, appendfsync="always").start()
    yield server
    server.stop()


def test_a_redis_outage_loses_no_wait_and_kills_no_job(app, own_redis):
    """Redis stops for longer than the client's own retries last (redis-py's are about 4 s)
    and than dead_after, while three waiters wait for a job that runs across the outage:
    each reconnects with backoff, looks again, and gets the result; the CLI's waiter exits
    0. The dispatcher gives the worker dead_after to heartbeat once Redis is back: it
    declared it dead at once (every heartbeat was old), and the job was killed and run
    again. A job taken by `taskrunner consume` runs across the outage too: its heartbeat
    goes on after it (its thread died at the first error)."""
    app.configure(redis_url=own_redis.url)
    stack = Stack(app, own_redis.url)
    try:
        stack.worker()
        stack.dispatcher()
        job = apps.nap.delay(15)  # long enough for the waiters and the consumer to start on a loaded machine
        wait_for(lambda: job.state == "running", what="the job to start")
        sync = _in_thread(apps.app.job(job.id).wait, 60)
        aio = _in_thread(_async_wait, app, job.id, 60)
        cli = subprocess.Popen([sys.executable, "-m", "taskrunner", "wait", job.id, "--timeout", "60"], cwd=ROOT,
                               env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stack.procs.append(cli)
        # counted before the consumer starts: its watch for kill requests is a BLPOP too
        wait_for(lambda: sum(c["cmd"] == "blpop" for c in app.redis.client_list()) == 3,
                 what="the three waiters to block")
        by_hand = app.enqueue("tests.apps.nap", [0], queue="byhand")
        consume = subprocess.Popen([sys.executable, "-m", "taskrunner", "consume", "-q", "byhand", "--", "sh", "-c",
                                    "sleep 15; echo 7"], cwd=ROOT, env=stack.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        stack.procs.append(consume)
        wait_for(lambda: by_hand.state == "running", what="the consumer to take its job")
        own_redis.stop()
        time.sleep(6)  # the outage: longer than redis-py's retries, shorter than the job
        own_redis.start()
        out, err = cli.communicate(timeout=60)
        assert (cli.returncode, out.strip()) == (0, "15"), err
        assert _joined(sync) == 15 and _joined(aio) == 15
        assert job.refresh().data["attempts"] == "1" and not job.data.get("lost"), job.data
        out, err = consume.communicate(timeout=60)
        assert (consume.returncode, out.strip()) == (0, "7"), err
        assert "Traceback" not in err, err
        assert by_hand.refresh().data["state"] == "completed" and by_hand.data["attempts"] == "1", by_hand.data
    finally:
        stack.stop()


def test_cli_wait_exit_code_says_redis_is_unreachable(tmp_path):
    """Redis down is not "failed" (exit 1) nor "timeout" (exit 2): exit 3, one line."""
    url = f"unix://{tmp_path}/no-redis.sock"
    r = subprocess.run([sys.executable, "-m", "taskrunner", "wait", "0123456789ABCDEFGHJKMNPQRS", "--timeout", "1",
                        "--redis-url", url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert r.stderr.startswith("Error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_every_client_has_a_socket_timeout_unless_its_url_sets_one():
    """redis-py 5.x sets none: a Redis that stops answering (SIGSTOP, a partition) hung a
    worker's loop, and its stopping, for good. Every form of URL gets SOCKET_TIMEOUT, and
    its own socket_timeout wins."""
    def timeout_of(client) -> float:
        return client.connection_pool.connection_kwargs["socket_timeout"]

    for url in ("redis://127.0.0.1:1/0", "unix:///nowhere.sock", "redis+sentinel://127.0.0.1:1/svc"):
        assert timeout_of(connect(url)) == SOCKET_TIMEOUT == 5.0, url
        assert timeout_of(connect_async(url)) == SOCKET_TIMEOUT, url
        mark = "&" if "?" in url else "?"
        assert timeout_of(connect(url + mark + "socket_timeout=0.5")) == 0.5, url
        assert timeout_of(connect_async(url + mark + "socket_timeout=0.5")) == 0.5, url
    cluster = ClusterURL.parse("redis+cluster://127.0.0.1:1")
    assert cluster._options({})["socket_timeout"] == SOCKET_TIMEOUT
    assert ClusterURL.parse("redis+cluster://127.0.0.1:1?socket_timeout=0.5")._options({})["socket_timeout"] == 0.5


@pytest.fixture
def by_hand(app, own_redis):
    """A stack on own_redis and a job in queue `byhand`, for consume_by_hand()."""
    app.configure(redis_url=own_redis.url)
    stack = Stack(app, own_redis.url)
    try:
        yield stack, app.enqueue("tests.apps.nap", [0], queue="byhand")
    finally:
        stack.stop()


def consume_by_hand(stack: Stack, script: str, new_session: bool = False) -> subprocess.Popen:
    """`taskrunner consume -q byhand -- sh -c SCRIPT`, stdout and stderr piped apart."""
    args = [sys.executable, "-m", "taskrunner", "consume", "-q", "byhand", "--", "sh", "-c", script]
    consume = subprocess.Popen(args, cwd=ROOT, env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=new_session)
    stack.procs.append(consume)
    return consume


def test_consume_reports_a_command_that_ended_while_redis_was_down(by_hand, own_redis, tmp_path):
    """`taskrunner consume -- CMD`: CMD ends while Redis is down for longer than redis-py's own
    retries. The consumer keeps its outcome and reports it once Redis answers: exit 0, the job
    completed (it exited 1, "cannot reach Redis", and the job went back to run again)."""
    stack, job = by_hand
    ended = tmp_path / "ended"
    consume = consume_by_hand(stack, f"read -r line; while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; echo 7; "
                                     f"touch {ended}")
    wait_for(lambda: job.state == "running", what="the job to be taken")
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(consume.stderr), daemon=True)
    reader.start()
    own_redis.stop()
    (tmp_path / "go").touch()
    wait_for(lambda: ended.exists(), what="the command to end")
    wait_for(lambda: consume.poll() is not None or any(f"reporting job {job.id}" in line for line in err),
             timeout=60, what="the consumer to give up or to wait for Redis")
    own_redis.start()
    out = consume.stdout.read()
    consume.wait(timeout=60)
    reader.join(timeout=10)
    assert (consume.returncode, out.strip()) == (0, "7"), "".join(err)
    assert job.refresh().data["state"] == "completed" and job.data["attempts"] == "1", job.data


def test_consume_interrupted_while_redis_is_down_exits_130_saying_where_its_job_is(by_hand, own_redis, tmp_path):
    """Ctrl-C while CMD runs and Redis is down: consume cannot hand the job back, and says so
    (it stays held until the dispatcher finds this consumer dead and requeues it), exit 130.
    Handing it back raised: exit 3 ("cannot reach Redis"), nothing said of the job."""
    stack, job = by_hand
    started = tmp_path / "started"
    consume = consume_by_hand(stack, f"read -r line; touch {started}; i=0; "
                                     "while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done", new_session=True)
    wait_for(started.exists, what="the command to start")
    own_redis.stop()
    os.killpg(consume.pid, signal.SIGINT)  # as a terminal does: to its foreground process group
    _, err = consume.communicate(timeout=120)
    assert consume.returncode == 130, err
    assert "interrupted: Redis unreachable" in err and f"job {job.id} goes back to its queue once" in err, err
    own_redis.start()
    assert job.refresh().data["state"] == "running"  # held, for the dispatcher to requeue


def test_a_cancellable_blocker_asks_its_client_id_again_on_a_new_socket(app):
    """redis-py reconnects a connection an error closed: CLIENT UNBLOCK must then name the
    new connection, not the one before (whose id may be another client's after a restart)."""
    from taskrunner.protocol.blocking import Blocker

    key = app.keys.q("default") + "wake"
    b = Blocker(app.redis, [key], cancellable=True)

    def ours() -> int:
        return wait_for(lambda: next((int(c["id"]) for c in app.redis.client_list()
                                      if c["cmd"] == "brpop"), None), what="our BRPOP")

    b.arm(30)
    assert b.client_id == ours()
    assert b.cancel() is None and not b.armed
    b.conn.disconnect()  # what redis-py does to a connection whose command failed
    b.arm(30)
    assert b.client_id == ours()
    app.redis.lpush(key, "1")
    assert b.read() == [key, "1"]
    b.reset()
