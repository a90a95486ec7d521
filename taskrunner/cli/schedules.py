"""`taskrunner schedule`: the schedules kept in Redis, added and changed at runtime."""

from __future__ import annotations

import click

from taskrunner.cli.base import (
    Finite,
    app_from,
    column_width,
    common,
    emit_json,
    json_arg,
    main,
    timestamp,
    undeclared_tasks,
    warn_undeclared,
)


@main.group()
def schedule() -> None:
    """Schedules kept in Redis: add, list, pause, resume, run now, delete. The app's own
    (`@app.periodic`) are the defaults; one added with the same name replaces it until deleted.
    Dispatchers pick changes up at their next pass.

    \b
    taskrunner schedule add nightly --cron "0 3 * * *" --tz Europe/Berlin shop.report --args '[7]'
    taskrunner schedule add poll --every 30s shop.poll --overlap skip --jitter 5 --expires 25
    taskrunner schedule list
    taskrunner schedule pause nightly; taskrunner schedule resume nightly
    taskrunner schedule run-now nightly; taskrunner schedule delete nightly"""


@schedule.command("add")
@click.argument("name")
@click.argument("task")
@click.option("--cron", help="Cron expression, in UTC unless --tz: 5 fields (minute hour day month weekday), "
              "or 6 with the seconds last, as croniter reads them (\"* * * * * 30\": every minute at :30).")
@click.option("--every", help="An interval instead of a cron: 30s, 5m, 2h, 1d (whole seconds >= 1).")
@click.option("--tz", help="IANA time zone of the cron, e.g. Europe/Berlin. A time in an hour skipped by a "
              "daylight-saving change fires once, shifted by the gap; one in a repeated hour fires once.")
@click.option("--args", "args_json", metavar="JSON", help="JSON array of arguments.")
@click.option("--kwargs", "kwargs_json", metavar="JSON", help="JSON object of keyword arguments.")
@click.option("-q", "--queue", "queue_name", help="Queue of its jobs (default: the task's, from -A APP, else as its "
              "workers declared it, else 'default').")
@click.option("--jitter", type=Finite(0, 86400, max_open=True), default=0.0, show_default=True,
              help="Delay each tick's job by up to this many seconds (spreads load; the same on every dispatcher).")
@click.option("--overlap", type=click.Choice(["allow", "skip"]), default="allow", show_default=True,
              help="skip: no tick while the previous tick's job is pending, delayed or running.")
@click.option("--missed", type=click.Choice(["once", "skip"]), default="once", show_default=True,
              help="After a time without dispatchers: once fires the latest missed tick, skip none.")
@click.option("--expires", type=float, metavar="S", help="Each tick's job expires S seconds (> 0, more than --jitter) "
              "after it is fired: one no worker started by then never runs, it ends killed (Expired) rather than "
              "late (Celery beat's options={\"expires\": S}).")
@common
def schedule_add(name: str, task: str, cron: str | None, every: str | None, tz: str | None, args_json: str | None,
                 kwargs_json: str | None, queue_name: str | None, jitter: float, overlap: str, missed: str,
                 expires: float | None, app_spec: str | None, redis_url: str | None) -> None:
    """Add schedule NAME, enqueueing TASK at each tick (or replace the one of that name).
    With -A, a task APP does not declare is an error (exit 2); without, a name no worker
    declared is added with a warning on stderr, as `enqueue` does."""
    from taskrunner.ops import schedules

    app = app_from(app_spec, redis_url)
    undeclared = undeclared_tasks(app, app_spec, [task])
    s = schedules.add(app, name, task, cron=cron, every=every, tz=tz,
                      args=json_arg(args_json, list, "--args"), kwargs=json_arg(kwargs_json, dict, "--kwargs"),
                      queue=queue_name, jitter=jitter, overlap=overlap, missed=missed, expires=expires)
    when = f"every {s.every} s" if s.every else f"cron {s.cron!r} ({s.tz or 'UTC'})"
    expiry = f", its jobs expire {s.expires:g} s after firing" if s.expires else ""
    click.echo(f"schedule {name}: {task} on queue {s.queue}, {when}{expiry}")
    if undeclared:
        warn_undeclared(task, [s.queue], "its jobs go to")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Every schedule as JSON (a list): cron or every, time zone, "
              "source, expires, last and next tick, paused.")
@common
def schedule_list(as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Every schedule: the app's (with -A), those added at runtime, those dispatchers fire;
    when each last fired and fires next."""
    from taskrunner.ops import schedules

    rows = schedules.rows(app_from(app_spec, redis_url))
    if as_json:
        return emit_json(rows)
    width = column_width(4, [r["name"] for r in rows])
    click.echo(f"{'NAME':{width}} {'WHEN':28} {'TASK':28} {'QUEUE':12} {'STATE':7} {'EXPIRES':9} {'NEXT':24} "
               "LAST FIRED")
    for r in rows:
        when = f"every {r['every']} s" if r.get("every") else f"{r.get('cron', '?')} {r.get('tz') or 'UTC'}"
        expires = f"{r['expires']:g} s" if isinstance(r.get("expires"), (int, float)) else "-"
        click.echo(f"{r['name']:{width}} {when[:28]:28} {str(r.get('task', '?'))[:28]:28} "
                   f"{str(r.get('queue', '?'))[:12]:12} {'paused' if r['paused'] else 'active':7} {expires[:9]:9} "
                   f"{timestamp(r.get('next')):24} {timestamp(r.get('last_fired_at'))}")


def _schedule_action(how: str, doc: str) -> None:
    """`schedule pause|resume|run-now|delete NAME`."""

    @schedule.command(how, help=doc)
    @click.argument("name")
    @common
    def action(name: str, app_spec: str | None, redis_url: str | None) -> None:
        from taskrunner.ops import schedules

        app = app_from(app_spec, redis_url)
        if how == "pause":
            schedules.pause(app, name)
            click.echo(f"schedule {name}: paused (`taskrunner schedule resume {name}` undoes it)")
        elif how == "resume":
            schedules.pause(app, name, False)
            click.echo(f"schedule {name}: resumed; it fires from its next tick")
        elif how == "run-now":
            click.echo(schedules.run_now(app, name).id)
        else:
            click.echo(f"schedule {schedules.delete(app, name)}")


_schedule_action("pause", "Stop firing schedule NAME (its ticks pass unfired) until resumed.")


_schedule_action("resume", "Fire schedule NAME again, from its next tick (missed ones are not fired).")


_schedule_action("run-now", "Enqueue schedule NAME's job once, now (paused or not); prints the job id.")


_schedule_action("delete", "Delete a schedule added at runtime (the app's own of that name applies again), or "
                 "one removed from the code that a dispatcher published and no live dispatcher declares any more "
                 "(dispatchers also drop those within a minute once none declares them). One that code declares: "
                 "exit 1 (pause it).")
