"""Schedules changed at runtime (`taskrunner schedule ...`, the dashboard): intervals fired by
two real dispatchers once per tick, pause, resume, run-now, delete; time zones across
daylight-saving changes, overlap and jitter, with a dispatcher driven at chosen times."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from zoneinfo import ZoneInfo

import pytest

from dashboard import create_app
from taskrunner import TaskRunner
from taskrunner.client import declarations
from taskrunner.client.app import Schedule
from taskrunner.errors import NameInUse
from taskrunner.ops import queue, schedules
from taskrunner.ops.dispatcher import Dispatcher
from taskrunner.protocol import shards
from taskrunner.protocol.connection import server_time
from tests.conftest import Stack, wait_for
from tests.test_dashboard import csrf, login

BERLIN = ZoneInfo("Europe/Berlin")


def ticks_of(app, queue: str = "default") -> list[int]:
    """The tick times of the schedule jobs of a queue, pending or done."""
    p = app.keys.q(queue)
    ids = app.redis.lrange(p + "pending", 0, -1) + app.redis.zrange(p + "completed", 0, -1) \
        + app.redis.zrange(p + "delayed", 0, -1)
    return sorted(int(i.rsplit(".", 1)[1]) for i in ids if i.startswith("cron."))


def test_every_fires_each_tick_once_with_two_dispatchers_and_pause_stops_it(app, stack):
    r = stack.cli("schedule", "add", "poll", "tests.apps.add", "--every", "2s", "--args", "[1, 2]")
    assert r.returncode == 0 and "every 2 s" in r.stdout, r.stderr
    stack.dispatcher()
    stack.dispatcher()
    stack.worker(concurrency=1)
    p = app.keys.q("default")
    wait_for(lambda: app.redis.zcard(p + "completed") >= 3, timeout=60, what="3 ticks run")
    done = app.redis.zrange(p + "completed", 0, -1)
    assert all(i.startswith("cron.poll.") for i in done) and len(done) == len(set(done))
    ticks = sorted(int(i.rsplit(".", 1)[1]) for i in done)
    assert all(t % 2 == 0 for t in ticks) and all(b - a >= 2 for a, b in zip(ticks, ticks[1:]))
    for i in done:  # each tick's job ran once
        assert app.redis.hget(app.keys.job("default", i), "attempts") == "1"
    listed = json.loads(stack.cli("schedule", "list", "--json", check=True).stdout)
    [row] = [s for s in listed if s["name"] == "poll"]
    assert row["every"] == 2 and row["source"] == "runtime" and not row["paused"] and row["last_fired_at"]

    assert stack.cli("schedule", "pause", "poll").returncode == 0
    paused_at = app.redis.time()[0]
    # Two dispatchers' passes well past two more ticks: nothing fired after the pause (a
    # tick enqueued in the pass that raced the pause is the only one allowed).
    wait_for(lambda: all(json.loads(v)["last_pass"] > paused_at + 5 for v in app.redis.hvals(app.keys.dispatchers)),
             timeout=30, what="dispatcher passes 5 s after the pause")
    assert [t for t in ticks_of(app) if t > paused_at + 1] == []
    assert json.loads(stack.cli("schedule", "list", "--json", check=True).stdout)[0]["paused"] is True
    job_id = stack.cli("schedule", "run-now", "poll", check=True).stdout.strip()
    wait_for(lambda: app.redis.hget(app.keys.job("default", job_id), "state") == "completed", what="run-now's job")
    assert stack.cli("schedule", "resume", "poll").returncode == 0
    resumed_at = app.redis.time()[0]
    wait_for(lambda: any(t > resumed_at for t in ticks_of(app)), timeout=30, what="a tick after resume")
    r = stack.cli("schedule", "delete", "poll")
    assert r.returncode == 0 and "deleted" in r.stdout
    assert "poll" not in [s["name"] for s in json.loads(stack.cli("schedule", "list", "--json").stdout)]


def _day(app: TaskRunner, name: str, start: datetime, hours: float, step: float = 600) -> list[float]:
    """Drive a dispatcher every `step` seconds for `hours` from `start`; the ticks fired."""
    d = Dispatcher(app)
    t = start.timestamp()
    fired: list[float] = []
    while t < start.timestamp() + hours * 3600:
        before = set(ticks_of(app))
        d.fire_schedules(t)
        fired += sorted(set(ticks_of(app)) - before)
        t += step
    return fired


def _local(ts: float) -> str:
    return datetime.fromtimestamp(ts, BERLIN).strftime("%H:%M %Z")


def test_a_time_zone_cron_across_spring_forward_and_fall_back(app):
    """Europe/Berlin: 02:30 does not exist on 2026-03-29 (it fires once, at 03:30 CEST) and
    exists twice on 2026-10-25 (it fires once, the first time); an hourly cron fires 23 times
    on the short day and 24 on the long one (each wall time once)."""
    t = TaskRunner("dst", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "dst1")
    schedules.add(t, "nightly", "shop.nightly", cron="30 2 * * *", tz="Europe/Berlin")
    spring = _day(t, "nightly", datetime(2026, 3, 28, 22, 0, tzinfo=timezone.utc), 24)
    assert [_local(x) for x in spring] == ["03:30 CEST"]
    f = TaskRunner("dst", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "dst4")
    schedules.add(f, "nightly", "shop.nightly", cron="30 2 * * *", tz="Europe/Berlin")
    fall = _day(f, "nightly", datetime(2026, 10, 24, 21, 0, tzinfo=timezone.utc), 24)
    assert [_local(x) for x in fall] == ["02:30 CEST"]  # the first 02:30 (summer time), not the second

    h = TaskRunner("dst", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "dst2")
    schedules.add(h, "hourly", "shop.hourly", cron="0 * * * *", tz="Europe/Berlin")
    short = _day(h, "hourly", datetime(2026, 3, 28, 22, 59, 30, tzinfo=timezone.utc), 23, step=300)
    assert len(short) == 23 and len(set(short)) == 23 and "02:00" not in {_local(x)[:5] for x in short}
    h2 = TaskRunner("dst", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "dst3")
    schedules.add(h2, "hourly", "shop.hourly", cron="0 * * * *", tz="Europe/Berlin")
    long = _day(h2, "hourly", datetime(2026, 10, 24, 21, 59, 30, tzinfo=timezone.utc), 25, step=300)
    walls = [_local(x)[:5] for x in long]
    assert len(long) == 24 and walls.count("02:00") == 1 and sorted(set(walls)) == sorted(walls)


def test_a_schedule_fires_after_a_deploy_changed_its_tasks_signature(app):
    """(Review.) A schedule's arguments are checked when it is added; the dispatcher fires it
    unchecked. It checked them again against the new code: refused every pass (an error logged
    twice a second), its state never recorded, no job to see."""
    prefix = app.settings.prefix + "dep"
    old = TaskRunner("v1", redis_url=app.settings.redis_url, prefix=prefix)
    old.task(lambda a: a, name="shop.report")
    schedules.add(old, "nightly", "shop.report", every="10s", args=[1])
    new = TaskRunner("v2", redis_url=app.settings.redis_url, prefix=prefix)
    new.task(lambda a, b: a + b, name="shop.report")
    d = Dispatcher(new)
    base = 1_800_000_000.0
    d.fire_schedules(base + 1)  # first sight: nothing
    assert d.fire_schedules(base + 11) == 1 and ticks_of(new) == [int(base + 10)]
    assert json.loads(new.redis.hget(new.keys.schedules, "nightly"))["last_job"] == f"cron.nightly.{int(base + 10)}"


def test_overlap_skip_and_jitter(app):
    t = TaskRunner("ovl", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "ovl")
    schedules.add(t, "slow", "shop.slow", every="10s", overlap="skip")
    d = Dispatcher(t)
    base = 1_800_000_000.0
    d.fire_schedules(base + 1)  # first sight: nothing
    d.fire_schedules(base + 11)  # tick base+10
    d.fire_schedules(base + 21)  # its job is still pending (no worker): skipped
    assert ticks_of(t) == [int(base + 10)]
    state = json.loads(t.redis.hget(t.keys.schedules, "slow"))
    assert state["skipped"] == 1 and state["last_job"] == f"cron.slow.{int(base + 10)}"
    t.redis.hset(t.keys.job("default", state["last_job"]), "state", "completed")  # as if it ended
    d.fire_schedules(base + 31)
    assert ticks_of(t) == [int(base + 10), int(base + 30)]

    j = TaskRunner("jit", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "jit")
    schedules.add(j, "spread", "shop.spread", every="60s", jitter=30)
    dj = Dispatcher(j)
    dj.fire_schedules(base + 1)
    now = j.redis.time()[0]
    dj.fire_schedules(base + 61)
    [job_id] = j.redis.zrange(j.keys.q("default") + "delayed", 0, -1)
    due = j.redis.zscore(j.keys.q("default") + "delayed", job_id)
    assert 0 < due - now <= 31  # up to 30 s later, from when it was enqueued
    again = schedules.jitter_of(schedules.effective(j)[0][0], base + 60)
    assert again == schedules.jitter_of(schedules.effective(j)[0][0], base + 60) and 0 < again < 30


def test_overlap_skip_on_a_sharded_queue(app):
    """On a sharded queue a tick's job goes to the shard of its id's hash (README, Sharded
    queues): the job of the previous tick is looked at on that shard. It was looked for on
    shard 0 alone, so a tick whose job was on another shard fired the next tick beside it."""
    t = TaskRunner("ovs", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "ovs")
    queue.create(t, "many", shards=4)
    schedules.add(t, "sharded", "shop.slow", every="10s", overlap="skip", queue="many")
    d = Dispatcher(t)
    later = next(b for b in range(1_800_000_000, 1_800_001_000, 10)
                 if shards.of_key(f"i:cron.sharded.{b}", 4) != 0)  # a tick placed beyond shard 0
    d.fire_schedules(later - 9)  # first sight: nothing
    assert d.fire_schedules(later + 1) == 1
    assert [q for q in queue.shards_of(t, "many") if t.redis.exists(t.keys.job(q, f"cron.sharded.{later}"))] \
        == [shards.name("many", shards.of_key(f"i:cron.sharded.{later}", 4))]
    assert d.fire_schedules(later + 11) == 0  # its job is still pending: skipped
    state = json.loads(t.redis.hget(t.keys.schedules, "sharded"))
    assert state["skipped"] == 1 and state["last_job"] == f"cron.sharded.{later}"
    t.redis.hset(t.keys.job(state["last_queue"], state["last_job"]), "state", "completed")  # as if it ended
    assert d.fire_schedules(later + 21) == 1


def test_a_tick_its_queue_refuses_is_logged_once_and_fires_once_the_queue_takes_jobs(app, caplog):
    """A closed (or full) queue refuses the tick's job at every pass until it takes jobs
    again: the dispatcher tries at each pass, but says so once, not twice a second."""
    t = TaskRunner("cls", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "cls")
    queue.create(t, "shut")
    queue.close(t, "shut")
    schedules.add(t, "into", "shop.poll", every="10s", queue="shut")
    d = Dispatcher(t)
    base = 1_800_000_000.0
    d.fire_schedules(base + 1)  # first sight: nothing
    with caplog.at_level(logging.INFO, logger="taskrunner.dispatcher"):
        for at in (11, 11.5, 12, 12.5, 15):  # passes, the tick base+10 refused at each
            assert d.fire_schedules(base + at) == 0
        refused = [r for r in caplog.records if "did not fire" in r.getMessage()]
        assert len(refused) == 1 and "queue shut is closed" in refused[0].getMessage(), caplog.text
        queue.open(t, "shut")
        assert d.fire_schedules(base + 16) == 1 and ticks_of(t, "shut") == [int(base + 10)]
        queue.close(t, "shut")
        assert d.fire_schedules(base + 21) == 0 and d.fire_schedules(base + 22) == 0  # refused again: said again
        assert len([r for r in caplog.records if "did not fire" in r.getMessage()]) == 2


def test_the_cron_help_puts_the_seconds_field_where_croniter_reads_it(stack):
    """The help said "6 with seconds first": "30 * * * * *", meant as every minute at :30,
    is minute 30 of each hour at every second there (60 jobs an hour), as croniter reads a
    sixth field as the seconds, last."""
    said = " ".join(stack.cli("schedule", "add", "--help", check=True).stdout.split())
    assert "seconds first" not in said and '"* * * * * 30": every minute at :30' in said, said
    latest, nxt = schedules.ticks(Schedule(name="s", cron="* * * * * 30", task="t"), 1_800_000_000.0)
    assert nxt - latest == 60 and datetime.fromtimestamp(nxt, timezone.utc).second == 30


@pytest.mark.parametrize("args, error", [
    (["--cron", "not a cron"], "invalid cron expression"),
    (["--cron", "0 3 * * *", "--tz", "Mars/Olympus"], "unknown time zone"),
    (["--cron", "0 3 * * *", "--every", "5s"], "either a cron expression or an interval"),
    ([], "give a schedule a cron expression or an interval (every): it has neither"),  # said "not both"
    (["--every", "0s"], "whole number of seconds >= 1"),
    (["--every", "1.5s"], "whole number of seconds >= 1"),
    (["--every", "5s", "--tz", "UTC"], "time zone applies to cron"),
    (["--every", "5s", "--args", "{}"], "must be a JSON array"),
    (["--every", "5s", "--expires", "0"], "expires must be a finite number of seconds > 0"),
    (["--every", "5s", "--expires", "nan"], "expires must be a finite number of seconds > 0"),
    (["--every", "5s", "--jitter", "5", "--expires", "5"], "expires (5.0 s) must be more than the jitter (5.0 s)"),
])
def test_bad_schedules_are_refused_in_one_line(app, stack, args, error):
    r = stack.cli("schedule", "add", "bad", "tests.apps.add", *args)
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error")]
    assert r.returncode == 2 and len(errors) == 1 and error in errors[0] and "Traceback" not in r.stderr, r.stderr
    assert app.redis.hlen(app.keys.g + "schedules:defs") == 0


def test_a_runtime_schedule_fires_into_its_tasks_queue_unless_told(app, stack):
    """`schedule add` without -q filed every schedule under queue default, whatever its
    task's queue: the ticks of a task of queue high, whose workers serve high alone, were
    never run (enqueue, run-now and a code schedule go by the task's queue). Like enqueue,
    it takes the queue from -A, else from the workers' declarations, and warns of a task no
    worker declared."""
    r = stack.cli("schedule", "add", "a", "tests.apps.high", "--every", "60s", "--args", '["k"]', "-A", "tests.apps")
    assert r.returncode == 0 and "on queue high" in r.stdout, r.stdout + r.stderr
    declarations.publish(app, ["default"], "w1", 0.0)  # what a worker of tests.apps publishes
    r = stack.cli("schedule", "add", "b", "tests.apps.high", "--every", "60s", "--args", '["k"]')
    assert r.returncode == 0 and "on queue high" in r.stdout and not r.stderr, r.stdout + r.stderr
    r = stack.cli("schedule", "add", "c", "tests.apps.high", "--every", "60s", "--args", '["k"]', "-q", "other")
    assert r.returncode == 0 and "on queue other" in r.stdout, r.stdout + r.stderr
    r = stack.cli("schedule", "add", "d", "tests.apps.nobody", "--every", "60s")
    assert r.returncode == 0 and "on queue default" in r.stdout and "no worker has declared task" in r.stderr
    listed = json.loads(stack.cli("schedule", "list", "--json", check=True).stdout)
    assert {s["name"]: s["queue"] for s in listed} == {"a": "high", "b": "high", "c": "other", "d": "default"}
    assert app.job(stack.cli("schedule", "run-now", "b", check=True).stdout.strip()).queue == "high"


def test_unknown_and_code_schedules(app, stack):
    r = stack.cli("schedule", "pause", "nope")
    assert r.returncode == 1 and "no schedule 'nope'" in r.stderr
    r = stack.cli("schedule", "delete", "tests.cron_app.every_second", "-A", "tests.cron_app")
    assert r.returncode == 1 and "pause it" in r.stderr  # refused: README, *Exit codes*
    # A runtime schedule of a code schedule's name replaces it; deleting it brings the code's back.
    from tests import cron_app

    cron_app.app.configure(redis_url=stack.url, prefix=app.settings.prefix)
    schedules.add(cron_app.app, "tests.cron_app.every_second", "tests.cron_app.every_second", every="60s")
    [s] = [s for s in schedules.effective(cron_app.app)[0] if s.name == "tests.cron_app.every_second"]
    assert s.every == 60 and s.source == "runtime"
    assert "applies again" in schedules.delete(cron_app.app, "tests.cron_app.every_second")
    [s] = schedules.effective(cron_app.app)[0]
    assert s.cron == "* * * * * *" and s.source == "code"
    # Published by a dispatcher, a code schedule is paused and resumed by name without -A
    # (`schedule list` shows it); running it needs its task, from -A.
    Dispatcher(cron_app.app).publish_schedules()
    stack.cli("schedule", "pause", "tests.cron_app.every_second", check=True)
    assert app.redis.sismember(app.keys.g + "schedules:paused", "tests.cron_app.every_second")
    stack.cli("schedule", "resume", "tests.cron_app.every_second", check=True)
    assert not app.redis.sismember(app.keys.g + "schedules:paused", "tests.cron_app.every_second")
    r = stack.cli("schedule", "run-now", "tests.cron_app.every_second")
    assert r.returncode == 1 and "with -A" in r.stderr
    # Deleting it without -A, while the dispatcher that declares it lives, says what it is
    # and how to stop it (it said "no runtime schedule").
    r = stack.cli("schedule", "delete", "tests.cron_app.every_second")
    name = json.loads(app.redis.hget(app.keys.dispatchers, next(iter(app.redis.hkeys(app.keys.dispatchers)))))["name"]
    assert r.returncode == 1 and r.stderr.strip().endswith(
        f"tests.cron_app.every_second is declared in the code of dispatcher {name} (alive), which fires it and "
        "would publish it again: pause it (`taskrunner schedule pause tests.cron_app.every_second`), or remove it "
        "from that code and restart it (then it goes by itself)"), r.stderr
    assert app.redis.hexists(app.keys.schedules, "tests.cron_app.every_second")
    # A runtime schedule of its name, deleted without -A, brings the code's back as with -A,
    # its pause kept (without -A the pause and the published entry went, as for a runtime
    # schedule of its own, and the dispatcher that declares it fired it, unpaused).
    stack.cli("schedule", "add", "tests.cron_app.every_second", "tests.cron_app.every_second", "--every", "60s",
              "-A", "tests.cron_app", check=True)
    stack.cli("schedule", "pause", "tests.cron_app.every_second", check=True)
    r = stack.cli("schedule", "delete", "tests.cron_app.every_second", check=True)
    assert "applies again" in r.stdout, r.stdout
    assert app.redis.sismember(app.keys.g + "schedules:paused", "tests.cron_app.every_second")
    assert app.redis.hexists(app.keys.schedules, "tests.cron_app.every_second")
    # What a dispatcher's pass wrote back for a runtime schedule deleted meanwhile (its state,
    # source runtime, no definition) is deleted, not taken for a code schedule (found by review).
    app.redis.hset(app.keys.schedules, "left-over", json.dumps({"name": "left-over", "source": "runtime"}))
    r = stack.cli("schedule", "delete", "left-over")
    assert r.returncode == 0 and r.stdout.strip() == "schedule left-over: deleted", r.stderr
    assert not app.redis.hexists(app.keys.schedules, "left-over")


def test_a_schedule_removed_from_the_code_goes_once_no_dispatcher_declares_it(app, stack):
    """Dispatchers published their code's schedules and never took one back: removed from
    the code it stayed listed for good (fired by none running the new code), and `schedule
    delete` refused it. A dispatcher now drops a published schedule no listed dispatcher
    declares (and no runtime definition names), so that during a rolling deploy the new
    code's dispatchers leave it to the old one's until it stops (they never take turns
    dropping and publishing it); `schedule delete` deletes one no live dispatcher declares."""
    prefix = app.settings.prefix + "rm"

    def code(version: str, *names: str) -> TaskRunner:
        t = TaskRunner(version, redis_url=app.settings.redis_url, prefix=prefix)
        t.task(lambda: None, name="shop.job")
        for n in names:
            t.periodic("0 3 * * *", name=n)(t.tasks["shop.job"])
        return t

    v1, v2 = code("v1", "kept", "gone"), code("v2", "kept")
    cli = Stack(v1, stack.url).cli
    old, new = Dispatcher(v1, "old"), Dispatcher(v2, "new")
    old.publish_schedules()
    new.publish_schedules()
    for _ in range(3):  # both run, the old code's still declaring "gone"
        old.run_once()
        new.next_forget = 0.0  # each pass drops what it may: none is
        new.run_once()
    assert sorted(v2.redis.hkeys(v2.keys.schedules)) == ["gone", "kept"]
    assert [s.name for s in schedules.effective(v2)[0]] == ["kept"]  # the new code never fires it
    cli("schedule", "pause", "gone", check=True)
    r = cli("schedule", "delete", "gone")
    assert r.returncode == 1 and "declared in the code of dispatcher old (alive)" in r.stderr, r.stderr
    assert [row["deletable"] for row in schedules.rows(v2)] == [False, False]  # gone, kept: declared
    v2.redis.hdel(v2.keys.dispatchers, "old")  # the old one stops (its run() takes its entry off)
    new.next_forget = 0.0
    new.run_once()
    # Dropped, it keeps its pause (it was dropped with it): the old code back (a rollback, or
    # the old dispatcher restarting mid-deploy) publishes it again, paused, not firing it.
    assert v2.redis.hkeys(v2.keys.schedules) == ["kept"] and v2.redis.smembers(prefix_paused(v2)) == {"gone"}
    assert "gone" not in cli("schedule", "list", check=True).stdout
    # A listed dispatcher that does not say what it declares (an older taskrunner) may
    # declare any: nothing is dropped while it is listed; `delete` refuses while it lives.
    old.publish_schedules()
    assert "gone" in schedules.effective(v1)[1]
    now = server_time(v2.redis)
    v2.redis.hset(v2.keys.dispatchers, "old", json.dumps({"name": "old", "last_pass": now}))
    new.drop_undeclared()
    assert sorted(v2.redis.hkeys(v2.keys.schedules)) == ["gone", "kept"]
    assert "may be declared in the code of dispatcher old (alive; an older" in cli("schedule", "delete", "gone").stderr
    # Its dispatcher gone (no pass for a minute; listed until forgotten, and so still kept by
    # the dispatchers), it is deleted by hand, with a word of what it was.
    v2.redis.hset(v2.keys.dispatchers, "old", json.dumps({"name": "old", "last_pass": now - 120}))
    new.drop_undeclared()
    assert sorted(v2.redis.hkeys(v2.keys.schedules)) == ["gone", "kept"]
    # The dashboard offers its Delete (it offered one for runtime schedules only), not kept's.
    web = create_app(v2, password="pw", token="tok").test_client()
    login(web)
    page = web.get("/schedules").get_data(as_text=True)
    assert 'action="/schedules/gone/delete"' in page and 'action="/schedules/kept/delete"' not in page
    r = cli("schedule", "delete", "gone")
    assert (r.returncode, r.stdout) == (0, "schedule gone: deleted (removed from the code: no live dispatcher "
                                           "declares it)\n"), r.stderr
    assert v2.redis.hkeys(v2.keys.schedules) == ["kept"]
    assert cli("schedule", "delete", "kept").returncode == 1  # declared by "new", alive


def test_a_dispatcher_name_a_live_dispatcher_holds_is_refused(app, stack):
    """Two dispatchers of one name (-n, e.g. a deploy's old and new code) wrote one entry in
    turn, each listing its own code's schedules, so that each dropped the other's and
    published its own again, pause and all, at every pass: a name a live dispatcher holds is
    refused, as a worker's is; one silent for dead_after (its process crashed) is taken over."""
    Dispatcher(app, "disp").publish_schedules()  # this process's entry, as its passes write it
    entry = json.loads(app.redis.hget(app.keys.dispatchers, "disp"))
    entry["pid"] += 1  # another process's
    app.redis.hset(app.keys.dispatchers, "disp", json.dumps(entry))
    with pytest.raises(NameInUse, match="in use by a live dispatcher"):
        Dispatcher(app, "disp").publish_schedules()
    # The CLI's says so in one line, exit 2 (a dead_after of a minute here: the tests' 1.5 s
    # could pass while a loaded machine starts the process).
    import subprocess
    import sys

    entry["last_pass"] = server_time(app.redis)
    app.redis.hset(app.keys.dispatchers, "disp", json.dumps(entry))
    r = subprocess.run([sys.executable, "-m", "taskrunner", "dispatcher", "-A", "tests.apps", "-n", "disp"],
                       env={**stack.env, "TASKRUNNER_DEAD_AFTER": "60"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "in use by a live dispatcher" in r.stderr and "Traceback" not in r.stderr, r
    entry["last_pass"] -= app.settings.dead_after + 1  # its process died a little while ago
    app.redis.hset(app.keys.dispatchers, "disp", json.dumps(entry))
    Dispatcher(app, "disp").publish_schedules()
    assert json.loads(app.redis.hget(app.keys.dispatchers, "disp"))["pid"] == entry["pid"] - 1


def prefix_paused(t: TaskRunner) -> str:
    return t.keys.g + "schedules:paused"


def test_dashboard_schedule_actions(app):
    schedules.add(app, "web", "tests.apps.add", every="3600s", args=[2, 3])
    web = create_app(app, password="pw", token="tok").test_client()
    page = web.get("/schedules").get_data(as_text=True)
    assert "every 3600 s" in page and "added at runtime" in page and 'data-action="pause"' not in page
    token = login(web)
    assert 'data-action="pause"' in web.get("/schedules").get_data(as_text=True)
    assert web.post("/schedules/web/pause", data={}).status_code == 403  # no CSRF token
    r = web.post("/schedules/web/pause", data={"csrf_token": token})
    assert r.status_code == 302 and schedules.effective(app)[1] == {"web"}
    assert 'data-action="resume"' in web.get("/schedules").get_data(as_text=True)
    web.post("/schedules/web/resume", data={"csrf_token": csrf(web, "/schedules")})
    assert schedules.effective(app)[1] == set()
    api = create_app(app, password="pw", token="tok").test_client()
    assert api.post("/api/schedules/web/run-now").status_code == 401
    r = api.post("/api/schedules/web/run-now", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and app.redis.hget(app.keys.job("default", r.get_json()["job"]), "args") == "[2,3]"
    assert api.post("/api/schedules/nope/pause", headers={"Authorization": "Bearer tok"}).status_code == 404
    r = api.post("/api/schedules/web/delete", headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and schedules.rows(app) == []


def test_a_schedules_expires_makes_a_tick_no_worker_started_in_time_end_expired_unrun(app, stack):
    """Celery beat's options={"expires": S}: each job a real dispatcher fires for the
    schedule expires S seconds after it was enqueued (Redis's clock); with no worker serving
    its queue until past that, the worker then started never runs it, it ends killed,
    Expired. `schedule list` (and --json) show the option."""
    r = stack.cli("schedule", "add", "late", "tests.apps.record", "--every", "1s", "--args", '["late"]',
                  "--expires", "1.5")
    assert r.returncode == 0 and "its jobs expire 1.5 s after firing" in r.stdout, r.stdout + r.stderr
    [row] = json.loads(stack.cli("schedule", "list", "--json", check=True).stdout)
    assert (row["name"], row["expires"]) == ("late", 1.5)
    [line] = [x for x in stack.cli("schedule", "list", check=True).stdout.splitlines() if x.startswith("late")]
    assert " 1.5 s " in line, line
    dispatcher = stack.dispatcher()
    p = app.keys.q("default")
    wait_for(lambda: app.redis.llen(p + "pending") >= 1, timeout=30, what="a tick's job")
    dispatcher.terminate()  # a clean stop: no tick fires once it has exited
    dispatcher.wait(30)
    fired = app.redis.lrange(p + "pending", 0, -1)
    assert fired and all(i.startswith("cron.late.") for i in fired), fired
    expiries = []
    for job_id in fired:
        rec = app.redis.hgetall(app.keys.job("default", job_id))
        assert float(rec["expires"]) == pytest.approx(float(rec["enqueued_at"]) + 1.5, abs=1e-3), rec
        expiries.append(float(rec["expires"]))
    wait_for(lambda: server_time(app.redis) >= max(expiries), what="the ticks' jobs' expiry on Redis's clock")
    stack.worker()
    for job_id in fired:
        wait_for(lambda j=job_id: app.redis.hget(app.keys.job("default", j), "state") == "killed", timeout=30,
                 what=f"{job_id} ended")
        d = app.job(job_id, "default").to_dict()
        assert (d["state"], d["error_type"], d["attempts"]) == ("killed", "Expired", 0), d
    assert app.redis.get(f"{app.settings.prefix}:ledger:late") is None  # never ran


def test_periodic_takes_expires_checked_at_declaration_and_run_now_and_list_and_the_dashboard_show_it(app):
    """`@app.periodic(..., expires=S)`: checked when declared (> 0, more than the jitter);
    a tick's job and run-now's have it; the state a dispatcher publishes has it, so that
    `schedule list` without -A and the dashboard's Schedules page show it."""
    t = TaskRunner("pex", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "pex")

    @t.periodic("*/5 * * * *", name="tidy", expires=60)
    @t.task(name="pex.tidy")
    def tidy() -> None:
        """A schedule's task."""

    assert t.schedules["tidy"].expires == 60
    for bad, error in [(0, "> 0"), (-1, "> 0"), (float("nan"), "> 0"), ("60", "> 0"), (30, "more than the jitter")]:
        with pytest.raises(ValueError, match=error):
            t.periodic("*/5 * * * *", name="bad", jitter=30, expires=bad)
    d = Dispatcher(t)
    base = 1_800_000_000.0  # a multiple of 300: a tick
    d.fire_schedules(base - 1)  # first sight: nothing
    assert d.fire_schedules(base + 1) == 1
    for job in (t.job(f"cron.tidy.{int(base)}", "default"), schedules.run_now(t, "tidy")):
        rec = t.redis.hgetall(t.keys.job("default", job.id))
        assert float(rec["expires"]) == pytest.approx(float(rec["enqueued_at"]) + 60, abs=1e-3), rec
    bare = TaskRunner("pex", redis_url=app.settings.redis_url, prefix=app.settings.prefix + "pex")  # no -A
    assert [(r["name"], r["expires"]) for r in schedules.rows(bare)] == [("tidy", 60)]
    page = create_app(bare, password="pw", token="tok").test_client().get("/schedules").get_data(as_text=True)
    assert "expires 60 s after firing" in page
