"""`taskrunner up`: the whole stack on one machine, for development and the demo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from .app import TaskRunner
from .connection import EMBEDDED_DIR
from .job import FINAL, Job
from .loader import load_app
from .redis_server import AlreadyServed, RedisServer


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], env=env)


class _Terminated(Exception):
    """SIGTERM to `up` itself (a supervisor, `kill`): stop everything, as Ctrl-C does."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def run_stack(app_spec: str, redis_url: str | None, concurrency: int, port: int, demo: bool,
              exit_after: bool) -> int:
    server = None
    if not redis_url:
        try:
            server = RedisServer(EMBEDDED_DIR, appendonly=True).start()
        except AlreadyServed:
            raise click.ClickException(
                f"a taskrunner stack already runs from this folder (its Redis serves {EMBEDDED_DIR}/redis.sock): "
                "commands run here use it; stop it (Ctrl-C in its terminal) to start another") from None
        except RuntimeError as e:  # redis-server would not start
            raise click.ClickException(str(e)) from None
        redis_url = server.url
        click.echo(f"redis-server: {redis_url} (AOF on, data in {Path(EMBEDDED_DIR).resolve()})")
    env = {**os.environ, "REDIS_URL": redis_url, "TASKRUNNER_APP": app_spec}
    procs = {
        "dispatcher": _spawn(["taskrunner", "dispatcher"], env),
        "worker": _spawn(["taskrunner", "worker", "-c", str(concurrency), *(["-Q", "default"] if demo else [])], env),
        "dashboard": _spawn(["gunicorn", "-c", "python:dashboard.gunicorn_conf", "-w", "2", "-b", f"127.0.0.1:{port}",
                             "--log-level", "warning", "dashboard:create_app()"], env),
    }
    if demo:  # the demo's long jobs get a worker of their own, so that they hold up nothing
        procs["slow worker"] = _spawn(["taskrunner", "worker", "-Q", "slow", "-c", "2"],
                                      {**env, "TASKRUNNER_SHUTDOWN_GRACE": "1"})
    click.echo(f"dashboard: http://127.0.0.1:{port}/   (Ctrl-C stops everything)")
    if not os.environ.get("TASKRUNNER_DASHBOARD_PASSWORD"):
        click.echo("dashboard: read-only; to kill, retry and purge from it, start with a password: "
                   "TASKRUNNER_DASHBOARD_PASSWORD=pick-one " + ("make demo" if demo else "taskrunner up ..."))
    code = 0
    interrupted = False
    signal.signal(signal.SIGTERM, _terminated)  # else it dies at once, leaving everything running
    try:
        if demo:
            code = _demo(app_spec, redis_url, exit_after)
            if exit_after:
                return code
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in procs.items() if p.poll() is not None]
        click.echo(f"{', '.join(dead)} exited; stopping the rest", err=True)
        code = 1
    except KeyboardInterrupt:
        interrupted = True  # the terminal sent SIGINT to every process of ours already
        click.echo("stopping...")
    except _Terminated:
        click.echo("stopping (SIGTERM)...")
        code = 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stopping short
        for p in procs.values():
            if p.poll() is None and not interrupted:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGQUIT)  # a worker: stop now (a second SIGTERM is the same stop)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if server:
            server.stop()
            click.echo("redis-server stopped")
    return code


def _demo(app_spec: str, redis_url: str, exit_after: bool) -> int:
    """Enqueue the demo workload and tell its progress, a line at a time (log lines of
    the other processes go to the same terminal), until every job has ended; start the
    long jobs to look at and say where they are. With exit_after: once they are seen
    running and stuck, kill them and return."""
    from . import demo

    app = load_app(app_spec, redis_url)
    if not hasattr(sys.modules.get(app_spec.split(":")[0]), "workload"):
        app = demo.app
        app.configure(redis_url=redis_url)
    long_jobs = demo.showcase()
    jobs = demo.workload()
    click.echo(f"demo: enqueued {len(jobs)} jobs; {len(demo.PLANNED)} of them fail on purpose (planned):")
    for task, what in demo.PLANNED.items():
        click.echo(f"demo:   {task.rsplit('.', 1)[1]:9} {what}")
    click.echo("demo: so the warnings below about a job past its max duration and a child that died are planned")
    ended = _follow(app, jobs)
    planned = sum(1 for state, task in ended if state == "failed" and task in demo.PLANNED)
    counts = {s: [state for state, _ in ended].count(s) for s in sorted({state for state, _ in ended})}
    click.echo("demo: " + ", ".join(f"{n} {s}" for s, n in counts.items())
               + (f" ({planned} planned)" if planned == counts.get("failed") else " (NOT as planned)"))
    click.echo("demo: 'taskrunner jobs --state failed' lists the failures; each job's page in the dashboard "
               "tells its story")
    code = 0 if sum(n for s, n in counts.items() if s in FINAL) == len(jobs) else 1
    report, overdue = long_jobs
    if not _until(lambda: report.refresh().state == "running" and overdue.refresh().data.get("stuck") == "1", 60):
        click.echo("demo: the long jobs did not start; is the slow worker up?", err=True)
        return 1
    click.echo(f"demo: still running for you to look at: {report.id} (report, 3 minutes: /running), and "
               f"{overdue.id} (overdue, stuck past its 5 s max duration, left running: /stuck)")
    if exit_after:
        for j in long_jobs:
            j.kill()
        _until(lambda: all(j.refresh().state in FINAL for j in long_jobs), 60)
    return code


def _until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _follow(app: TaskRunner, jobs: list[Job]) -> list[tuple[str, str]]:
    """Each job's (state, task) once all have ended (or after 2 minutes), printing how
    many are done when that changes, at most every 2 seconds."""
    ended: list[tuple[str, str]] = []
    deadline, told, told_at = time.monotonic() + 120, 0, 0.0
    while time.monotonic() < deadline:
        pipe = app.redis.pipeline(transaction=False)
        for j in jobs:
            pipe.hmget(app.keys.job(j.queue, j.id), "state", "task")
        ended = [(state or "?", task or "?") for state, task in pipe.execute()]
        done = sum(1 for state, _ in ended if state in FINAL)
        if done == len(jobs):
            break
        if done != told and time.monotonic() - told_at >= 2:
            click.echo(f"demo: {done}/{len(jobs)} jobs done")
            told, told_at = done, time.monotonic()
        time.sleep(0.2)
    return ended
