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
