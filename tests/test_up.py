"""`taskrunner up --demo`: the whole stack on an embedded Redis, from an empty folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil

from tests.conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_demo_runs_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "TASKRUNNER_"))}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.Popen([sys.executable, "-m", "taskrunner", "up", "--demo", "--exit", "--port", str(free_port())],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    assert p.returncode == 0, out
    assert f"unix://{tmp_path.resolve()}/var/redis.sock" in out
    assert "demo: enqueued 215 jobs" in out and "redis-server stopped" in out
    summary = [line for line in out.splitlines() if line.startswith("demo: ") and "completed" in line][-1]
    assert summary == "demo: 212 completed, 3 failed", summary  # fail, too_slow and crash fail by design
    assert (tmp_path / "var" / "appendonlydir").is_dir()  # AOF on
    leftovers = [q for q in psutil.process_iter(["cmdline"])
                 if str(tmp_path) in " ".join(q.info["cmdline"] or [])]
    assert leftovers == []


def test_up_stops_everything_on_sigterm(tmp_path):
    """SIGTERM to `taskrunner up` alone (a supervisor, `kill`): it stops its dispatcher,
    worker, dashboard and Redis, as Ctrl-C does, and exits 0. It died at once and left them
    all running."""
    import signal

    from tests.conftest import wait_for

    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "TASKRUNNER_"))}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.Popen([sys.executable, "-m", "taskrunner", "up", "-A", "tests.apps", "--port", str(free_port())],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    family: list[psutil.Process] = []
    try:
        up = psutil.Process(p.pid)
        wait_for(lambda: len(up.children()) == 4, what="Redis, dispatcher, worker and dashboard")
        wait_for(lambda: "queues default" in p.stdout.readline(), what="the worker to start")
        family = up.children(recursive=True)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        _, alive = psutil.wait_procs(family, timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        for q in family:
            try:
                q.kill()  # Redis has its own session: killpg would miss it
            except psutil.NoSuchProcess:
                pass
    assert p.returncode == 0, out
    assert "redis-server stopped" in out, out
    assert alive == [], [q.cmdline() for q in alive]
