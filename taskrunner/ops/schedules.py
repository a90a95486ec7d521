"""Schedules: their ticks, and the ones kept in Redis that operators add, pause, resume, run
now and delete at runtime (`taskrunner schedule ...`, the dashboard's Schedules page).

Code-declared schedules (`@app.periodic`) are the defaults; a runtime schedule with the same
name replaces one while it exists (deleting it brings the code's back). The dispatcher reads
the runtime ones at each pass (one HGETALL), so a change takes effect within a pass.

A dispatcher publishes its code's schedules (`g schedules`, for `schedule list` without -A)
and lists their names in its entry (`g dispatchers`). A schedule removed from the code is
fired by no dispatcher that runs the new code, and its published entry goes once no
dispatcher declares it: a dispatcher drops (once a minute) each published schedule that has
no runtime definition and that no listed dispatcher declares, and `schedule delete` deletes
one that no live dispatcher declares. During a rolling deploy a dispatcher still running the
old code is listed with it, so the new ones leave it alone until it stops (a clean stop
takes its entry off at once; a killed one is forgotten after DISPATCHER_FORGET): the two
versions never take turns deleting and publishing it. A listed dispatcher whose entry names
no schedules (a taskrunner before the list) may declare any: nothing is dropped meanwhile.

Ticks, each fired at most once however many dispatchers run (its job id names the tick):
- cron, in UTC or in a time zone (`tz`, IANA name). A cron matches wall-clock times; around
  daylight-saving changes each wall time that matches fires once: a time in the hour that is
  skipped (spring forward, e.g. 02:30 in Europe/Berlin) fires once, shifted by the gap (at
  03:30), and a time in the hour that repeats (fall back) fires once, at its first occurrence.
- every N seconds (a whole number >= 1): ticks at the multiples of N since the Unix epoch,
  so that every dispatcher agrees on them.
Options: `jitter` S delays each tick's job by up to S seconds (the same for every dispatcher:
it derives from the tick); `overlap="skip"` skips a tick while the job of the previous tick
is still pending, delayed or running; `missed` ("once" or "skip") what happens to ticks missed
while no dispatcher ran (see Schedule); `expires` S: each tick's job expires S seconds after
the dispatcher fired it (Celery beat's options={"expires": S}): one that no worker claimed by
then (workers busy or down) never runs, it ends killed, Expired, rather than late. Counted
from the firing, a late one's too (after downtime, with missed="once"), jitter's delay within
it; `run-now`'s job has it as well."""

from __future__ import annotations

import re
import zlib
from dataclasses import asdict
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from croniter import croniter

from taskrunner.client import arguments
from taskrunner.client.app import Schedule, check_cron, check_schedule_options, cron_job_id
from taskrunner.errors import TaskRunnerError
from taskrunner.protocol import codec
from taskrunner.protocol.connection import server_time

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner
    from taskrunner.client.job import Job


class ScheduleNotFound(TaskRunnerError):
    """No schedule of that name (neither in code nor added at runtime)."""


class ScheduleInCode(TaskRunnerError):
    """A schedule that code declares (the app's, or a live dispatcher's), which cannot be
    deleted: a dispatcher that declares it publishes it again and fires it."""


def _defs_key(app: TaskRunner) -> str:
    return app.keys.g + "schedules:defs"


def _paused_key(app: TaskRunner) -> str:
    return app.keys.g + "schedules:paused"


_DURATION = re.compile(r"^(\d+)(s|m|h|d)?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_every(text: str) -> int:
    """'30s', '5m', '2h', '1d' or seconds: a whole number of seconds >= 1."""
    m = _DURATION.match(text.strip())
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"every must be a whole number of seconds >= 1, or with a unit (30s, 5m, 2h, 1d), "
                         f"not {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def ticks(s: Schedule, now: float) -> tuple[float, float]:
    """(the latest tick at or before `now`, the next one after it), as Unix times."""
    if s.every:
        latest = (now // s.every) * s.every
        return latest, latest + s.every
    if not s.tz:
        at = datetime.fromtimestamp(now, timezone.utc)
        return croniter(s.cron, at).get_prev(float), croniter(s.cron, at).get_next(float)
    zone = ZoneInfo(s.tz)
    # Walk the cron over naive wall-clock times, and map each to the first instant it names
    # (fold=0); a wall time that does not exist maps past the gap.
    wall = datetime.fromtimestamp(now, zone).replace(tzinfo=None)

    def instant(t: datetime) -> float:
        return t.replace(tzinfo=zone, fold=0).timestamp()

    back = croniter(s.cron, wall)
    latest = instant(back.get_prev(datetime))
    while latest > now:  # a skipped wall time maps after now: the one before
        latest = instant(back.get_prev(datetime))
    ahead = croniter(s.cron, wall)
    nxt = instant(ahead.get_next(datetime))
    while nxt <= now:  # in a repeated hour the wall clock is behind: its next may be past
        nxt = instant(ahead.get_next(datetime))
    return latest, nxt


def jitter_of(s: Schedule, tick: float) -> float:
    """The delay of a tick's job: up to s.jitter seconds, the same for every dispatcher."""
    if not s.jitter:
        return 0.0
    return (zlib.crc32(f"{s.name}.{int(tick)}".encode()) % 10_000) / 10_000 * s.jitter


def _from_json(name: str, raw: str) -> Schedule | None:
    """A runtime schedule's definition, or None when it is not one (a hand edit)."""
    try:
        d = codec.loads(raw)
        return Schedule(name=name, cron=d.get("cron") or "", task=d["task"], args=list(d.get("args", [])),
                        kwargs=dict(d.get("kwargs", {})), queue=d.get("queue", "default"),
                        missed=d.get("missed", "once"), every=d.get("every"), tz=d.get("tz"),
                        jitter=float(d.get("jitter", 0)), overlap=d.get("overlap", "allow"), expires=d.get("expires"),
                        source="runtime")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def effective(app: TaskRunner) -> tuple[list[Schedule], set[str]]:
    """Every schedule the dispatcher fires (the code's, replaced by runtime ones of the same
    name), and the names paused."""
    pipe = app.redis.pipeline(transaction=False)
    pipe.hgetall(_defs_key(app)).smembers(_paused_key(app))
    defs, paused = pipe.execute()
    out = dict(app.schedules)
    for name, raw in defs.items():
        s = _from_json(name, raw)
        if s is not None:
            out[name] = s
    return list(out.values()), set(paused)


def add(app: TaskRunner, name: str, task: str, *, cron: str | None = None, every: str | int | None = None,
        tz: str | None = None, args: list | None = None, kwargs: dict | None = None, queue: str | None = None,
        jitter: float = 0.0, overlap: str = "allow", missed: str = "once", expires: float | None = None) -> Schedule:
    """Add (or replace) a runtime schedule; checked here, so the dispatcher never meets a bad one.
    `queue` None: the task's, as an enqueue without one takes it (declared here, else by its
    workers, else "default"), looked up now: the schedule keeps it."""
    codec.check_name("schedule", name)
    codec.check_name("task", task)
    queue = codec.check_name("queue", queue) if queue is not None else app._job_spec(task, {})[0].queue
    codec.check_id(cron_job_id(name, 2**40))
    if cron is None and every is None:
        raise ValueError("give a schedule a cron expression or an interval (every): it has neither")
    if cron is not None and every is not None:
        raise ValueError("give a schedule either a cron expression or an interval (every), not both")
    if every is not None and tz is not None:
        raise ValueError("a time zone applies to cron schedules, not to intervals")
    seconds = parse_every(str(every)) if every is not None else None
    if cron is not None:
        check_cron(cron)
    check_schedule_options(tz, missed, overlap, jitter, expires)
    if not isinstance(args or [], list) or not isinstance(kwargs or {}, dict):
        raise ValueError("args must be a JSON array and kwargs a JSON object")
    arguments.check(task, app._shape_of(task, look_up=True), list(args or []), dict(kwargs or {}), False)
    s = Schedule(name=name, cron=cron or "", task=task, args=list(args or []), kwargs=dict(kwargs or {}),
                 queue=queue, missed=missed, every=seconds, tz=tz, jitter=jitter, overlap=overlap, expires=expires,
                 source="runtime")
    definition = {k: v for k, v in asdict(s).items() if k not in ("name", "source") and v not in (None, "")}
    app.redis.hset(_defs_key(app), name, codec.dumps(definition))
    return s


def _must_exist(app: TaskRunner, name: str) -> Schedule:
    found = {s.name: s for s in effective(app)[0]}
    if name not in found:
        raise ScheduleNotFound(f"no schedule {name!r} known here (see `taskrunner schedule list`; a code-declared "
                               "one is run or shown whole with -A, the app's module)")
    return found[name]


def delete(app: TaskRunner, name: str) -> str:
    """Delete a runtime schedule, or what a dispatcher published of one that no live
    dispatcher declares any more (removed from the code); answers what happened. One that
    code declares cannot be deleted (ScheduleInCode: pause it, or remove it from the code)."""
    if app.redis.hdel(_defs_key(app), name):
        if name in app.schedules or declarers(app, alive=False)[0].get(name):  # its code's, from -A or a dispatcher
            return f"{name}: deleted; the app's own schedule of that name applies again"
        forget(app, [name])
        return f"{name}: deleted"
    if name in app.schedules:
        raise ScheduleInCode(f"{name} is declared in the app's code and cannot be deleted here: pause it "
                             f"(`taskrunner schedule pause {name}`), or remove it from the code")
    # Without -A the app declares nothing; a name the dispatchers published that has no
    # runtime definition is one of their code's, or was. One a dispatcher wrote back for a
    # runtime schedule deleted during its pass (its `source`) is what is left of it.
    published = app.redis.hget(app.keys.schedules, name)
    if published is None:
        raise ScheduleNotFound(f"no runtime schedule {name!r} (see `taskrunner schedule list`)")
    if _source(published) == "runtime":
        forget(app, [name])
        return f"{name}: deleted"
    declared, silent = declarers(app, alive=True)
    if declared.get(name) or silent:
        who = (f"is declared in the code of dispatcher {', '.join(sorted(declared[name]))} (alive), which fires it"
               if declared.get(name) else f"may be declared in the code of dispatcher {', '.join(sorted(silent))} "
               "(alive; an older taskrunner, which does not list what it declares), which would fire it")
        raise ScheduleInCode(f"{name} {who} and would publish it again: pause it (`taskrunner schedule pause "
                             f"{name}`), or remove it from that code and restart it (then it goes by itself)")
    forget(app, [name], unpause=False)
    return f"{name}: deleted (removed from the code: no live dispatcher declares it)"


def declarers(app: TaskRunner, alive: bool) -> tuple[dict[str, list[str]], list[str]]:
    """({schedule name: the dispatchers whose code declares it}, the dispatchers that do not
    say: a taskrunner before their entries listed it, which may declare any), read from
    the dispatchers' entries: every one listed, or with `alive` those not gone (a pass in
    the last DISPATCHER_GONE seconds)."""
    from taskrunner.ops.listing import dispatchers

    declared: dict[str, list[str]] = {}
    silent = []
    for d in dispatchers(app, server_time(app.redis)):
        if alive and d["health"] == "gone":
            continue
        names = d.get("schedules")
        if not isinstance(names, list):
            silent.append(str(d.get("name")))
            continue
        for n in names:
            declared.setdefault(str(n), []).append(str(d.get("name")))
    return declared, silent


def undeclared(app: TaskRunner) -> list[str]:
    """The published schedules nothing fires any more, for a dispatcher to drop: no runtime
    definition, declared neither by this app's code nor by any listed dispatcher's (none
    while a listed dispatcher does not say what it declares). See the module's docstring.
    Read in the order they are written, so that nothing just published is taken for stale:
    the published names first, then the definitions (add() writes one before any dispatcher
    publishes it), then the declarations (a dispatcher lists its own before it publishes)."""
    pipe = app.redis.pipeline(transaction=False)
    pipe.hkeys(app.keys.schedules).hkeys(_defs_key(app))
    published, defined = pipe.execute()
    declared, silent = declarers(app, alive=False)
    if silent:
        return []
    keep = {*declared, *defined, *app.schedules}
    return sorted(n for n in published if n not in keep)


def forget(app: TaskRunner, names: list[str], unpause: bool = True) -> None:
    """A schedule gone: its published state and, with `unpause` (a runtime schedule
    deleted), its pause. A code schedule dropped keeps its pause: the code that declares it
    may come back (a rollback, an old dispatcher restarting during a deploy) and publish it
    again, which must not fire what an operator paused. A pause of a name that is not there
    does nothing (pause() needs the name)."""
    pipe = app.redis.pipeline(transaction=False)
    if unpause:
        pipe.srem(_paused_key(app), *names)
    pipe.hdel(app.keys.schedules, *names)
    pipe.execute()


def _source(published: str) -> Any:
    """The `source` of a schedule's published state (None: not a JSON object)."""
    try:
        state = codec.loads(published)
    except ValueError:
        return None
    return state.get("source") if isinstance(state, dict) else None


def pause(app: TaskRunner, name: str, paused: bool = True) -> None:
    """Pause (or resume) a schedule by name: one of the app's or a runtime one, or a code
    schedule a dispatcher published (`schedule list` shows it without -A; the dispatchers
    read the paused set by name, so no definition is needed here)."""
    if not app.redis.hexists(app.keys.schedules, name):
        _must_exist(app, name)
    if paused:
        app.redis.sadd(_paused_key(app), name)
    else:
        app.redis.srem(_paused_key(app), name)


def run_now(app: TaskRunner, name: str) -> Job:
    """Enqueue the schedule's job once, now (outside its ticks, paused or not), as a tick
    fires it: with its expiry."""
    s = _must_exist(app, name)
    return app.enqueue(s.task, s.args, s.kwargs, queue=s.queue, expires=s.expires)


def rows(app: TaskRunner) -> list[dict[str, Any]]:
    """Every schedule known here (the app's, runtime ones, and those dispatchers published),
    with its definition, state (last and next tick, last fired), whether it is paused, and
    whether delete() takes it (`deletable`: added at runtime, or published by dispatchers
    from code that no live one declares any more)."""
    pipe = app.redis.pipeline(transaction=False)
    pipe.hgetall(app.keys.schedules)
    states = pipe.execute()[0]
    found, paused = effective(app)
    rows: dict[str, dict[str, Any]] = {}
    for name, raw in states.items():
        try:
            state = codec.loads(raw)
        except ValueError:
            state = {}
        rows[name] = {**(state if isinstance(state, dict) else {}), "name": name}
    for s in found:
        rows[s.name] = {**rows.get(s.name, {}), **asdict(s)}
    declared, silent = declarers(app, alive=True)
    for row in rows.values():
        row["paused"] = row["name"] in paused
        row["deletable"] = row.get("source") == "runtime" or not (
            row["name"] in app.schedules or declared.get(row["name"]) or silent)
    return [rows[n] for n in sorted(rows)]
