"""`taskrunner up`: the whole stack on one machine, for development and the demo."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from taskrunner.client.app import TaskRunner
from taskrunner.client.job import Job
from taskrunner.client.loader import load_app
from taskrunner.client.steps import FINAL
from taskrunner.errors import Misconfigured
from taskrunner.ops.redis_server import RedisServer, RedisServerError, SocketInUse
from taskrunner.protocol.urls import EMBEDDED_DIR
from taskrunner.worker.child import dies_with_us


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A process of the stack; on Linux it gets SIGTERM if `up` dies (SIGKILL, OOM), where
    it would have run on, orphaned, holding the dashboard's port and Redis's socket.

    In a process group of its own, so that the terminal's Ctrl-C reaches `up` alone, which
    passes it on as SIGTERM (_stop): a SIGINT reaching a process still importing (the first
    second of `make demo`, or a slow first start that compiles every module) printed a
    KeyboardInterrupt traceback, where SIGTERM ends it quietly. Being in the background of
    the terminal, it ignores SIGTTOU: under `stty tostop` its first log line would stop it.
    `up` passes Ctrl-Z on (_Suspender)."""
    arm = dies_with_us()

    def preexec() -> None:
        os.setpgid(0, 0)  # Popen's process_group=0, which Python 3.10 lacks
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        arm()

    return subprocess.Popen([sys.executable, "-m", *args], env=env, stdin=subprocess.DEVNULL, preexec_fn=preexec)


def _claim(directory: Path) -> int:
    """One `up` at a time per directory (a second would steal the first's Redis socket): a
    lock the kernel releases however `up` ends, SIGKILL included, so a lock file left
    behind never stops the next one. Holds our PID, to name us to a second `up`."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.read(fd, 20).decode(errors="replace").strip() or "?"
        os.close(fd)
        sock = (directory / "redis.sock").resolve()
        raise Misconfigured(f"a taskrunner stack already runs from this directory (`taskrunner up`, pid {pid}, "
                            f"its Redis on unix://{sock}): use it (taskrunner commands run here connect to it), "
                            f"stop it (Ctrl-C in its terminal, or kill {pid}), or start another from another "
                            "directory") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd  # open (not inherited by our children) until we exit


def _check_port(port: int) -> None:
    """The dashboard's port must be free before anything starts: gunicorn would retry for
    seconds, then exit, and `up` would have shown another program's address as ours."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn: TIME_WAIT is no conflict
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise Misconfigured(f"port {port} of 127.0.0.1 is taken ({e.strerror}): another program serves there, "
                                "maybe another `taskrunner up`; give the dashboard another with --port") from None


def _embedded_redis() -> RedisServer:
    try:
        return RedisServer(EMBEDDED_DIR, appendonly=True, die_with_parent=True).start()
    except SocketInUse as e:  # no `up` runs here, yet something serves the socket
        stop = f"kill {e.pid}" if e.pid else f"redis-cli -s {e.socket} shutdown"
        raise Misconfigured(f"{e}, and no `taskrunner up` runs here (it was started by hand, or left by an older "
                            f"`up` that was killed): stop it ({stop}), or use it: REDIS_URL=unix://{e.socket} "
                            "taskrunner up ...") from None
    except RedisServerError as e:
        raise click.ClickException(str(e)) from None


class _Terminated(Exception):
    """SIGTERM to `up` itself (a supervisor, `kill`): stop everything, as Ctrl-C does."""


class _Signals:
    """`up`'s one handler of SIGINT, SIGTERM, SIGHUP (its terminal closed: as SIGTERM) and
    SIGQUIT (Ctrl-\\: stop now, as Ctrl-C twice), from start to end: the first interrupts
    its wait (KeyboardInterrupt, _Terminated); once stopping, each is noted in `caught` for
    _stop() to act on (a SIGQUIT that started the stop too). One handler throughout, so that
    a second Ctrl-C is seen whenever it comes: when _stop() installed its own, one that came
    before it did was lost (the test of Ctrl-C twice failed 1 run in 4). While `deferred`
    (up starts its processes) the first is kept for raised() to raise: raised inside Popen,
    after the fork, it would leave a process started that `up` does not know of."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self) -> None:
        self.stopping = self.deferred = False
        self.first: int | None = None
        self.caught: list[int] = []  # told by _stop(), not here: a handler writing could cut a line

    def __call__(self, signum: int, frame: object) -> None:
        if self.stopping:
            self.caught.append(signum)
            return
        self.stopping, self.first = True, signum
        if signum == signal.SIGQUIT:
            self.caught.append(signum)
        if not self.deferred:
            self.raise_it()

    def raise_it(self) -> None:
        """Raise the first signal, if one came while deferred."""
        if self.first is not None:
            raise KeyboardInterrupt if self.first in (signal.SIGINT, signal.SIGQUIT) else _Terminated


class _Suspender:
    """Ctrl-Z (SIGTSTP) reaches `up` alone (its processes have groups of their own): it stops
    their groups (a worker's children with it), then itself; `fg` (SIGCONT) continues them."""

    def __init__(self, procs: dict[str, subprocess.Popen]) -> None:
        self.procs = procs
        signal.signal(signal.SIGTSTP, self)
        signal.signal(signal.SIGCONT, self)

    def __call__(self, signum: int, frame: object) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTSTP if signum == signal.SIGTSTP else signal.SIGCONT)
                except ProcessLookupError:
                    pass
        if signum == signal.SIGTSTP:
            os.kill(os.getpid(), signal.SIGSTOP)


def run_stack(app_spec: str, redis_url: str | None, concurrency: int, port: int, demo: bool,
              exit_after: bool, log_format: str) -> int:
    server = None
    if not redis_url:
        _claim(EMBEDDED_DIR)
    _check_port(port)
    if not redis_url:
        server = _embedded_redis()
        redis_url = server.url
        click.echo(f"redis-server: {redis_url} (AOF on, data in {Path(EMBEDDED_DIR).resolve()})")
    env = {**os.environ, "REDIS_URL": redis_url, "TASKRUNNER_APP": app_spec, "TASKRUNNER_LOG_FORMAT": log_format}
    commands = {
        "dispatcher": (["taskrunner", "dispatcher"], env),
        "worker": (["taskrunner", "worker", "-c", str(concurrency), *(["-Q", "default"] if demo else [])], env),
        "dashboard": (["gunicorn", "-c", "python:dashboard.gunicorn_conf", "-w", "2", "-b", f"127.0.0.1:{port}",
                       "--log-level", "warning", "dashboard:create_app()"], env),
    }
    if demo:  # the demo's long jobs get a worker of their own, so that they hold up nothing
        commands["slow worker"] = (["taskrunner", "worker", "-Q", "slow", "-c", "2"],
                                   {**env, "TASKRUNNER_SHUTDOWN_GRACE": "1"})
    code = 0
    procs: dict[str, subprocess.Popen] = {}
    signals = _Signals()  # before the first process starts: a Ctrl-C from then on stops those started
    for sig in _Signals.SIGNALS:
        signal.signal(sig, signals)
    _Suspender(procs)
    try:
        signals.deferred = True
        for name, (args, its_env) in commands.items():
            procs[name] = _spawn(args, its_env)
            if signals.first is not None:
                break
        signals.deferred = False
        signals.raise_it()
        click.echo(f"dashboard: http://127.0.0.1:{port}/   (Ctrl-C stops everything)")
        if not os.environ.get("TASKRUNNER_DASHBOARD_PASSWORD"):
            click.echo("dashboard: read-only; to kill, retry and purge from it, start with a password: "
                       "TASKRUNNER_DASHBOARD_PASSWORD=pick-one " + ("make demo" if demo else "taskrunner up ..."))
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
        click.echo("stopping...")
    except _Terminated:
        click.echo(f"stopping ({signal.Signals(signals.first or signal.SIGTERM).name})...")
        code = 0
    finally:
        _stop(procs, signals)
        if server:
            server.stop()
            click.echo("redis-server stopped")
    return code


def _stop(named: dict[str, subprocess.Popen], signals: _Signals) -> None:
    """Stop the stack's processes (SIGTERM: the terminal's Ctrl-C reached `up` alone) and
    wait for them, Redis kept until they are gone: running jobs have their grace. Meanwhile
    SIGTERM (or SIGHUP) again is ignored, as the worker ignores it, and Ctrl-C again (or
    Ctrl-\\) stops running jobs now (SIGINT to the workers: they requeue them). Past 30 s
    the workers get SIGINT, past 40 s every process SIGKILL. The dashboard and the
    dispatcher get SIGTERM alone: to gunicorn a SIGINT is a quick stop that sends its
    workers SIGQUIT, which met one already exiting after the SIGTERM and printed a
    traceback from its interpreter's shutdown."""
    signals.stopping = True
    caught = signals.caught
    procs = list(named.values())
    workers = [p for name, p in named.items() if "worker" in name]
    _send(procs, signal.SIGTERM)
    began, hurried = time.monotonic(), False
    while True:
        while caught:  # also when all are gone already: what the user did is acknowledged
            if caught.pop(0) in (signal.SIGINT, signal.SIGQUIT):
                click.echo("stopping now: running jobs are stopped and requeued")
                _send(workers, signal.SIGINT)
            else:
                click.echo("already stopping (SIGTERM again, ignored): running jobs have their grace; "
                           "Ctrl-C stops them now")
        if all(p.poll() is not None for p in procs):
            break
        waited = time.monotonic() - began
        if waited > 30 and not hurried:
            _send(workers, signal.SIGINT)
            hurried = True
        if waited > 40:
            _send(procs, signal.SIGKILL)
        time.sleep(0.1)


def _send(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)


def _demo(app_spec: str, redis_url: str, exit_after: bool) -> int:
    """Enqueue the demo workload and tell its progress, a line at a time (log lines of
    the other processes go to the same terminal), until every job has ended; start the
    long jobs to look at and say where they are. With exit_after: once they are seen
    running and stuck, kill them and return."""
    from taskrunner import demo

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
