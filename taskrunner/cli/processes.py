"""The long-running processes: worker, dispatcher, dashboard, and `up`, which runs them all with a
Redis of its own."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

import click

from taskrunner import logs
from taskrunner.cli.base import Finite, app_from, common, log_options, main
from taskrunner.client.app import TaskRunner
from taskrunner.config import Settings
from taskrunner.errors import (
    require_extra,
)

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
    app = app_from(app_spec, redis_url, check=True)
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
    app = app_from(app_spec, redis_url, check=True)
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
    app = app_from(app_spec, redis_url, check=True)
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
