"""Redis itself restarts (AOF on) while workers and dispatchers run: nothing is lost."""

from __future__ import annotations

import pytest

from taskrunner.redis_server import RedisServer
from tests import apps
from tests.conftest import Stack, wait_for


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
