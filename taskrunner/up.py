"""`taskrunner up`: the whole stack on one machine, for development and the demo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from .connection import EMBEDDED_DIR
from .job import FINAL
from .loader import load_app
from .redis_server import RedisServer


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
        server = RedisServer(EMBEDDED_DIR, appendonly=True).start()
        redis_url = server.url
        click.echo(f"redis-server: {redis_url} (AOF on, data in {Path(EMBEDDED_DIR).resolve()})")
    env = {**os.environ, "REDIS_URL": redis_url, "TASKRUNNER_APP": app_spec}
    procs = {
        "dispatcher": _spawn(["taskrunner", "dispatcher"], env),
        "worker": _spawn(["taskrunner", "worker", "-c", str(concurrency)], env),
        "dashboard": _spawn(["gunicorn", "-c", "python:dashboard.gunicorn_conf", "-w", "2", "-b", f"127.0.0.1:{port}",
                             "--log-level", "warning", "dashboard:create_app()"], env),
    }
    click.echo(f"dashboard: http://127.0.0.1:{port}/   (Ctrl-C stops everything)")
    code = 0
    interrupted = False
    signal.signal(signal.SIGTERM, _terminated)  # else it dies at once, leaving everything running
    try:
        if demo:
            code = _demo(app_spec, redis_url)
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
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if server:
            server.stop()
            click.echo("redis-server stopped")
    return code


def _demo(app_spec: str, redis_url: str) -> int:
    """Enqueue the demo workload and show its progress until every job has ended."""
    from . import demo

    app = load_app(app_spec, redis_url)
    if not hasattr(sys.modules.get(app_spec.split(":")[0]), "workload"):
        app = demo.app
        app.configure(redis_url=redis_url)
    jobs = demo.workload()
    click.echo(f"demo: enqueued {len(jobs)} jobs")
    states: dict[str, int] = {}
    deadline = time.monotonic() + 120
    with click.progressbar(length=len(jobs), label="demo jobs done") as bar:
        done = 0
        while done < len(jobs) and time.monotonic() < deadline:
            pipe = app.redis.pipeline(transaction=False)
            for j in jobs:
                pipe.hget(app.keys.job(j.queue, j.id), "state")
            current = pipe.execute()
            states = {s: current.count(s) for s in set(current)}
            now_done = sum(n for s, n in states.items() if s in FINAL)
            bar.update(now_done - done)
            done = now_done
            time.sleep(0.2)
    click.echo("demo: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    click.echo("demo: 'taskrunner jobs --state failed' shows the failures the demo planned")
    return 0 if sum(n for s, n in states.items() if s in FINAL) == len(jobs) else 1
