"""Redis itself restarts (AOF on) while workers and dispatchers run: nothing is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from taskrunner.ops.redis_server import RedisServer
from taskrunner.protocol import scripts
from tests import apps
from tests.conftest import ROOT, Stack, wait_for


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path, appendonly=True, appendfsync="always").start()
    yield server
    server.stop()


@pytest.mark.parametrize("crash", [False, True], ids=["sigterm", "sigkill"])
def test_redis_restart_mid_run(app, own_redis, crash):
    app.configure(redis_url=own_redis.url)
    stack = Stack(app, own_redis.url)
    try:
        stack.dispatcher()
        w = stack.worker()
        jobs = [apps.add.delay(i, 1) for i in range(300)]
        jobs += [apps.add.apply_async([i, 2], delay=0.5) for i in range(50)]
        holder = apps.nap.delay(1.5)  # runs across the restart
        wait_for(lambda: app.redis.zcard(app.keys.q("default") + "completed") >= 20, what="some jobs done")
        own_redis.restart(kill=crash)  # appendfsync always: every acknowledged write survives
        results = [j.wait(60) for j in jobs]
        assert results == [i + 1 for i in range(300)] + [i + 2 for i in range(50)]
        assert holder.wait(60) == 1.5
        assert w.poll() is None
    finally:
        stack.stop()


def test_a_restart_without_persistence_loses_the_library_and_the_worker_loads_it_again(app, tmp_path):
    """Functions persist with the data (AOF, RDB) and reach replicas; a Redis restarted with
    neither has none: the worker's next claims and finishes (batched) and the producer's
    enqueues meet "Function not found", load the library and go on. The worker is held
    (SIGSTOP) across the restart, so that the library's absence is seen before it loads it
    again (CI: under load it had, before the test looked)."""
    server = RedisServer(tmp_path, appendonly=False).start()
    app.configure(redis_url=server.url)
    stack = Stack(app, server.url)
    try:
        w = stack.worker()
        assert apps.add.delay(1, 1).wait(30) == 2
        os.killpg(w.pid, signal.SIGSTOP)
        try:
            server.restart()
            assert app.redis.function_list() == []
        finally:
            os.killpg(w.pid, signal.SIGCONT)
        jobs = [apps.add.delay(i, 1) for i in range(100)]
        assert [j.wait(60) for j in jobs] == [i + 1 for i in range(100)]
        assert app.redis.function_list(library=scripts.LIBRARY_NAME)
    finally:
        stack.stop()
        server.stop()


def test_dropped_connections_lose_nothing(app, stack):
    stack.dispatcher()
    w = stack.worker()
    jobs = [apps.add.delay(i, 1) for i in range(200)]
    wait_for(lambda: app.redis.zcard(app.keys.q("default") + "completed") >= 10, what="some jobs done")
    for _ in range(3):
        app.redis.client_kill_filter(_type="normal", skipme=True)  # every other client's connection
    jobs.append(apps.nap.delay(0.5))
    assert [j.wait(60) for j in jobs] == [i + 1 for i in range(200)] + [0.5]
    assert w.poll() is None


def test_worker_and_dispatcher_started_while_redis_is_down_wait_for_it(app, tmp_path):
    """Started before Redis (a host booting, Redis loading a big AOF): they wait, then work."""
    server = RedisServer(tmp_path, appendonly=True)
    app.configure(redis_url=server.url)
    stack = Stack(app, server.url)
    try:
        w, d = stack.worker(), stack.dispatcher()
        lines: list[str] = []
        wait_for(lambda: lines.append(w.stdout.readline()) or "Redis unavailable" in lines[-1],
                 what="the worker to say it waits for Redis")
        assert w.poll() is None and d.poll() is None
        server.start()
        assert apps.add.delay(2, 3).wait(30) == 5
        assert apps.add.apply_async([1, 1], delay=0.2).wait(30) == 2  # the dispatcher promotes it
    finally:
        stack.stop()
        server.stop()


def _pending(app) -> set[str]:
    return set(app.redis.lrange(app.keys.q("default") + "pending", 0, -1))


def test_lone_enqueue_fast_path_recovers_from_dropped_connections_restarts_and_flushes(app, own_redis):
    """A lone enqueue goes on a connection of its thread's own, outside the pool (Direct):
    a connection killed under it, a Redis restart or a flushed script cache cost a retry,
    never a job or an error."""
    app.configure(redis_url=own_redis.url)
    ids = [apps.add.delay(0, 0).id]
    assert app._direct is not None and app._direct.local.link.sock is not None
    names = {c["id"]: c for c in app.redis.client_list()}
    assert len(names) >= 2  # the pool's connection and the fast path's own
    app.redis.client_kill_filter(_type="normal", skipme=True)  # the fast path's connection
    ids.append(apps.add.delay(1, 1).id)
    own_redis.restart(kill=True)  # appendfsync always: the jobs before survive
    ids.append(apps.add.delay(2, 2).id)
    app.redis.function_flush()
    ids.append(apps.add.delay(3, 3).id)
    assert _pending(app) == set(ids)
    assert [app.job(i).data["args"] for i in ids] == ["[0,0]", "[1,1]", "[2,2]", "[3,3]"]


def test_lone_enqueue_fast_path_times_out_when_redis_stops_answering(app, own_redis):
    """The fast path's socket blocks, its timeout kept by the kernel (SO_RCVTIMEO), not by
    a poll() before each recv: a Redis that stops answering (SIGSTOP) gives TimeoutError
    after socket_timeout and the client's retries, never a hang; once it answers again, so
    does the next enqueue, on a new connection."""
    app.configure(redis_url=own_redis.url + "?socket_timeout=0.3", enqueue_retry=0)  # no riding it out
    apps.add.delay(0, 0)
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(redis.TimeoutError):
            apps.add.delay(1, 1)
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert apps.add.delay(2, 2).id in _pending(app)
    assert app._direct.local.link.sock is not None


def test_lone_enqueue_spins_briefly_then_sleeps_when_redis_is_slow(app, own_redis):
    """A lone enqueue polls for its answer for enqueue_spin seconds, then sleeps on the
    socket: a Redis that stops answering (SIGSTOP) costs the caller almost no CPU while it
    waits out socket_timeout and the retries, and the answer after SIGCONT is the right one."""
    app.configure(redis_url=own_redis.url + "?socket_timeout=0.3", enqueue_spin=0.001, enqueue_retry=0)
    apps.add.delay(0, 0)
    assert app._direct.spin == 0.001  # a unix socket: Redis is on this machine
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        cpu, wall = time.process_time(), time.monotonic()
        with pytest.raises(redis.TimeoutError):
            apps.add.delay(1, 1)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert wall >= 0.3 and cpu < wall / 4, (cpu, wall)  # slept, spun only at each try's start
    job = apps.add.delay(2, 2)
    assert job.id in _pending(app) and app.job(job.id).data["args"] == "[2,2]"


@pytest.mark.parametrize("url, spins", [("redis://127.0.0.1:6399", True), ("redis://[::1]:6399", True),
                                        ("redis://localhost:6399", True), ("redis://10.1.2.3:6399", False),
                                        ("redis://redis.example:6399", False)])
def test_enqueue_spins_only_for_a_redis_on_this_machine(url, spins):
    """No spin for a remote Redis (its answer takes the network's round trip) or on one CPU."""
    code = ("import os, sys\nfrom taskrunner.protocol.connection import connect\n"
            "from taskrunner.protocol.links import Direct\n"
            "if sys.argv[2] == 'one': os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "print(Direct.of(connect(sys.argv[1]), 0.0001).spin)")
    for cpus, expected in (("all", 0.0001 if spins else 0.0), ("one", 0.0)):
        out = subprocess.run([sys.executable, "-c", code, url, cpus], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        assert float(out) == expected, (url, cpus, out)


def test_lone_enqueue_fast_path_per_thread_and_after_fork(app):
    """Each thread has its own connection (a reply never goes to another thread's call), and
    a forked process makes its own client and connections."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda i: apps.add.delay(i, 0).id, range(400)))
    assert len(set(ids)) == 400 and _pending(app) == set(ids)
    jobs = {i: app.job(i).data["args"] for i in ids}
    assert sorted(jobs.values()) == sorted(f"[{i},0]" for i in range(400))
    assert all(jobs[i] == f"[{n},0]" for n, i in enumerate(ids))  # each call got its own answer
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: enqueue, say the id, exit without running pytest's teardown
        try:
            os.write(w, apps.add.delay(7, 7).id.encode())
        finally:
            os._exit(0)
    os.close(w)
    child_id = os.read(r, 100).decode()
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0
    assert app.job(child_id).data["args"] == "[7,7]"
    assert apps.add.delay(8, 8).id in _pending(app)  # the parent's connection is still its own


def test_batch_sent_ahead_is_sent_again_when_its_answers_are_lost(app):
    """enqueue_many sends a chunk and builds the next meanwhile (Batch.send). If the
    connection dies before the answers come, the chunk goes again the usual way: the ids
    make that idempotent."""
    from taskrunner.client.app import _enqueue_args
    from taskrunner.protocol import scripts
    from taskrunner.protocol.codec import new_id

    admin = app.redis
    admin.ping()
    direct_id = app._direct.execute_command("CLIENT", "ID")
    ids = [new_id() for _ in range(50)]
    batch = scripts.Batch(admin, app._direct)
    fields = ["task", "tests.apps.add", "queue", "default", "args", "[1,1]", "kwargs", "{}"]
    batch.call(scripts.ENQUEUE, [app.keys.q("default")], _enqueue_args([(i, 0, fields) for i in ids]))
    admin.client_pause(10_000, all=False)  # writes (scripts among them) wait
    try:
        batch.send()
        wait_for(lambda: any(c["id"] == str(direct_id) and c["cmd"] == "fcall" for c in admin.client_list()),
                 what="the batch to reach Redis")
        admin.client_kill_filter(_id=direct_id)  # its answers will never come
    finally:
        admin.client_unpause()
    assert batch.execute() == [[1] * 50]  # sent again: every job created once, by this call
    assert _pending(app) == set(ids)
    assert apps.add.delay(1, 2).id in _pending(app)  # the fast path reconnects


def _read_until(p: subprocess.Popen, lines: list[str], cond, what: str) -> None:
    """Read the process's output into `lines` until cond(lines) holds."""
    wait_for(lambda: lines.append(p.stdout.readline()) or cond(lines), what=what)


def test_an_outage_is_one_warning_and_one_line_when_redis_is_back(app, own_redis):
    """Each process says once that Redis is unavailable and once that it answers again; the
    tries between are debug lines. A worker logged a warning at every try (every heartbeat),
    a dispatcher every 5 s, for as long as Redis was down, and neither said it was back; then
    the worker's first sync after it warned again, on its own connection from before."""
    app.configure(redis_url=own_redis.url)
    stack = Stack(app, own_redis.url)
    try:
        procs = {"worker": stack.spawn("worker", "-A", "tests.apps", "-c", "1", "--log-level", "debug"),
                 "dispatcher": stack.spawn("dispatcher", "-A", "tests.apps", "--log-level", "debug")}
        seen: dict[str, list[str]] = {name: [] for name in procs}
        for name, p in procs.items():
            _read_until(p, seen[name], lambda lines, name=name: f"INFO {name}" in lines[-1], f"the {name} started")
        assert apps.add.delay(1, 1).wait(30) == 2  # the worker's connections are open
        own_redis.stop()
        for name, p in procs.items():
            lines = seen[name] = []
            _read_until(p, lines, lambda lines: sum("unavailable" in line for line in lines) >= 4,
                        f"the {name} to try Redis 4 times")
            warned = [line for line in lines if " WARNING " in line and "unavailable" in line]
            assert len(warned) == 1, warned
        own_redis.start()
        for name, p in procs.items():
            lines = seen[name] = []
            _read_until(p, lines, lambda lines: "Redis answers again" in lines[-1], f"the {name} to see Redis back")
        assert apps.add.apply_async([1, 1], delay=0.2).wait(30) == 2  # both at work again
        for name, p in procs.items():  # without another warning: a connection left from before the outage
            p.send_signal(signal.SIGTERM)  # failed at its first use (the worker's syncs), and said so
            assert p.wait(60) == 0
            rest = seen[name] + p.stdout.readlines()
            assert not [line for line in rest if " WARNING " in line], rest
    finally:
        stack.stop()
