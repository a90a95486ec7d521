"""`taskrunner up --demo`: the whole stack on an embedded Redis, from an empty folder."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import psutil
import pytest
import redis

from taskrunner import TaskRunner
from tests.conftest import ROOT, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_a_terminal(args: list[str], cwd, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run a command with a pty as its stdout and stderr, as in a terminal (where progress
    bars redraw their line); (exit code, what it wrote, with the terminal's \r\n as \n)."""
    leader, follower = os.openpty()
    p = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                         start_new_session=True)
    os.close(follower)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: _drain(leader, chunks), daemon=True)
    reader.start()
    try:
        p.wait(timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
        reader.join(10)
        os.close(leader)
    return p.returncode, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def _drain(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            return
        if not data:
            return
        into.append(data)


def test_up_demo_runs_teaches_and_stops_cleanly(tmp_path):
    """The whole demo, in a terminal. What a newcomer reads: the planned failures named as
    planned before the warnings they cause, that the dashboard is read-only and the line
    that enables actions, a job still running and one stuck to look at, and no log line
    overwritten by a progress bar."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "TASKRUNNER_"))}
    env["PYTHONPATH"] = str(ROOT)
    code, out = run_in_a_terminal([sys.executable, "-m", "taskrunner", "up", "--demo", "--exit", "--port",
                                   str(free_port())], tmp_path, env, timeout=180)
    assert code == 0, out
    assert f"unix://{tmp_path.resolve()}/var/redis.sock" in out
    assert "demo: enqueued 215 jobs" in out and "redis-server stopped" in out
    summary = [line for line in out.splitlines() if line.startswith("demo: ") and "completed" in line][-1]
    assert summary == "demo: 212 completed, 3 failed (3 planned)", summary  # fail, too_slow and crash
    assert (tmp_path / "var" / "appendonlydir").is_dir()  # AOF on
    leftovers = [q for q in psutil.process_iter(["cmdline"])
                 if str(tmp_path) in " ".join(q.info["cmdline"] or [])]
    assert leftovers == []
    assert "\r" not in out, "a line was redrawn over: " + repr(out[:2000])
    lines = out.splitlines()
    assert "dashboard: read-only; to kill, retry and purge from it, start with a password: " \
           "TASKRUNNER_DASHBOARD_PASSWORD=pick-one make demo" in lines
    planned = lines.index("demo: enqueued 215 jobs; 3 of them fail on purpose (planned):")
    assert [line.split()[1] for line in lines[planned + 1:planned + 4]] == ["fail", "too_slow", "crash"]
    first_warning = next(i for i, line in enumerate(lines) if " WARNING " in line)
    assert planned < first_warning
    [shown] = [line for line in lines if line.startswith("demo: still running for you to look at:")]
    assert "/running" in shown and "stuck past its 5 s max duration" in shown and "/stuck" in shown


def start_up(cwd, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`taskrunner up -A tests.apps` in cwd, its own session; returned once its Redis,
    dispatcher, worker and dashboard run and the worker has started."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "TASKRUNNER_"))},
           "PYTHONPATH": str(ROOT), **(env or {})}
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "taskrunner", "up", "-A", "tests.apps", "--port", str(port),
                          *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    up = psutil.Process(p.pid)
    try:
        # Generous: `up` starts them one after another, each importing the app (a loaded CI
        # machine, 4 test processes on 2 cores, once took over 30 s).
        wait_for(lambda: len(up.children()) == 4, 90, what="Redis, dispatcher, worker and dashboard")
        wait_for(lambda: "queues default" in p.stdout.readline(), 90, what="the worker to start")
        # Both dashboard processes serve (a Ctrl-C while gunicorn imports is a traceback of its own).
        wait_for(lambda: len(psutil.Process(_dashboard(up).pid).children()) == 2 and _serves(port),
                 what="the dashboard")
    except BaseException:
        stop_up(p, up.children(recursive=True))
        raise
    return p


def test_ctrl_c_while_the_stack_starts_stops_it_without_a_traceback(tmp_path):
    """Ctrl-C in the first second of `taskrunner up` (or `make demo`), while its processes
    still import: everything stops, exit 0, no traceback. The terminal's SIGINT reached a
    dispatcher, worker or gunicorn before they had handlers: KeyboardInterrupt tracebacks
    (CI's `make demo` check, where a fresh checkout's first imports are slow)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "TASKRUNNER_"))},
           "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "taskrunner", "up", "-A", "tests.apps", "--port", str(free_port())],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    up = psutil.Process(p.pid)
    family: list[psutil.Process] = []
    try:
        wait_for(lambda: len(up.children()) == 4, what="Redis, dispatcher, worker and dashboard started")
        family = up.children(recursive=True)
        os.killpg(p.pid, signal.SIGINT)  # as a terminal does: to its foreground process group
        out, _ = p.communicate(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=30)
    finally:
        stop_up(p, family)
    assert p.returncode == 0 and "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.rstrip().endswith("redis-server stopped"), out
    assert alive == [], [q.cmdline() for q in alive]


def _dashboard(up: psutil.Process) -> psutil.Process:
    [gunicorn] = [q for q in up.children() if "gunicorn" in " ".join(q.cmdline())]
    return gunicorn


def _serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def stops_cleanly_on_sigterm(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and "redis-server stopped" in out, out


def stop_up(p: subprocess.Popen, family: list[psutil.Process]) -> None:
    """Whatever a test left running of an `up`: killed."""
    if p.poll() is None:
        p.kill()
    p.wait()
    for q in family:
        try:
            q.kill()  # Redis has its own session: killpg would miss it
        except psutil.NoSuchProcess:
            pass


def up_with_a_running_job(tmp_path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """`up` whose worker gives running jobs 600 s of grace, and a job running there."""
    p = start_up(tmp_path, env={"TASKRUNNER_SHUTDOWN_GRACE": "600"})
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        client = TaskRunner("probe", redis_url=f"unix://{tmp_path.resolve()}/var/redis.sock")
        job = client.enqueue("tests.apps.hold", ["u1", 300])
        wait_for(lambda: job.refresh().state == "running", what="the job to run")
    except BaseException:
        stop_up(p, family)
        raise
    return p, family


def stopped_now(p: subprocess.Popen, out: str) -> None:
    """`up` stopped its running job now (requeued it), cleanly: exit 0, no traceback, Redis last."""
    assert p.returncode == 0, out
    assert "Traceback" not in out and "stopping now: running jobs are stopped and requeued" in out, out
    assert re.search(r"worker \S+: stopped after 0 jobs", out) and "could not say goodbye" not in out, out
    assert out.rstrip().endswith("redis-server stopped"), out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_up_stops_everything_on_sigterm(tmp_path, sig):
    """SIGTERM to `taskrunner up` alone (a supervisor, `kill`): it stops its dispatcher,
    worker, dashboard and Redis, as Ctrl-C does, and exits 0. It died at once and left them
    all running. SIGHUP (its terminal closed) likewise, Redis last: `up` died of it and its
    processes and Redis got SIGTERM at once (Redis gone during the workers' grace)."""
    p = start_up(tmp_path)
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
        _, alive = psutil.wait_procs(family, timeout=10)
    finally:
        stop_up(p, family)
    assert p.returncode == 0, out
    assert f"stopping ({sig.name})..." in out and out.rstrip().endswith("redis-server stopped"), out
    assert re.search(r"worker \S+: stopped after", out) and "could not say goodbye" not in out, out
    assert alive == [], [q.cmdline() for q in alive]


def test_ctrl_z_suspends_the_whole_stack_and_fg_resumes_it(tmp_path):
    """Ctrl-Z (SIGTSTP, which the terminal sends to `up` alone: its processes have groups of
    their own) stops `up` and every process of the stack but Redis, the worker's children
    too; SIGCONT (`fg`) resumes them all. Without it, they ran on behind the shell's prompt."""
    p = start_up(tmp_path)
    family = psutil.Process(p.pid).children(recursive=True)
    stack = [q for q in family if q.name() != "redis-server"]
    try:
        p.send_signal(signal.SIGTSTP)
        wait_for(lambda: all(q.status() == psutil.STATUS_STOPPED for q in [psutil.Process(p.pid), *stack]),
                 what="up and its processes stopped")
        p.send_signal(signal.SIGCONT)
        wait_for(lambda: all(q.status() != psutil.STATUS_STOPPED for q in [psutil.Process(p.pid), *stack]),
                 what="up and its processes resumed")
        stops_cleanly_on_sigterm(p)
    finally:
        stop_up(p, family)


def test_ctrl_backslash_stops_up_now(tmp_path):
    """Ctrl-\\ (SIGQUIT), which reaches `up` alone: running jobs are stopped and requeued
    now, as Ctrl-C twice does, and everything stops cleanly. `up` dumped core and its
    processes got SIGTERM with Redis at once."""
    p, family = up_with_a_running_job(tmp_path)
    try:
        p.send_signal(signal.SIGQUIT)
        out, _ = p.communicate(timeout=120)
    finally:
        stop_up(p, family)
    stopped_now(p, out)


def test_up_gives_its_log_format_to_its_processes(tmp_path):
    """`up --log-format json`: its dispatcher, worker and dashboard (gunicorn) log JSON
    objects; only what `up` itself says stays text."""
    p = start_up(tmp_path, "--log-format", "json")
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        # gunicorn, at --log-level warning, says nothing here: it is given the format
        assert _dashboard(psutil.Process(p.pid)).environ()["TASKRUNNER_LOG_FORMAT"] == "json"
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        stop_up(p, family)
    assert p.returncode == 0, out
    objects = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {"taskrunner.worker", "taskrunner.dispatcher"} <= {x["logger"] for x in objects}, out
    own = [line for line in out.splitlines() if not line.startswith("{")]
    assert all(line.startswith(("redis-server", "dashboard:", "stopping")) for line in own), own


def test_second_up_in_the_same_directory_says_so_and_leaves_the_first_alone(tmp_path):
    """A second `taskrunner up` (or `make demo`) where one runs: one line naming the running
    one, its Redis and how to stop or use it, exit 2. It printed a traceback (RuntimeError)."""
    p = start_up(tmp_path)
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "TASKRUNNER_"))}
        second = subprocess.run([sys.executable, "-m", "taskrunner", "up", "-A", "tests.apps", "--port",
                                 str(free_port())], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second
        assert second.stdout == "" and len(second.stderr.splitlines()) == 1, second.stderr
        sock = tmp_path.resolve() / "var" / "redis.sock"
        assert second.stderr.startswith("Error: a taskrunner stack already runs from this directory "
                                        f"(`taskrunner up`, pid {p.pid}, its Redis on unix://{sock}): "), second.stderr
        assert f"kill {p.pid}" in second.stderr
        assert all(q.is_running() for q in family) and p.poll() is None  # the first one: undisturbed
        assert redis.Redis(unix_socket_path=str(sock)).ping()
        stops_cleanly_on_sigterm(p)
    finally:
        stop_up(p, family)


def test_sigkilled_up_takes_its_stack_along_and_the_next_up_starts(tmp_path):
    """`taskrunner up` SIGKILLed (OOM killer, kill -9): its Redis, dispatcher, worker and
    dashboard stop too; they ran on, orphaned, holding the socket and the port. Then a new
    `up` starts as usual, also over a socket file left by a SIGKILLed redis-server."""
    p = start_up(tmp_path)
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        p.kill()
        p.wait()
        _, alive = psutil.wait_procs(family, timeout=60)
        assert alive == [], [q.cmdline() for q in alive]
    finally:
        stop_up(p, family)
    p = start_up(tmp_path)
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        [server] = [q for q in family if q.name() == "redis-server"]
        server.suspend()  # else the SIGTERM it gets as `up` dies (die_with_parent) may shut it down cleanly first
        os.killpg(p.pid, signal.SIGKILL)  # everything but Redis, which has its own session
        server.kill()
        _, alive = psutil.wait_procs([server, *family], timeout=60)
        assert alive == []
        assert (tmp_path / "var" / "redis.sock").exists()  # stale: nothing serves it
    finally:
        stop_up(p, family)
    p = start_up(tmp_path)
    family = psutil.Process(p.pid).children(recursive=True)
    try:
        stops_cleanly_on_sigterm(p)
    finally:
        stop_up(p, family)


def test_up_on_a_taken_port_says_so_before_starting_anything(tmp_path):
    """The dashboard's port taken by another program: one line naming it, exit 2, and no
    Redis started. Gunicorn retried for 5 s, then `up` stopped everything, exit 1, after
    printing the other program's address as its dashboard."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "TASKRUNNER_"))}
        r = subprocess.run([sys.executable, "-m", "taskrunner", "up", "-A", "tests.apps", "--port", str(port)],
                           cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith(f"Error: port {port} of 127.0.0.1 is taken") and len(r.stderr.splitlines()) == 1, r
    assert not (tmp_path / "var" / "redis.sock").exists()


def test_ctrl_c_twice_stops_up_now_and_cleanly(tmp_path):
    """Ctrl-C, then Ctrl-C again while a job runs in the worker's grace: the job is stopped
    and requeued now, Redis stays until the worker has said so, no traceback. The second
    Ctrl-C raised KeyboardInterrupt in `up` (a traceback) while it waited for its processes."""
    p, family = up_with_a_running_job(tmp_path)
    try:
        os.killpg(p.pid, signal.SIGINT)  # as a terminal does: to its foreground process group
        # Both up and its worker (SIGTERM from up) took the first Ctrl-C before the second
        # comes: two signals pending at once in one process are one (the kernel merges them).
        seen: set[str] = set()
        lines: list[str] = []
        wanted = {"stopping...", "running jobs have 600s to finish"}
        wait_for(lambda: lines.append(p.stdout.readline()) or seen.update(w for w in wanted if w in lines[-1])
                 or seen == wanted, what=f"up and its worker to take the first Ctrl-C: {lines}")
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=120)
    finally:
        stop_up(p, family)
    stopped_now(p, out)
