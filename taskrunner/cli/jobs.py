"""Commands on jobs: enqueue one or many, follow them (status, workflow, wait, jobs), kill and
retry them."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import redis

from taskrunner.cli.base import (
    EXIT_NOT_YET,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    Finite,
    app_from,
    column_width,
    common,
    emit_json,
    json_arg,
    known_queues,
    main,
    progress_bar,
    timestamp,
    undeclared_tasks,
    warn_undeclared,
)
from taskrunner.client.app import TaskRunner
from taskrunner.client.canvas import Signature
from taskrunner.errors import (
    JobFailed,
    Misconfigured,
    Timeout,
)
from taskrunner.ops import listing
from taskrunner.ops.diagnose import explain


@main.command()
@click.argument("task", required=False)
@click.option("--args", "args_json", metavar="JSON_ARRAY", help='Positional arguments, e.g. \'[1, "a"]\'.')
@click.option("--kwargs", "kwargs_json", metavar="JSON_OBJECT", help='Keyword arguments, e.g. \'{"n": 2}\'.')
@click.option("-q", "--queue", help="Queue (default: the task's, as its workers declared it, else 'default').")
@click.option("--delay", type=float, help="Seconds before it may run.")
@click.option("--expires", type=float, help="Seconds from now by which it must have started: a worker that claims it "
              "later does not run it, it ends killed (Expired).")
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
              '"queue": ..., "delay": s, "expires": s, "max_duration": s, "id": ..., "depends_on": [ids of earlier '
              'lines or existing jobs], "on_success": CALLBACK, "on_failure": CALLBACK}; "-" reads stdin. One round '
              "trip per 1,000 jobs; prints one id a line.")
@common
def enqueue(task: str | None, args_json: str | None, kwargs_json: str | None, queue: str | None,
            delay: float | None, expires: float | None, max_duration: float | None, retries: int | None,
            job_id: str | None,
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
    then fails (exit 3: the job may exist; --id makes the retry safe); a job id is never
    enqueued twice.

    \b
    A workflow step:  a=$(taskrunner enqueue shop.fetch --args '["x"]')
                      taskrunner enqueue shop.resize --depends-on $a --on-failure shop.alert
    (`taskrunner workflow ID` shows the graph)."""
    app = app_from(app_spec, redis_url)
    if from_file is not None:
        if task or depends_on or on_success or on_failure:
            raise click.UsageError("--from-file takes no TASK, --depends-on, --on-success, --on-failure: give "
                                   "them on each line")
        return _enqueue_file(app, app_spec, from_file)
    if not task:
        raise click.UsageError("give a TASK, or --from-file")
    args = json_arg(args_json, list, "--args")
    kwargs = json_arg(kwargs_json, dict, "--kwargs")
    success, failure = _callback(app, on_success, "--on-success"), _callback(app, on_failure, "--on-failure")
    queues = {c.task.name: c.options.get("queue") or "default" for c in (success, failure) if c is not None}
    undeclared = undeclared_tasks(app, app_spec, [task, *queues])
    job = app.enqueue(task, args, kwargs, queue=queue, delay=delay, max_duration=max_duration,
                      retries=retries, job_id=job_id, block_timeout=block_timeout, depends_on=list(depends_on) or None,
                      on_success=success, on_failure=failure, priority=priority, unique_key=unique_key,
                      unique_for=unique_for, unique_until=unique_until, expires=expires)
    if not job.created:
        click.echo(f"job {job.id} exists already (or holds the unique key); not enqueued again", err=True)
    else:
        for name in undeclared:
            warn_undeclared(name, [job.queue] if name == task else [queues[name]])
    click.echo(job.id)


def _callback(app: TaskRunner, value: str | None, what: str) -> Signature | None:
    """--on-success / --on-failure: a task name, or a JSON object (TaskRunner.callback_of)."""
    if value is None:
        return None
    if not value.lstrip().startswith("{"):
        return app.callback_of(value, what)
    return app.callback_of(json_arg(value, dict, what), what)


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
    undeclared = undeclared_tasks(app, app_spec, tasks)
    with progress_bar(len(specs), "enqueueing") as progress:
        jobs = app.enqueue_many(specs, progress=progress)
    for task in undeclared:
        warn_undeclared(task, [j.queue for j, t in zip(jobs, tasks) if t == task])
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
    job = app_from(app_spec, redis_url).job(job_id)
    d = job.to_dict()
    if as_json:
        return emit_json(d)
    state = d["state"] + ((" (stuck)" if d["state"] == "running" else " (ran past its max duration)") if d["stuck"]
                          else "")
    rows = [("id", d["id"]), ("task", d.get("task")), ("queue", d["queue"]), ("state", state),
            ("attempts", d["attempts"]), ("enqueued", timestamp(d.get("enqueued_at"))),
            *([("due", timestamp(d.get("due_at")))] if d["state"] == "delayed" else []),
            *([("expires", timestamp(d["expires"]))] if d.get("expires") else []),
            ("started", timestamp(d.get("started_at"))), ("finished", timestamp(d.get("finished_at"))),
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
            click.echo(f"           {timestamp(line['t'])}  #{line['attempt']}  {line['line']}")
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

    g = graph(app_from(app_spec, redis_url), job_id)
    if as_json:
        return emit_json(g)
    width = column_width(26, [n["id"] for n in g["jobs"]])
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
        job = app_from(app_spec, redis_url).job(job_id)
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
    job = app_from(app_spec, redis_url).job(job_id)
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
    job = app_from(app_spec, redis_url).job(job_id)
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
    app = app_from(app_spec, redis_url)
    if queue:
        known_queues(app, queue)
    found = listing.list_jobs(app, queue, state, limit, offset)
    if as_json:
        return emit_json([j.to_dict() for j in found])
    iw, qw = column_width(26, [j.id for j in found]), column_width(12, [j.queue for j in found])
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
