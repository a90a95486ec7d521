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


def test_after_downtime_only_the_latest_tick_fires(app):
    from taskrunner import TaskRunner
    from taskrunner.ops.dispatcher import Dispatcher

    t = TaskRunner("catchup", redis_url=app.settings.redis_url, prefix=app.settings.prefix)
    t.periodic("*/5 * * * *", name="often")(t.task(lambda: None, name="often"))
    t.periodic("*/5 * * * *", name="skipper", missed="skip")(t.task(lambda: None, name="skipper"))
    d = Dispatcher(t)
    now = 1_800_000_000.0 + 17  # 17 s past a 5-minute tick
    assert d.fire_schedules(now) == 0  # first sight: nothing from the past
    down_until = now + 3700  # an hour down: 12 ticks missed, the latest 117 s ago
    assert d.fire_schedules(down_until) == 1  # "once": only the latest, once; "skip": none
    assert d.fire_schedules(down_until + 1) == 0
    d2 = Dispatcher(t)  # a second dispatcher at the same moment adds nothing
    assert d2.fire_schedules(down_until + 2) == 0
    pending = t.redis.lrange(t.keys.q("default") + "pending", 0, -1)
    assert pending == [f"cron.often.{int(1_800_000_000 + 3600)}"]
    assert d.fire_schedules(down_until + 200) == 2  # the next tick, on time, for both
