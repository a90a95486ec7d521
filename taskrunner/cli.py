"""The `taskrunner` command. Every command takes --redis-url (default $REDIS_URL, else
the socket of a running `taskrunner up`, else localhost:6379) and -A/--app (default
$TASKRUNNER_APP): a module holding one TaskRunner, or module:attribute."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import click
import redis
from click.core import ParameterSource

from taskrunner import logs
from taskrunner.client import steps
from taskrunner.client.app import TaskRunner
from taskrunner.client.canvas import Signature
from taskrunner.client.loader import load_app
from taskrunner.config import Settings
from taskrunner.errors import (
    AppNotFound,
    BadURL,
    JobFailed,
    Misconfigured,
    NameInUse,
    TaskRunnerError,
    Timeout,
    Unreachable,
    require_extra,
)
from taskrunner.ops import listing
from taskrunner.ops.diagnose import explain
from taskrunner.protocol import codec
from taskrunner.protocol import shards as sharding
from taskrunner.protocol.connection import server_time

APP_HELP = "Module with your TaskRunner (module or module:attr). Env: TASKRUNNER_APP."
URL_HELP = ("redis://host:port/db, rediss://..., unix:///path, redis+sentinel://host[:port][,host...]/service[/db], "
            "redis+cluster://host[:port][,host...]. Env: REDIS_URL.")


class Finite(click.FloatRange):
    """click's FloatRange, less NaN and the infinities: it takes them (NaN compares false
    with either bound), and `wait --timeout nan` waited forever, `--max-memory-per-child nan`
    never replaced a child."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def _or_before(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """-A and --redis-url may come before the command too (`taskrunner --redis-url U
    jobs`): given after it they win, else the value given before it, else the environment's."""
    if ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE:
        return value
    before = ctx.find_root().params.get(param.name or "")
    return before if before is not None else value


def common(f: Callable) -> Callable:
    f = click.option("-A", "--app", "app_spec", envvar="TASKRUNNER_APP", metavar="APP", callback=_or_before,
                     help=APP_HELP)(f)
    f = click.option("--redis-url", envvar="REDIS_URL", metavar="URL", callback=_or_before, help=URL_HELP)(f)
    return f


def _app(app_spec: str | None, redis_url: str | None, check: bool = False) -> TaskRunner:
    """The app; with `check`, for processes that run until stopped, Redis is tried once
    first: a mistake in its configuration stops them here (exit 2), an outage they wait out."""
    app = load_app(app_spec, redis_url)
    click.get_current_context().meta["taskrunner.url"] = app.settings.redis_url
    if check:
        try:
            app.redis.ping()
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            problem = explain(e, app.settings.redis_url)
            if problem is None or problem.lasting:
                raise
            logging.getLogger("taskrunner").warning("%s; waiting for it", problem.message)  # in its --log-format
    return app


def _json_arg(value: str | None, kind: type, what: str) -> Any:
    if value is None:
        return kind()
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError) as e:
        raise click.BadParameter(f"not valid JSON ({e}): {value[:80]!r}", param_hint=what) from None
    if not isinstance(parsed, kind):
        raise click.BadParameter(f"must be a JSON {'array' if kind is list else 'object'}", param_hint=what)
    return parsed


def _ts(t: Any) -> str:
    if not t:
        return "-"
    try:
        return datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return str(t)  # a corrupt record, shown as it is


def _width(least: int, values: list[str]) -> int:
    """A table column as wide as its widest value: ids (a cron tick's, one given with --id)
    and queue names may be longer than the usual, and must not push the next columns."""
    return max([least, *map(len, values)])


def _emit(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def _known(app: TaskRunner, *queues: str) -> None:
    """Commands that read or change a named queue refuse a name no queue has: a typo
    must not look like an empty queue ("0 pending jobs deleted")."""
    from taskrunner.ops import queue

    for name in queues:
        queue.must_exist(app, name)


@contextlib.contextmanager
def _progress(length: int, label: str) -> Iterator[Callable[[int], Any] | None]:
    """A progress bar on stderr for a person at a terminal; elsewhere (a pipe, a log) none:
    click wrote its label alone there, a line before whatever came next (an error's)."""
    if not sys.stderr.isatty():
        yield None
        return
    with click.progressbar(length=length, label=label, file=sys.stderr) as bar:
        yield bar.update


def _confirm(question: str, yes: bool) -> None:
    """Ask before deleting. Where nobody can answer (stdin is not a terminal: a pipe, a
    script, cron) only --yes goes on: `echo n | taskrunner purge` must not delete."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise click.UsageError(f"{question} Not asked, as stdin is not a terminal: add --yes to go on")
    click.confirm(question, abort=True)


#: The exit codes every command keeps to (README, CLI: *Exit codes*): a script tells a
#: refusal from a mistake in its own command line from a Redis it could not reach.
EXIT_REFUSED = 1  # ran, and the answer is no: no such job, a state that refuses the action, a job that failed
EXIT_USAGE = 2  # a mistake in what the command was given (click's usage errors too); nothing done
EXIT_UNREACHABLE = 3  # Redis could not be reached: what was done is unknown, try again
#: `wait --timeout` ran out, `consume` found no job: 2, as documented before the scheme (scripts test it).
EXIT_NOT_YET = EXIT_USAGE


class Main(click.Group):
    """Turns taskrunner and Redis errors into one clear line: exit 2 for a mistake in what
    the command was given (a value taskrunner refuses: an invalid name, a negative delay,
    arguments that are not JSON or too large; a bad URL, wrong database, TLS or Sentinel
    mismatch, refused password, an app that cannot be imported), 3 for a Redis that could
    not be reached (down, restarting, failing over), 1 for the rest (no such job or queue,
    a full or closed queue, an error Redis answered with, ...)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # Ctrl-C: 130, as a shell says it (click's Abort exited 1, a refusal)
            click.echo("interrupted", err=True)
            raise click.exceptions.Exit(130) from None
        except UnicodeError as e:  # a ValueError, but from what Redis holds (bytes that are not UTF-8)
            raise click.ClickException(str(e)) from None
        except (BadURL, AppNotFound, NameInUse, ValueError, TypeError) as e:
            raise Misconfigured(str(e)) from None
        except TaskRunnerError as e:
            raise click.ClickException(str(e)) from None
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            problem = explain(e, ctx.meta.get("taskrunner.url"))
            if problem is None:
                raise click.ClickException(f"Redis answered with an error: {e}") from None
            raise (Misconfigured if problem.lasting else Unreachable)(problem.message) from None


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="taskrunner")
@click.option("-A", "--app", "app_spec", metavar="APP", help=APP_HELP + " Also after the command.")
@click.option("--redis-url", metavar="URL", help=URL_HELP + " Also after the command.")
def main(app_spec: str | None, redis_url: str | None) -> None:
    """taskrunner: reliable jobs on Redis, run in child processes, watched by a dispatcher.

    \b
    Run the whole stack locally with a demo:   taskrunner up --demo
    Run a worker for your app:                  taskrunner worker -A myapp -c 4
    Enqueue and wait from the shell:            id=$(taskrunner enqueue myapp.add --args '[1,2]')
                                                taskrunner wait $id

    Exit codes: 0 done; 1 refused or failed (no such job, a state that refuses the action,
    `wait`: the job failed); 2 a mistake in the arguments, the Redis URL or the app (and
    `wait --timeout` ran out, `consume` found no job); 3 Redis unreachable: try again; 130
    interrupted (Ctrl-C).
    """


def _undeclared(app: TaskRunner, app_spec: str | None, tasks: list[str]) -> list[str]:
    """With -A, a task the app does not declare is an error (exit 2): it could only fail
    later, NotRegistered. Without, the tasks' declarations come from the workers: returns
    the names none declared, which are enqueued all the same (producers may be deployed
    first), then warned about."""
    for task in tasks:
        codec.check_name("task", task)
        if app_spec and task not in app.tasks:
            click.echo(f"Error: task {task!r} is not declared by app {app_spec} (its tasks: "
                       f"{', '.join(sorted(app.tasks)) or 'none'})", err=True)
            sys.exit(EXIT_USAGE)
    return [] if app_spec else [t for t in dict.fromkeys(tasks)
                                if steps.ride(app, steps.declared(app, t), f"enqueueing {t}") is None]


def _warn_undeclared(task: str, queues: list[str], done: str = "enqueued into") -> None:
    click.echo(f"warning: no worker has declared task {task!r} (a typo, or none of its workers started yet): "
               f"{done} {', '.join(sorted(set(queues)))} with default settings", err=True)


@main.command()
@click.argument("task", required=False)
@click.option("--args", "args_json", metavar="JSON_ARRAY", help='Positional arguments, e.g. \'[1, "a"]\'.')
@click.option("--kwargs", "kwargs_json", metavar="JSON_OBJECT", help='Keyword arguments, e.g. \'{"n": 2}\'.')
@click.option("-q", "--queue", help="Queue (default: the task's, as its workers declared it, else 'default').")
@click.option("--delay", type=float, help="Seconds before it may run.")
@click.option("--max-duration", type=float, help="Seconds it may run before it is stopped.")
@click.option("--retries", type=int, help="Retries after failures (exponential backoff).")
@click.option("--id", "job_id", help="Job id (default: a new time-sortable id). An existing id is not enqueued twice.")
@click.option("--block-timeout", type=float, help="Into a full bounded queue: wait this long for room "
              "(0: fail at once; default 10), then fail with QueueFull.")
@click.option("--depends-on", "depends_on", multiple=True, metavar="ID",
              help="Run only once job ID completed (repeat for several; any queue); the job waits in state "
              "waiting, and ends canceled if ID does not complete.")
@click.option("--on-success", metavar="CALLBACK", help="A job to run once this one completed, given its result "
              'first in its args: a task name, or {"task": ..., "args": [...], "kwargs": {...}, "queue": ..., '
              '"immutable": true (not given the result)}.')
@click.option("--on-failure", metavar="CALLBACK", help="A job to run if this one does not complete (failed for "
              'good, killed, canceled), given {"id", "task", "state", "error_type", "error"} of it first in its '
              "args; as --on-success.")
@click.option("--priority", type=click.IntRange(0, 9), help="0-9: higher is claimed first within the queue.")
@click.option("--unique-key", help="While a job holding this key has not ended (or started, --unique-until start), "
              "enqueue nothing and print that job's id.")
@click.option("--unique-for", type=click.IntRange(min=1), help="Seconds the unique lock lasts at most; alone, the key "
              "is made from the task and its arguments.")
@click.option("--unique-until", type=click.Choice(["start", "finish"]),
              help="When the unique lock ends (default finish).")
@click.option("--from-file", "from_file", type=click.File("r"), metavar="JOBS.jsonl",
              help='Enqueue many: one JSON object a line, {"task": ..., "args": [...], "kwargs": {...}, '
              '"queue": ..., "delay": s, "max_duration": s, "id": ..., "depends_on": [ids of earlier lines or '
              'existing jobs], "on_success": CALLBACK, "on_failure": CALLBACK}; "-" reads stdin. One round trip '
              "per 1,000 jobs; prints one id a line.")
@common
def enqueue(task: str | None, args_json: str | None, kwargs_json: str | None, queue: str | None,
            delay: float | None, max_duration: float | None, retries: int | None, job_id: str | None,
            block_timeout: float | None, depends_on: tuple[str, ...], on_success: str | None, on_failure: str | None,
            priority: int | None, unique_key: str | None, unique_for: int | None, unique_until: str | None,
            from_file: Any, app_spec: str | None, redis_url: str | None) -> None:
    """Enqueue TASK by name; prints the job id alone.

    \b
    Settings not given here (queue, max duration, retries, backoff, timeout policy, max
    lost) are the task's: from -A APP, else as the workers that run it declared them in
    Redis. With -A, a task APP does not declare is an error (exit 2); without, a name no
    worker declared is enqueued with a warning on stderr (default settings, queue
    'default' unless -q). Arguments that do not fit the task's signature (from APP, else
    as its workers declared it) are an error (exit 2), as are a callback's, counting the
    value it is given first (unless immutable). While Redis is unreachable or failing
    over it tries again for TASKRUNNER_ENQUEUE_RETRY seconds (default 15; 0: not at all),
    then fails (exit 1); a job id is never enqueued twice.

    \b
    A workflow step:  a=$(taskrunner enqueue shop.fetch --args '["x"]')
                      taskrunner enqueue shop.resize --depends-on $a --on-failure shop.alert
    (`taskrunner workflow ID` shows the graph)."""
    app = _app(app_spec, redis_url)
    if from_file is not None:
        if task or depends_on or on_success or on_failure:
            raise click.UsageError("--from-file takes no TASK, --depends-on, --on-success, --on-failure: give "
                                   "them on each line")
        return _enqueue_file(app, app_spec, from_file)
    if not task:
        raise click.UsageError("give a TASK, or --from-file")
    args = _json_arg(args_json, list, "--args")
    kwargs = _json_arg(kwargs_json, dict, "--kwargs")
    success, failure = _callback(app, on_success, "--on-success"), _callback(app, on_failure, "--on-failure")
    queues = {c.task.name: c.options.get("queue") or "default" for c in (success, failure) if c is not None}
    undeclared = _undeclared(app, app_spec, [task, *queues])
    job = app.enqueue(task, args, kwargs, queue=queue, delay=delay, max_duration=max_duration,
                      retries=retries, job_id=job_id, block_timeout=block_timeout, depends_on=list(depends_on) or None,
                      on_success=success, on_failure=failure, priority=priority, unique_key=unique_key,
                      unique_for=unique_for, unique_until=unique_until)
    if not job.created:
        click.echo(f"job {job.id} exists already (or holds the unique key); not enqueued again", err=True)
    else:
        for name in undeclared:
            _warn_undeclared(name, [job.queue] if name == task else [queues[name]])
    click.echo(job.id)


def _callback(app: TaskRunner, value: str | None, what: str) -> Signature | None:
    """--on-success / --on-failure: a task name, or a JSON object (TaskRunner.callback_of)."""
    if value is None:
        return None
    if not value.lstrip().startswith("{"):
        return app.callback_of(value, what)
    return app.callback_of(_json_arg(value, dict, what), what)


def _enqueue_file(app: TaskRunner, app_spec: str | None, f: Any) -> None:
    specs = []
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            specs.append(json.loads(line))
        except (ValueError, RecursionError) as e:
            raise Misconfigured(f"line {n}: not valid JSON ({e})") from None
    tasks = [s["task"] for s in specs if isinstance(s, dict) and isinstance(s.get("task"), str)]
    undeclared = _undeclared(app, app_spec, tasks)
    with _progress(len(specs), "enqueueing") as progress:
        jobs = app.enqueue_many(specs, progress=progress)
    for task in undeclared:
        _warn_undeclared(task, [j.queue for j, t in zip(jobs, tasks) if t == task])
    if jobs:  # none: nothing, not an empty line (an empty id to a script reading them)
        click.echo("\n".join(j.id for j in jobs))


#: Parents (or children) `status` names; `workflow` (and --json) shows them all.
STATUS_LINKS = 5


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Every field as JSON.")
@common
def status(job_id: str, as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Show a job: state, attempts, where it ran, result or error."""
    job = _app(app_spec, redis_url).job(job_id)
    d = job.to_dict()
    if as_json:
        return _emit(d)
    state = d["state"] + ((" (stuck)" if d["state"] == "running" else " (ran past its max duration)") if d["stuck"]
                          else "")
    rows = [("id", d["id"]), ("task", d.get("task")), ("queue", d["queue"]), ("state", state),
            ("attempts", d["attempts"]), ("enqueued", _ts(d.get("enqueued_at"))),
            *([("due", _ts(d.get("due_at")))] if d["state"] == "delayed" else []),
            ("started", _ts(d.get("started_at"))), ("finished", _ts(d.get("finished_at"))),
            ("worker", d.get("worker") or "-"), ("host", d.get("host") or "-"), ("pid", d.get("pid") or "-")]
    if isinstance(d.get("progress"), float):
        rows.append(("progress", f"{d['progress']:.0%}  {d.get('progress_note') or ''}".rstrip()))
    if d.get("result") is not None:
        rows.append(("result", json.dumps(d["result"])))
    if d.get("error_type"):
        rows.append(("error", f"{d['error_type']}: {d.get('error')}"))
    for k in ("parents", "children"):  # a chord's callback has a parent per member: the first few
        if d[k]:
            more = f"  (+{len(d[k]) - STATUS_LINKS}: taskrunner workflow {job_id})" if len(d[k]) > STATUS_LINKS else ""
            rows.append((k, "  ".join(f"{j['id']} ({j['queue']})" for j in d[k][:STATUS_LINKS]) + more))
    for k, v in rows:
        click.echo(f"{k:>9}  {v}")
    if d["logs"]:
        dropped = f", {d['logs_dropped']} older dropped" if d.get("logs_dropped") else ""
        click.echo(f"      log  (last {len(d['logs'])} lines{dropped})")
        for line in d["logs"]:
            click.echo(f"           {_ts(line['t'])}  #{line['attempt']}  {line['line']}")
    if d.get("traceback") and d["state"] == "failed":
        click.echo(d["traceback"].rstrip())


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="The graph as JSON: every job with its parents and children.")
@common
def workflow(job_id: str, as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """The workflow JOB_ID belongs to (chain, group, chord, depends_on, callbacks): every job
    linked to it, in layers (a job's parents come before it), with its state."""
    from taskrunner.ops.workflow import graph

    g = graph(_app(app_spec, redis_url), job_id)
    if as_json:
        return _emit(g)
    width = _width(26, [n["id"] for n in g["jobs"]])
    click.echo(f"{'STEP':>4}  {'ID':{width}} {'QUEUE':12} {'STATE':9} {'TASK':30} AFTER")
    for n in g["jobs"]:
        mark = "*" if n["id"] == g["root"] else " "
        after = ", ".join(p["id"] for p in n["parents"][:3]) + (f" (+{len(n['parents']) - 3})" if len(n["parents"]) > 3
                                                                  else "")
        click.echo(f"{n['depth']:>4}{mark} {n['id']:{width}} {n['queue'][:12]:12} {n['state']:9} "
                   f"{str(n['task'])[:30]:30} {after or '-'}")
    if g["truncated"]:
        click.echo(f"(the first {len(g['jobs'])} jobs only)")


@main.command()
@click.argument("job_id")
@click.option("--timeout", type=Finite(min=0), help="Give up after this many seconds (exit 2); default: as "
              "long as it takes.")
@common
def wait(job_id: str, timeout: float | None, app_spec: str | None, redis_url: str | None) -> None:
    """Wait for a job; print its result as JSON. Rides out a Redis restart or failover
    (it connects again and looks again).

    \b
    Exit 0 completed, 1 failed, killed or canceled (a workflow step whose parent did not
    complete), no such job, or a result that is not JSON, 2 still not ended after --timeout,
    3 Redis unreachable (at the start, or still at the end of --timeout): state unknown."""
    job = None
    try:
        job = _app(app_spec, redis_url).job(job_id)
        result = job.wait(timeout)
    except ValueError as e:  # a record another client wrote wrong: an error, not a mistake in the arguments
        if job is None or job.data.get("state") != "completed":
            raise
        click.echo(f"Error: job {job_id} completed, but its result is not JSON ({e})", err=True)
        sys.exit(1)
    except JobFailed as e:
        click.echo(f"{e.state}: {e.error_type}: {e.message}", err=True)
        sys.exit(EXIT_REFUSED)
    except Timeout as e:
        click.echo(str(e), err=True)
        sys.exit(EXIT_NOT_YET)
    except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
        problem = explain(e, click.get_current_context().meta.get("taskrunner.url"))
        if problem is None or problem.lasting:  # an answer, or a mistake in the URL: as every command says it
            raise
        click.echo(f"Error: cannot reach Redis, the job's state is unknown: {e}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    click.echo(json.dumps(result))


@main.command()
@click.argument("job_id")
@common
def kill(job_id: str, app_spec: str | None, redis_url: str | None) -> None:
    """Kill a job: pending/delayed/waiting at once; running ones are stopped by their worker.

    \b
    Exit 0 killed or kill requested, 1 refused: the job had already ended (killed,
    completed, failed or canceled; nothing done), or no such job, 3 Redis unreachable."""
    job = _app(app_spec, redis_url).job(job_id)
    state = job.kill()
    if state.startswith("already "):
        click.echo(f"job {job_id} already ended: {state.removeprefix('already ')}", err=True)
        sys.exit(EXIT_REFUSED)
    click.echo(f"{job_id}: {'killed' if state == 'killed' else 'kill requested; its worker stops it now'}")


@main.command()
@click.argument("job_id")
@common
def retry(job_id: str, app_spec: str | None, redis_url: str | None) -> None:
    """Run a failed or killed job again (a dead letter, kept TASKRUNNER_FAILED_TTL): it goes
    to the back of its queue with its counts of failures and Retry requests back to 0. A
    workflow step brings back the steps its end canceled: they wait for it again, and the
    rest of the chain or chord runs once it completes. Exit 1 when the job is in another
    state (refused, as `kill` of a job that ended)."""
    job = _app(app_spec, redis_url).job(job_id)
    if not job.retry():
        click.echo(f"{job_id}: {job.why_not_retried()}", err=True)
        sys.exit(EXIT_REFUSED)
    waits = job.refresh().state == "waiting"  # killed while it waited: it waits for its parents again
    click.echo(f"{job_id}: {'waiting for its parents again' if waits else 'queued again'}")


@main.command()
@click.option("-q", "--queue", help="Only this queue.")
@click.option("--state", type=click.Choice(listing.LIST_STATES), help="Only jobs in this state.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="At most this many jobs of each state and queue listed.")
@click.option("--offset", type=click.IntRange(min=0), default=0, show_default=True,
              help="Skip this many of each first (the next page: --offset 50).")
@click.option("--json", "as_json", is_flag=True, help="Every job's fields as JSON (a list), as `status --json`.")
@common
def jobs(queue: str | None, state: str | None, limit: int, offset: int, as_json: bool, app_spec: str | None,
         redis_url: str | None) -> None:
    """List jobs (by default: a page of each state in each queue)."""
    app = _app(app_spec, redis_url)
    if queue:
        _known(app, queue)
    found = listing.list_jobs(app, queue, state, limit, offset)
    if as_json:
        return _emit([j.to_dict() for j in found])
    iw, qw = _width(26, [j.id for j in found]), _width(12, [j.queue for j in found])
    click.echo(f"{'ID':{iw}}  {'QUEUE':{qw}} {'STATE':10} {'TASK':30} {'TRIES':>5}  WHERE")
    for j in found:
        d = j.data
        st = d.get("state", "?") + ("*" if d.get("stuck") == "1" else "")
        where = f"{d.get('worker', '')} pid {d.get('pid')}" if d.get("state") == "running" else d.get("error_type", "")
        click.echo(f"{j.id:{iw}}  {j.queue:{qw}} {st:10} {d.get('task', '?')[:30]:30} {d.get('attempts', 0):>5}  "
                   f"{where}")
    if any(j.data.get("stuck") == "1" for j in found):
        click.echo("* stuck: ran past its max duration (`taskrunner status ID` says more; "
                   "`jobs --state stuck` lists them)")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Every queue's counts and settings as JSON (a list), with "
              "`duplicates` per task.")
@click.option("--shards", "by_shard", is_flag=True, help="A sharded queue's shards each on a line of its own "
              "(NAME~i; shard 0 is NAME), not their totals; on a Redis Cluster, with the primary that serves each.")
@common
def queues(as_json: bool, by_shard: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Every queue (topic) with its counts, counters and settings; a sharded queue once,
    with its shards' totals (--shards: each shard, and on a Redis Cluster the primary that
    serves it). Finished counts cover the result TTL; produced/consumed count messages since
    the queue was created."""
    from taskrunner.ops.queue import primaries_of

    app = _app(app_spec, redis_url)
    stats = listing.queue_stats(app, shards=by_shard)
    placed = primaries_of(app, [s["name"] for s in stats]) if by_shard else None  # None off a cluster
    for s, primary in zip(stats, placed or ()):
        s["primary"] = primary
    if as_json:
        return _emit(stats)
    cols = ("waiting", "pending", "delayed", "running", "completed", "failed", "killed", "canceled",
            "produced_messages", "consumed_messages")
    click.echo(f"{'QUEUE':20}" + "".join(f"{c.split('_')[0].upper():>11}" for c in cols) + "  SETTINGS")
    for s in stats:
        flags = " ".join(f for f, on in ((_bound(s), s["bound"]), ("closed", s["closed"]),
                                         ("exclusive", s["exclusive"]), ("paused", s["paused"]),
                                         ("priorities=" + ",".join(map(str, s["priorities"])), s["priorities"]),
                                         (f"rate={s['rate']} used={s['rate_used']}", s["rate"]),
                                         (f"shards={s['shards']}", s["shards"] > 1),
                                         (f"primary={s.get('primary')}", "primary" in s)) if on)
        click.echo(f"{s['name']:20}" + "".join(f"{s[c]:>11}" for c in cols) + f"  {flags}")


def _bound(s: dict[str, Any]) -> str:
    """A queue's bound as `queues` shows it: of a sharded queue (its total row) also what each
    shard enforces, ⌈B/N⌉, and so the most it holds, N × ⌈B/N⌉ (10 over 3 shards: 12)."""
    each = s.get("bound_each")
    if not each or s["shards"] < 2:
        return f"bound={s['bound']}"
    return f"bound={s['bound']} ({each} per shard: at most {each * s['shards']})"


@main.command()
@common
def metrics(app_spec: str | None, redis_url: str | None) -> None:
    """Print the Prometheus metrics, read from Redis now: what the dashboard serves at
    GET /metrics (queue depths and ages, stuck jobs, workers and their slots, dispatchers'
    last pass). For a scrape without the dashboard, or a look by eye."""
    from taskrunner.ops.metrics import exposition

    click.echo(exposition(_app(app_spec, redis_url)).decode(), nl=False)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Every worker's record as JSON (a list), with its state "
              "and heartbeat age.")
@common
def workers(as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Workers: alive ones with their heartbeat, and those found dead in the last hour. BUSY:
    children running a job, of all; BEAT: since the last heartbeat; CPU %: of one core, the
    worker and its children together, since the heartbeat before."""
    ws = listing.workers(_app(app_spec, redis_url))
    if as_json:
        return _emit(ws)
    click.echo(f"{'NAME':28} {'STATE':6} {'HOST':16} {'IP':15} {'PID':>7} {'BUSY':>6} {'BEAT':>6} "
               f"{'RSS MB':>7} {'CPU %':>6}  QUEUES")
    for w in ws:
        beat = f"{w['heartbeat_age']:.1f}s" if w.get("heartbeat_age") is not None else "-"
        busy = "-" if w.get("busy") is None else f"{w['busy']}/{w.get('concurrency', '?')}"
        cpu = "-" if w.get("cpu") is None else f"{w['cpu']:.1f}"
        rss = "-" if w.get("rss") is None else f"{w['rss'] / 1e6:.1f}"  # a consumer (consume, Node) says none
        click.echo(f"{w['name'][:28]:28} {w['state']:6} {str(w.get('host', '-'))[:16]:16} {w.get('ip', '-'):15} "
                   f"{w.get('pid', '-'):>7} {busy:>6} {beat:>6} {rss:>7} {cpu:>6}  "
                   f"{','.join(w.get('queues', []))}")


LOG_LEVELS = click.Choice(["debug", "info", "warning", "error"], case_sensitive=False)


HEALTH_PORT = click.option(
    "--health-port", metavar="[HOST:]PORT", help="Serve GET /healthz (this process's loop went round lately: "
    "for liveness probes; never asks Redis) and GET /readyz (Redis answers and a dispatcher is alive: for "
    "readiness) on this port, 200 or 503 with the reason as JSON. Loopback unless a host is given, e.g. "
    "0.0.0.0:8080 for a pod's probes.")


def _serve_health(spec: str | None, app: TaskRunner, looped_ago: Callable[[], float], limit: float,
                  what: str) -> None:
    """Start --health-port's server (a daemon thread) when asked."""
    if not spec:
        return
    from taskrunner.ops import health

    try:
        address = health.parse_address(spec)
        server = health.serve(address, {"/healthz": health.liveness(looped_ago, limit, what),
                                        "/readyz": lambda: health.readiness(app)})
    except (ValueError, OSError) as e:
        raise click.BadParameter(str(e), param_hint="--health-port") from None
    logging.getLogger("taskrunner").info("%s: health checks on http://%s:%d/healthz and /readyz", what,
                                         *server.server_address[:2])


def log_options(f: Callable) -> Callable:
    """--log-level and --log-format, for the commands that run until stopped."""
    f = click.option("--log-format", type=click.Choice(logs.FORMATS), default="text", show_default=True,
                     envvar="TASKRUNNER_LOG_FORMAT", help=logs.FORMAT_HELP)(f)
    return click.option("--log-level", type=LOG_LEVELS, default="info", show_default=True,
                        help="The least severe records written.")(f)


@main.command()
@click.option("-Q", "--queues", "queue_list", help="Queues in priority order, comma-separated "
              "(default: 'default' then the queues of the app's tasks).")
@click.option("-c", "--concurrency", type=click.IntRange(min=1), default=os.cpu_count() or 2, show_default=True,
              help="Child processes running jobs.")
@click.option("-n", "--name", help="Worker name (default host.pid); must be unique among live workers.")
@click.option("--prefetch", type=click.IntRange(min=1), help="Most jobs sent ahead to one child, so that short "
              "jobs run back to back (default 128, TASKRUNNER_PREFETCH; adapts to ~100 ms of work; 1: off).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="Plain (sync) tasks "
              "each child runs at once, in threads: for I/O-bound jobs. A thread cannot be interrupted: killing "
              "one of its jobs (or its max duration) stops the whole child, after handing its other jobs back.")
@click.option("--async-slots", type=click.IntRange(min=0), default=100, show_default=True, help="async def tasks "
              "each child runs at once, as coroutines on its event loop (only if the app has async tasks); a kill "
              "or max duration cancels one coroutine, and its siblings go on.")
@click.option("--max-jobs-per-child", type=click.IntRange(min=1), help="Replace a child process by a fresh one "
              "after it ran this many jobs (recycling: for leaks; nothing is lost or counted). Default: never.")
@click.option("--max-memory-per-child", type=Finite(min=1), metavar="MB", help="Replace a child process "
              "once its resident memory (RSS, checked after its jobs) exceeds this many MB. Default: never.")
@log_options
@HEALTH_PORT
@common
def worker(queue_list: str | None, concurrency: int, name: str | None, prefetch: int | None, threads: int,
           async_slots: int, max_jobs_per_child: int | None, max_memory_per_child: float | None, log_level: str,
           log_format: str, health_port: str | None, app_spec: str | None, redis_url: str | None) -> None:
    """Run jobs: claim from the queues, run each in a child process, report back."""
    from taskrunner.worker.main import Worker

    logs.configure(log_level, log_format)
    if not app_spec:
        raise click.UsageError("the worker needs your app: -A module (or TASKRUNNER_APP)")
    app = _app(app_spec, redis_url, check=True)
    qs = [q.strip() for q in queue_list.split(",") if q.strip()] if queue_list else \
        list(dict.fromkeys(["default", *(t.spec.queue for t in app.tasks.values())]))
    app.wait_for_redis("worker")
    w = Worker(app, qs, concurrency, name, prefetch, max_jobs_per_child, max_memory_per_child, threads,
               async_slots)
    who = {"worker": w.name}
    logs.add_fields(lambda: who)  # what it and its children log names it
    _serve_health(health_port, app, lambda: time.monotonic() - w.stepped_at, app.settings.dead_after, "worker")
    sys.exit(w.run())


@main.command()
@click.option("-n", "--name", help="Dispatcher name (default host.pid); must be unique among live dispatchers.")
@log_options
@HEALTH_PORT
@common
def dispatcher(name: str | None, log_level: str, log_format: str, health_port: str | None, app_spec: str | None,
               redis_url: str | None) -> None:
    """Requeue jobs of dead workers, stop stuck jobs, promote delayed jobs, fire cron
    schedules (those of -A APP). Several may run at once."""
    from taskrunner.ops.dispatcher import Dispatcher

    logs.configure(log_level, log_format)
    app = _app(app_spec, redis_url, check=True)
    app.wait_for_redis("dispatcher")
    d = Dispatcher(app, name)
    # A pass may archive history for a while: a minute without a round is a hung loop.
    _serve_health(health_port, app, lambda: time.monotonic() - d.looped_at, max(60.0, app.settings.dead_after),
                  "dispatcher")
    sys.exit(d.run())


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to serve on; beyond loopback only with a password.")
@click.option("--port", type=click.IntRange(0, 65535), default=5000, show_default=True, envvar="PORT",
              help="0: any free port.")
@log_options
@common
def dashboard(host: str, port: int, log_level: str, log_format: str, app_spec: str | None,
              redis_url: str | None) -> None:
    """Serve the web dashboard (development server; the Procfile runs it under gunicorn).

    \b
    TASKRUNNER_DASHBOARD_PASSWORD  enables login, then Kill/Retry/... in the pages
    TASKRUNNER_DASHBOARD_TOKEN     enables POST /api/... with "Authorization: Bearer <token>"
    Neither set: read-only."""
    require_extra("dashboard", "the dashboard", "flask")
    from dashboard import create_app
    from dashboard.security import check_bind

    check_bind([host], os.environ.get("TASKRUNNER_DASHBOARD_PASSWORD"))
    logs.configure(log_level, log_format)  # the server's request lines too (werkzeug logs through the root)
    app = _app(app_spec, redis_url, check=True)
    create_app(app).run(host=host, port=port)


@main.command()
@click.option("--demo", is_flag=True, help="Use the demo app and enqueue a demo workload.")
@click.option("-c", "--concurrency", type=click.IntRange(min=1), default=2, show_default=True,
              help="Child processes of the worker it starts.")
@click.option("--port", type=click.IntRange(1, 65535), default=5000, show_default=True, help="Dashboard port.")
@click.option("--exit", "exit_after", is_flag=True, help="With --demo: stop when the demo workload is done.")
@click.option("--log-format", type=click.Choice(logs.FORMATS), default="text", show_default=True,
              envvar="TASKRUNNER_LOG_FORMAT", help="Of the dispatcher, the workers and the dashboard. "
              + logs.FORMAT_HELP + " What `up` itself says stays text, on stdout.")
@common
def up(demo: bool, concurrency: int, port: int, exit_after: bool, log_format: str, app_spec: str | None,
       redis_url: str | None) -> None:
    """Run everything locally: Redis (its own, under ./var, unless REDIS_URL is set), a
    dispatcher, a worker and the dashboard. Ctrl-C stops it all cleanly."""
    from taskrunner.ops.up import run_stack

    if not app_spec and not demo:
        raise click.UsageError("give your app with -A module, or try --demo")
    require_extra("dashboard", "up (it serves the dashboard)", "flask", "gunicorn")
    Settings.from_env()  # a bad setting: one line, exit 2, before Redis and the processes start (each would say it)
    sys.exit(run_stack(app_spec or "taskrunner.demo:app", redis_url, concurrency, port, demo, exit_after,
                       log_format))



@main.group()
def schedule() -> None:
    """Schedules kept in Redis: add, list, pause, resume, run now, delete. The app's own
    (`@app.periodic`) are the defaults; one added with the same name replaces it until deleted.
    Dispatchers pick changes up at their next pass.

    \b
    taskrunner schedule add nightly --cron "0 3 * * *" --tz Europe/Berlin shop.report --args '[7]'
    taskrunner schedule add poll --every 30s shop.poll --overlap skip --jitter 5
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
@common
def schedule_add(name: str, task: str, cron: str | None, every: str | None, tz: str | None, args_json: str | None,
                 kwargs_json: str | None, queue_name: str | None, jitter: float, overlap: str, missed: str,
                 app_spec: str | None, redis_url: str | None) -> None:
    """Add schedule NAME, enqueueing TASK at each tick (or replace the one of that name).
    With -A, a task APP does not declare is an error (exit 2); without, a name no worker
    declared is added with a warning on stderr, as `enqueue` does."""
    from taskrunner.ops import schedules

    app = _app(app_spec, redis_url)
    undeclared = _undeclared(app, app_spec, [task])
    s = schedules.add(app, name, task, cron=cron, every=every, tz=tz,
                      args=_json_arg(args_json, list, "--args"), kwargs=_json_arg(kwargs_json, dict, "--kwargs"),
                      queue=queue_name, jitter=jitter, overlap=overlap, missed=missed)
    when = f"every {s.every} s" if s.every else f"cron {s.cron!r} ({s.tz or 'UTC'})"
    click.echo(f"schedule {name}: {task} on queue {s.queue}, {when}")
    if undeclared:
        _warn_undeclared(task, [s.queue], "its jobs go to")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Every schedule as JSON (a list): cron or every, time zone, "
              "source, last and next tick, paused.")
@common
def schedule_list(as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Every schedule: the app's (with -A), those added at runtime, those dispatchers fire;
    when each last fired and fires next."""
    from taskrunner.ops import schedules

    rows = schedules.rows(_app(app_spec, redis_url))
    if as_json:
        return _emit(rows)
    width = _width(4, [r["name"] for r in rows])
    click.echo(f"{'NAME':{width}} {'WHEN':28} {'TASK':28} {'QUEUE':12} {'STATE':7} {'NEXT':24} LAST FIRED")
    for r in rows:
        when = f"every {r['every']} s" if r.get("every") else f"{r.get('cron', '?')} {r.get('tz') or 'UTC'}"
        click.echo(f"{r['name']:{width}} {when[:28]:28} {str(r.get('task', '?'))[:28]:28} "
                   f"{str(r.get('queue', '?'))[:12]:12} {'paused' if r['paused'] else 'active':7} "
                   f"{_ts(r.get('next')):24} {_ts(r.get('last_fired_at'))}")


def _schedule_action(how: str, doc: str) -> None:
    """`schedule pause|resume|run-now|delete NAME`."""

    @schedule.command(how, help=doc)
    @click.argument("name")
    @common
    def action(name: str, app_spec: str | None, redis_url: str | None) -> None:
        from taskrunner.ops import schedules

        app = _app(app_spec, redis_url)
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


@main.group()
def queue() -> None:
    """Create, close, open, pause, resume or delete a queue (bounded, exclusive, rate-limited); see also `queues`."""


@queue.command("create")
@click.argument("name")
@click.option("--bound", type=click.IntRange(min=0), help="Most pending jobs; producers then wait for room (0: no "
              "bound; not given: the queue's bound stays, none for a new queue).")
@click.option("--exclusive/--no-exclusive", default=None, help="At most one job of the queue runs at a time, in "
              "order (not given: as it is; a new queue is not exclusive).")
@click.option("--rate", callback=lambda _c, _p, v: v and _rate(v, none=False),
              help='Most job starts, across all workers: "50/s", "N/m" or "N/h" (not given: the '
              "queue's limit, if any, stays; `queue rate` changes or removes it).")
@click.option("--shards", type=click.IntRange(1, 64), help="Spread the queue over this many shards, each in its own "
              "hash slot (over a Redis Cluster's primaries); FIFO holds per shard. Bound and rate are split "
              "evenly over them. Changes only while the queue has no unfinished job (not given: as it is); "
              "fewer shards drop the removed shards' finished records (results, failures, history).")
@common
def queue_create(name: str, bound: int | None, exclusive: bool | None, rate: str | None, shards: int | None,
                 app_spec: str | None, redis_url: str | None) -> None:
    """Create queue NAME, or change its bound, exclusivity, rate limit and shards: a
    setting not given stays as it is. Prints the queue's settings after. On a Redis
    Cluster, a sharded queue's shards per primary, and a warning when they fall unevenly
    (CRC16 of each shard's name decides), naming the counts that would spread evenly."""
    from taskrunner.ops import queue as queues

    app = _app(app_spec, redis_url)
    now = queues.create(app, name, bound, exclusive, rate, shards)
    n, limit = now["shards"], now["rate"]
    click.echo(f"queue {name}: bound {now['bound'] or 'none'}{', exclusive' if now['exclusive'] else ''}"
               f"{f', rate {limit}' if limit else ''}{f', {n} shards' if n > 1 else ''}")
    place = queues.placement(app, name, n) if n > 1 else None
    if place is not None:
        click.echo(f"shards per primary: {', '.join(map(str, place.per_primary))} ({', '.join(place.primaries)})")
        if place.uneven:
            counts = ", ".join(map(str, place.even))
            # more shards rather than fewer, which drop the removed shards' finished records
            to = next((k for k in place.even if k >= n), place.even[0]) if place.even else 0
            drop = ("; fewer shards drop the removed shards' finished records and unarchived history"
                    if to < n else "")
            fix = (f"{counts} shards would spread this name evenly (taskrunner queue create {name} --shards "
                   f"{to}, while it has no unfinished job{drop})" if place.even else
                   f"no shard count up to {sharding.MAX} spreads this name evenly")
            click.echo(f"warning: the {n} shards of queue {name} fall unevenly on the {len(place.primaries)} "
                       f"primaries: {fix}", err=True)


def _rate(value: str, none: bool = True) -> str:
    """A rate limit (or "none", where `none`) checked as the arguments are read: a mistake
    in one exits 2 whether or not Redis can be reached."""
    try:
        return value if none and value == "none" else codec.rate("rate", value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@queue.command("rate")
@click.argument("name")
@click.argument("rate", callback=lambda _c, _p, v: _rate(v))
@common
def queue_rate(name: str, rate: str, app_spec: str | None, redis_url: str | None) -> None:
    """Limit how many jobs of queue NAME start, across all workers: RATE "50/s", "N/m" or
    "N/h" (evenly spaced), or "none" to remove the limit."""
    from taskrunner.ops import queue as queues

    queues.set_rate(_app(app_spec, redis_url), name, None if rate == "none" else rate)
    click.echo(f"queue {name}: {'no rate limit' if rate == 'none' else 'rate ' + rate}")


def _queue_switch(how: str, doc: str, said: str) -> None:
    """`queue close` and `queue open`, `queue pause` and `queue resume`: one setting of a
    queue, each way; with --json, the queue's settings after it (as `queue info --json`)."""
    from taskrunner.ops import queue as queues

    @queue.command(how, help=doc)
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True, help="Print the queue's settings after the change, as JSON.")
    @common
    def switch(name: str, as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
        app = _app(app_spec, redis_url)
        getattr(queues, how)(app, name)
        if as_json:
            return _emit({"name": name, **queues.info(app, name)})
        click.echo(f"queue {name}: {said.format(name=name)}")


_queue_switch("close", "Take no new jobs (enqueue fails with QueueClosed); queued jobs still run.",
              "closed (`taskrunner queue open {name}` undoes it)")
_queue_switch("open", "Take new jobs again after `queue close`.", "open")
_queue_switch("pause", "Workers claim nothing from the queue (and sleep on it); it still takes new jobs, and "
              "running ones go on.", "paused (`taskrunner queue resume {name}` undoes it)")
_queue_switch("resume", "Workers claim from the queue again after `queue pause`.", "resumed")


@queue.command("delete")
@click.argument("name")
@click.option("--force", is_flag=True, help="Even while jobs of it run (their results are then dropped).")
@click.option("--yes", is_flag=True, help="Do not ask (needed where nobody can answer: stdin not a terminal).")
@common
def queue_delete(name: str, force: bool, yes: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Remove every key of queue NAME: its jobs, records and counters. Asks first."""
    from taskrunner.ops import queue as queues

    app = _app(app_spec, redis_url)
    jobs = queues.deletable(app, name, force)
    _confirm(f"delete queue {name} and its {', '.join(f'{n} {s}' for s, n in jobs.items())} jobs?", yes)
    n = queues.delete(app, name, force)
    click.echo(f"queue {name}: deleted ({n} keys)")


@queue.command("info")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Its counts, counters and settings as JSON, as one entry of "
              "`queues --json`.")
@common
def queue_info(name: str, as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Whether queue NAME exists, its length, settings and counters (exit 1 if it does not
    exist); on a Redis Cluster, a sharded queue's shards per primary (as `queue create` says)."""
    from taskrunner.ops import queue as queues

    app = _app(app_spec, redis_url)
    _known(app, name)
    found = [s for s in listing.queue_stats(app) if s["name"] == name]
    if not found:
        raise click.ClickException(f"queue {name!r} was deleted meanwhile")
    place = queues.placement(app, name, found[0]["shards"]) if found[0]["shards"] > 1 else None
    if place is not None:  # on a cluster
        found[0]["placement"] = place.to_dict()
    if as_json:
        return _emit(found[0])
    for k, v in found[0].items():
        click.echo(f"{k:>18}  {json.dumps(v) if isinstance(v, (dict, list)) else v}")  # JSON, not Python's repr


@main.command()
@click.option("-q", "--queue", "queue_name", required=True, help="The queue to empty.")
@click.option("--yes", is_flag=True, help="Do not ask (needed where nobody can answer: stdin not a terminal).")
@common
def purge(queue_name: str, yes: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Delete every pending job of a queue (running, delayed and finished ones stay). Asks first."""
    app = _app(app_spec, redis_url)
    _known(app, queue_name)
    from taskrunner.ops.queue import backlog

    total = backlog(app, queue_name)
    _confirm(f"delete {total} pending jobs of {queue_name}?", yes)
    with _progress(total, "purging") as progress:
        n = app.purge(queue_name, progress=progress)
    click.echo(f"{n} pending jobs deleted from {queue_name}")


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("-q", "--queue", "queue_list", required=True, help="Queues in priority order, comma-separated.")
@click.option("--timeout", type=Finite(min=0), default=0, show_default=True,
              help="Wait this long for a job (exit 2 if none).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@log_options
@common
def consume(queue_list: str, timeout: float, command: tuple[str, ...], log_level: str, log_format: str,
            app_spec: str | None, redis_url: str | None) -> None:
    """Take one job from the shell. With `-- CMD ...`, CMD gets the job as JSON on stdin;
    exit 0 acks it (CMD's stdout, JSON if it parses, is the result), anything else fails
    it. Without CMD the job's JSON is printed and acked. Exit: CMD's code, 2 if no job."""
    import math
    import subprocess
    import threading
    import time

    from taskrunner.client.consumer import Consumer
    from taskrunner.protocol.outages import Backoff

    logs.configure(log_level, log_format)  # what it logs: waiting out a Redis outage
    app = _app(app_spec, redis_url)
    c = Consumer(app, [q.strip() for q in queue_list.split(",") if q.strip()])
    try:
        claimed = c.claim(1, block=timeout)
        delivery = claimed[0] if claimed else None
    except KeyboardInterrupt:
        c.close()
        raise
    if delivery is None:
        c.close()  # else listed among the workers, then as a dead one for an hour
        click.echo("no job", err=True)
        sys.exit(EXIT_NOT_YET)
    payload = json.dumps(delivery.to_dict())

    def report(call: Callable[[], Any], deadline: float | None = None) -> Any:
        """The outcome is only here: ride out a Redis outage (with backoff) to record it,
        rather than exit and let the job run again once its holder is found dead. Each try
        beats first, so that the dispatcher, if it answers, does not take us for dead (and run
        the job again) before the outcome lands. `deadline` (monotonic): give up then."""
        backoff = Backoff(f"consumer {c.name}: reporting job {delivery.id}", deadline)
        while True:
            try:
                if backoff.pause:
                    c.heartbeat(busy=1)
                answer = call()
                backoff.ok()
                return answer
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
                time.sleep(backoff.after(e))

    def leave() -> None:
        """Leave the list of workers; the outcome is recorded: an outage now is not worth a
        wait beyond a heartbeat's worth (the dispatcher then forgets us in its time)."""
        try:
            report(c.close, time.monotonic() + max(app.settings.heartbeat, 5.0))
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            click.echo(f"could not leave the list of workers ({e}); the dispatcher will drop this consumer", err=True)

    if not command:
        click.echo(payload)
        if not report(lambda: c.ack([delivery])[0]):
            click.echo(f"job {delivery.id} was requeued or killed meanwhile: it was not acked", err=True)
            leave()
            sys.exit(EXIT_REFUSED)
        return leave()
    try:
        proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    except OSError as e:
        click.echo(f"Error: cannot run {command[0]}: {e}", err=True)
        c.fail(delivery, "CommandFailed", f"{' '.join(command)}: {e}")
        c.close()
        sys.exit(127)
    done, stopped = threading.Event(), []

    def watch() -> None:
        """Keep the job ours while CMD runs (heartbeats, through a Redis outage too) and
        stop CMD as a worker stops a job: on a kill request, or at its max duration when
        its policy is kill (SIGTERM, SIGKILL after kill_grace)."""
        s = app.settings
        backoff = Backoff(f"consumer {c.name}", None)
        deadline = time.monotonic() + delivery.max_duration if delivery.timeout_policy == "kill" else math.inf
        beat_at, reason = 0.0, None
        while not done.is_set() and reason is None:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                break
            try:
                if now >= beat_at:
                    c.heartbeat(busy=1)
                    beat_at = now + s.heartbeat
                reason = c.kill_request(delivery, max(0.01, min(beat_at, deadline) - now))
                backoff.ok()
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
                done.wait(min(backoff.after(e), s.heartbeat))
        if reason is None or done.is_set():
            return
        stopped.append(reason)
        proc.terminate()
        try:
            proc.wait(s.kill_grace)
        except subprocess.TimeoutExpired:
            proc.kill()

    threading.Thread(target=watch, daemon=True).start()
    try:
        out, err = proc.communicate(payload)
    except KeyboardInterrupt:  # Ctrl-C reached CMD too: the job goes back, next in line
        proc.kill()
        proc.wait()
        c.close()
        click.echo(f"interrupted: job {delivery.id} is back in its queue", err=True)
        sys.exit(130)
    finally:
        done.set()
    sys.stdout.write(out)
    sys.stderr.write(err)
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode  # as a shell says it
    if stopped:
        why = {"killed": "killed on request", "timeout": f"past its max duration ({delivery.max_duration:g} s)"}
        click.echo(f"job {delivery.id} stopped: {why[stopped[0]]}", err=True)
        acked = report(lambda: c.stopped(delivery, stopped[0]))
    elif code == 0:
        try:  # strict JSON, as taskrunner sends: NaN or Infinity (which json.loads takes) make it text
            result = codec.loads(out) if out.strip() else None
        except ValueError:
            result = out
        acked = report(lambda: c.ack([delivery], [result])[0])
    else:
        acked = report(lambda: c.fail(delivery, "CommandFailed", f"{' '.join(command)} exited {code}", err[-4000:]))
    if not acked:
        click.echo(f"job {delivery.id} was requeued or killed meanwhile: this outcome was not recorded", err=True)
    leave()
    sys.exit(EXIT_REFUSED if code == 0 and not acked else code)  # 0 says the job was acked


@main.command()
@click.option("-q", "--queue", "queue_list", help="Queues, comma-separated (default: all).")
@common
def harvest(queue_list: str | None, app_spec: str | None, redis_url: str | None) -> None:
    """Return the running jobs of dead workers to their queues now."""
    from taskrunner.ops.dispatcher import Dispatcher
    from taskrunner.ops.queue import shards_of

    app = _app(app_spec, redis_url)
    if queue_list:
        named = [q for q in queue_list.split(",") if q]
        _known(app, *named)
        qs = [s for q in named for s in shards_of(app, q)]
    else:
        qs = app.queue_names()  # every physical queue, shards included
    stats = Dispatcher(app).harvest(qs)
    click.echo(" ".join(f"{k}={v}" for k, v in stats.items()))


class Age(click.ParamType):
    """A duration as `recover --older-than` takes it: seconds, or a number with a unit (90s,
    5m, 2h, 1d), finite and >= 0. Read before anything runs: a negative age (a cutoff in the
    future) would put back every running job, even one its live worker has just started."""

    name = "DURATION"
    UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        text = str(value)  # a number given as one (a default) is read, and checked, as its text
        try:
            n = float(text[:-1]) * self.UNITS[text[-1]] if text and text[-1] in self.UNITS else float(text)
            return codec.seconds("age", n)
        except ValueError:
            self.fail(f"{text!r}: expected seconds (a number >= 0), or e.g. 90s, 5m, 2h", param, ctx)


@main.command()
@click.option("-q", "--queue", "queue_name", required=True, help="The queue whose running jobs to look at.")
@click.option("--older-than", type=Age(), required=True,
              help="Put back jobs delivered longer ago than this (e.g. 60s, 5m).")
@click.option("--count", type=click.IntRange(min=1), default=1000, show_default=True, help="At most this many.")
@common
def recover(queue_name: str, older_than: float, count: int, app_spec: str | None, redis_url: str | None) -> None:
    """Put running jobs delivered too long ago back in line (whatever their workers do);
    their next delivery is counted. Prints the ids."""
    import socket

    from taskrunner.ops.queue import shards_of
    from taskrunner.protocol import scripts

    app = _app(app_spec, redis_url)
    _known(app, queue_name)
    ids = [i for shard in shards_of(app, queue_name)  # each shard of a sharded queue
           for i in scripts.RECOVER(app.redis, [app.keys.q(shard)],
                                    [older_than, count, f"{socket.gethostname()}:{os.getpid()}"])]
    click.echo("\n".join(ids) if ids else "nothing to recover")


@main.command()
@click.option("-q", "--queue", "queue_name", required=True, help="The queue to look into.")
@click.option("--running", is_flag=True, help="In-flight jobs instead of waiting ones.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="At most this many jobs.")
@click.option("--json", "as_json", is_flag=True, help="The jobs as JSON (a list).")
@common
def inspect(queue_name: str, running: bool, limit: int, as_json: bool, app_spec: str | None,
            redis_url: str | None) -> None:
    """Jobs with their delivery count, last delivery time and age."""
    app = _app(app_spec, redis_url)
    _known(app, queue_name)
    now = server_time(app.redis)
    if running:
        _, rows = listing.running(app, queue_name, 0, limit)
        out = [{"id": r["id"], "task": r["task"], "deliveries": r["attempt"], "last_delivery": r["started_at"],
                "age": round(now - r["started_at"], 3), "worker": r["worker"], "pid": r["pid"]} for r in rows]
    else:
        _, rows = listing.page_of(app, queue_name, "pending", 0, limit)
        out = [{"id": r["id"], "task": r["task"], "deliveries": r["attempts"] or 0,
                "last_delivery": r["started_at"], "age": round(now - (r["enqueued_at"] or now), 3)} for r in rows]
    if as_json:
        return _emit(out)
    iw = _width(26, [r["id"] for r in out])
    click.echo(f"{'ID':{iw}}  {'TASK':30} {'DELIVERIES':>10}  {'LAST DELIVERY':23}  {'AGE':>9}")
    for r in out:
        click.echo(f"{r['id']:{iw}}  {(r['task'] or '?')[:30]:30} {r['deliveries']:>10}  {_ts(r['last_delivery']):23}  "
                   f"{r['age']:>8.1f}s")


@main.group()
def history() -> None:
    """Job history: archive it to Parquet (the dispatcher does so every few seconds)."""


@history.command("archive")
@click.option("--history-dir", envvar="TASKRUNNER_HISTORY_DIR", help="Where (default ./var/history; any "
              "pyarrow filesystem URI, e.g. s3://bucket/path). Env: TASKRUNNER_HISTORY_DIR.")
@click.option("--batch", type=click.IntRange(min=1), default=10_000, show_default=True, help="Records per file.")
@common
def history_archive(history_dir: str | None, batch: int, app_spec: str | None, redis_url: str | None) -> None:
    """Move every history record now; safe to interrupt and run again (exactly once)."""
    from taskrunner.ops.history import Archiver, backlog

    app = _app(app_spec, redis_url)
    archiver = Archiver(app, history_dir, batch)
    waiting = sum(backlog(app).values())
    with _progress(waiting, "archiving") as progress:
        n = archiver.archive(progress=progress)
    click.echo(f"{n} records archived to {archiver.directory}")


@history.command("compact")
@click.option("--history-dir", envvar="TASKRUNNER_HISTORY_DIR", help="The archive (default ./var/history). "
              "Env: TASKRUNNER_HISTORY_DIR.")
@click.option("--date", "day", type=click.DateTime(["%Y-%m-%d"]), help="Only this day's partitions (YYYY-MM-DD; "
              "default: every day but today, UTC).")
@click.option("--target-mb", type=Finite(min=1), default=128, show_default=True,
              help="About how large each merged file is.")
@click.option("--json", "as_json", is_flag=True, help="What it did (partitions, files merged and written) as JSON.")
@common
def history_compact(history_dir: str | None, day: datetime | None, target_mb: float, as_json: bool,
                    app_spec: str | None, redis_url: str | None) -> None:
    """Merge each (date, queue) partition's small files into files of about --target-mb;
    safe to interrupt and run again (every record stays exactly once; readers never see a
    half state). The dispatcher does it once a day."""
    from taskrunner.ops.compact import Compactor

    c = Compactor(_app(app_spec, redis_url), history_dir, target_mb)
    stats = c.run([day.strftime("%Y-%m-%d")] if day else None)
    if as_json:
        return _emit(stats)
    click.echo(f"{stats['merged']} files merged into {stats['written']} in {stats['partitions']} partitions "
               f"of {c.directory}")


@history.command("status")
@click.option("--json", "as_json", is_flag=True, help="The records waiting, per queue, as JSON.")
@common
def history_status(as_json: bool, app_spec: str | None, redis_url: str | None) -> None:
    """Records waiting to be archived, per queue."""
    from taskrunner.ops.history import backlog as history_backlog

    backlog = history_backlog(_app(app_spec, redis_url))
    if as_json:
        return _emit(backlog)
    if not backlog:  # a blank output would read as a command that did nothing, or failed
        click.echo("no queues: no job history to archive")
    for q, n in backlog.items():
        click.echo(f"{q:20} {n:>10} waiting")


@main.group()
def failures() -> None:
    """The failure indexes the dashboard's Failed and Killed filters read (docs/PROTOCOL.md,
    Failure indexes)."""


@failures.command("reindex")
@click.option("-q", "--queue", "queue_name", help="Only this queue (a sharded one: each shard); default: every queue.")
@click.option("--batch", type=click.IntRange(1, 10_000), default=500, show_default=True,
              help="Jobs read and indexed per step (one ZSCAN and one script call).")
@click.option("--json", "as_json", is_flag=True, help="Print the counts per queue and state as JSON.")
@common
def failures_reindex(queue_name: str | None, batch: int, as_json: bool, app_spec: str | None,
                     redis_url: str | None) -> None:
    """Index the failed and killed jobs that ended before the indexes existed (an upgrade
    from a version without them): they then show in the filters. Safe beside live workers,
    to interrupt and to run again."""
    from taskrunner.ops import failures as failing

    app = _app(app_spec, redis_url)
    if queue_name is not None and queue_name not in app.queue_names():  # a queue, or one shard's name
        from taskrunner.ops.queue import must_exist

        must_exist(app, queue_name)  # no such queue, or not a name: says so

    def progress(q: str, state: str, seen: int, total: int, last: bool) -> None:
        if not as_json:
            click.echo(f"\r{q} {state}: {seen}/{total}", nl=last, err=True)

    out = failing.reindex(app, queue_name, batch, progress)
    if as_json:
        return _emit(out)
    indexed = sum(c["indexed"] for states in out.values() for c in states.values())
    skipped = sum(c["skipped"] for states in out.values() for c in states.values())
    click.echo(f"{indexed} jobs indexed, {skipped} no longer failed or killed left as they are; queues: "
               f"{', '.join(out) or 'none'}")


@main.command()
@click.option("--since", default="7d", show_default=True, help="Records finished within this (e.g. 7d, 12h).")
@click.option("--master", envvar="TASKRUNNER_SPARK_MASTER", help="Spark master (default local[2]; e.g. "
              "spark://host:7077). Env: TASKRUNNER_SPARK_MASTER.")
@click.option("--history-dir", envvar="TASKRUNNER_HISTORY_DIR", help="The archive (default ./var/history; "
              "s3://bucket/path is read as s3a://, which needs the hadoop-aws jars: README).")
@click.option("--conf", "conf", multiple=True, metavar="KEY=VALUE",
              help="A Spark setting, repeatable (e.g. --conf spark.driver.memory=4g); over TASKRUNNER_SPARK_CONF, "
                   "comma-separated KEY=VALUE pairs (e.g. spark.sql.shuffle.partitions=8,spark.driver.memory=2g), "
                   "over the defaults: spark.sql.shuffle.partitions=4, spark.driver.memory=1g, UI off, UTC "
                   "(and two of listing and aggregation: README).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@common
def analyze(since: str, master: str | None, history_dir: str | None, conf: tuple[str, ...], as_json: bool,
            app_spec: str | None, redis_url: str | None) -> None:
    """Statistics of the archived job history, with PySpark: per task, queue, worker host
    and hour (counts, outcome rates, runtime and wait percentiles, top errors). Writes them
    next to the archive and into Redis for the dashboard's History page."""
    require_extra("spark", "analyze (PySpark)", "pyspark", "pyarrow")
    from taskrunner.ops import analyze as analysis
    from taskrunner.ops.history import default_dir

    try:
        seconds = analysis.parse_since(since)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None
    settings = analysis.spark_conf(list(conf))  # a bad entry: ValueError, one line, exit 2
    app = _app(app_spec, redis_url)
    where = history_dir or default_dir()
    if "://" not in where and not os.path.isdir(where):  # a typo, or another directory than the dispatcher's
        raise TaskRunnerError(f"no job history at {os.path.abspath(where)}: the dispatcher archives finished jobs "
                              "into ./var/history of its directory (or TASKRUNNER_HISTORY_DIR) every 5 s; "
                              "`taskrunner history archive` does it now; or give --history-dir")
    summary = analysis.analyze(history_dir, seconds, master, conf=settings,
                               progress=lambda stage: click.echo(f"analyze: {stage}...", err=True))
    analysis.publish(app, summary)
    if as_json:
        return _emit(summary)
    click.echo(f"{summary['records']} records in the last {since}, analysed in {summary['seconds']} s")
    click.echo(f"{'TASK':40} {'COUNT':>8} {'OK %':>6} {'FAIL %':>7} {'P50 s':>8} {'P95 s':>8} {'P99 s':>8}")
    for t in summary["tasks"]:
        p = [f"{v:8.3f}" if v is not None else "       -" for v in (t["runtime_p50"], t["runtime_p95"],
                                                                    t["runtime_p99"])]
        click.echo(f"{str(t['task'])[:40]:40} {t['count']:>8} {100 * t['completed_rate']:>6.1f} "
                   f"{100 * t['failed_rate']:>7.1f} {' '.join(p)}")
