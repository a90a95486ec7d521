"""Cron schedules fire each tick exactly once, however many dispatchers run."""

from __future__ import annotations

import time

from tests import cron_app
from tests.conftest import wait_for


def test_two_dispatchers_fire_each_tick_once(app, stack):
    cron_app.app.configure(redis_url=stack.url, prefix=app.settings.prefix)
    r = cron_app.app.redis
    stack.dispatcher(app="tests.cron_app")
    stack.dispatcher(app="tests.cron_app")
    stack.worker("-Q", "cron", app="tests.cron_app", concurrency=1)
    pattern = f"{app.settings.prefix}:ledger:cron:*"
    wait_for(lambda: len(list(r.scan_iter(pattern))) >= 4, timeout=30, what="4 ticks")
    time.sleep(0)  # no fixed sleeps: the ledger below is checked as it stands
    counts = {k: int(r.get(k)) for k in r.scan_iter(pattern)}
    assert set(counts.values()) == {1}, counts
    jobs = r.zrange(cron_app.app.keys.q("cron") + "completed", 0, -1)
    assert all(j.startswith("cron.tests.cron_app.every_second.") for j in jobs)
    assert len(jobs) == len(set(jobs))
    state = cron_app.app.redis.hget(cron_app.app.keys.schedules, "tests.cron_app.every_second")
    assert '"cron":"* * * * * *"' in state and '"next"' in state
