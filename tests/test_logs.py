"""Structured logs (--log-format json, TASKRUNNER_LOG_FORMAT=json): every line a process
writes on stderr is one JSON object, and every event about a job names it (job_id, task,
queue, attempt, worker), in the worker, its children (classic and loop) and the dispatcher."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from taskrunner import logs
from tests import apps
from tests.conftest import ROOT, wait_for

JOB_FIELDS = ("job_id", "task", "queue", "attempt", "worker")


def record(msg: str, *args: Any, exc_info: Any = None, **extra: Any) -> logging.LogRecord:
    r = logging.LogRecord("taskrunner.worker", logging.WARNING, __file__, 1, msg, args, exc_info)
    r.__dict__.update(extra)
    return r


def test_json_formatter_writes_one_line_per_record():
    fmt = logs.JsonFormatter()
    try:
        raise ValueError("deep\ntrouble")
    except ValueError:
        line = fmt.format(record("job %s: %d%% done, señor ✓", "j1", 50, exc_info=sys.exc_info(), job_id="j1",
                                 attempt=2))
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == "job j1: 50% done, señor ✓"
    assert out["level"] == "WARNING" and out["logger"] == "taskrunner.worker" and out["process"] == os.getpid()
    assert out["job_id"] == "j1" and out["attempt"] == 2
    assert out["exc"].startswith("Traceback (most recent call last):")
    assert out["exc"].endswith("ValueError: deep\ntrouble")
    assert len(out["time"]) == 24 and out["time"][10] == "T" and out["time"].endswith("Z"), out["time"]  # ms, UTC
    # What orjson cannot encode still makes a line: a huge int, a lone surrogate, an object.
    odd = json.loads(fmt.format(record("x", big=2 ** 70, bad="\udcff", thing=object())))
    assert odd["big"] == 2 ** 70 and odd["bad"] == "\udcff" and odd["thing"].startswith("<object object")


def test_job_fields_name_one_run():
    from taskrunner.protocol.claims import Delivery

    d = Delivery("q1", "j1", "3", "tests.apps.add", "[]", "{}", 30.0)
    assert logs.job_fields(d, "w1") == {"job_id": "j1", "task": "tests.apps.add", "queue": "q1", "attempt": 3,
                                        "worker": "w1"}
    assert "worker" not in logs.job_fields(d)


def test_a_bad_log_format_is_refused_clearly(stack):
    for args, env in ((["--log-format", "xml"], {}), ([], {"TASKRUNNER_LOG_FORMAT": "xml"})):
        r = subprocess.run([sys.executable, "-m", "taskrunner", "worker", "-A", "tests.apps", *args], cwd=ROOT,
                           env={**stack.env, **env}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "Invalid value for '--log-format': 'xml' is not one of 'text', 'json'" in r.stderr, r.stderr


def spawn_logged(stack, path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A taskrunner process whose stderr goes to `path` (stdout elsewhere: only stderr is the log)."""
    with path.open("w") as err:
        p = subprocess.Popen([sys.executable, "-m", "taskrunner", *args], cwd=ROOT, env={**stack.env, **(env or {})},
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=err, text=True)
    stack.procs.append(p)
    return p


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0


def parsed(path: Path) -> list[dict[str, Any]]:
    """Every line of the log, each of which must be a JSON object with the base fields."""
    lines = path.read_text().splitlines()
    assert lines
    out = []
    for line in lines:
        obj = json.loads(line)  # fails on a line that is not JSON
        assert isinstance(obj, dict) and {"time", "level", "logger", "message", "process"} <= set(obj), line
        out.append(obj)
    return out


def run_failure_and_log_line(app, stack, path: Path, name: str, *args: str, env: dict[str, str] | None = None):
    """A worker logging to `path` runs a job that fails and one whose task logs a line
    through `logging`; it is stopped; its log parsed, with the two jobs."""
    w = spawn_logged(stack, path, "worker", "-A", "tests.apps", "-c", "1", "-n", name, *args, env=env)
    app.redis.set(f"{app.settings.prefix}:release:k1", 1)  # chatty ends at once
    failing, chatty = apps.boom.delay("kaputt ünïcode"), apps.chatty.delay("k1", 1)
    wait_for(lambda: failing.refresh().state == "failed" and chatty.refresh().state == "completed",
             what="both jobs to end")
    stop(w)
    return parsed(path), failing, chatty


def check_job_events(lines: list[dict[str, Any]], failing, chatty, worker: str) -> None:
    failure = [x for x in lines if x.get("job_id") == failing.id]
    assert len(failure) == 1, lines
    f = failure[0]
    assert {k: f[k] for k in JOB_FIELDS} == {"job_id": failing.id, "task": apps.boom.name, "queue": "default",
                                             "attempt": 1, "worker": worker}
    assert f["level"] in ("WARNING", "ERROR") and "ValueError: kaputt ünïcode" in f["message"]
    assert "Traceback" in f["exc"] and f["exc"].rstrip().endswith("ValueError: kaputt ünïcode")
    # The task's own line, written by the child, names its job; and still goes to the job's log.
    said = [x for x in lines if x["logger"] == "tests.chatty"]
    assert len(said) == 1, lines
    assert {k: said[0][k] for k in JOB_FIELDS} == {"job_id": chatty.id, "task": apps.chatty.name,
                                                   "queue": "default", "attempt": 1, "worker": worker}
    assert said[0]["message"] == "through logging: k1" and said[0]["process"] != f["process"]  # a child's
    assert "WARNING tests.chatty: through logging: k1" in [x["line"] for x in chatty.refresh().to_dict()["logs"]]
    assert all(x.get("worker") == worker for x in lines), "every line of a worker's processes names it"


def test_worker_json_log_with_the_option(app, stack, tmp_path):
    lines, failing, chatty = run_failure_and_log_line(app, stack, tmp_path / "w.log", "json-w", "--log-format", "json")
    check_job_events(lines, failing, chatty, "json-w")


def test_worker_json_log_from_the_environment_in_a_loop_child(app, stack, tmp_path):
    lines, failing, chatty = run_failure_and_log_line(app, stack, tmp_path / "w.log", "json-env", "--threads", "2",
                                                      env={"TASKRUNNER_LOG_FORMAT": "json"})
    check_job_events(lines, failing, chatty, "json-env")


def test_dispatcher_json_log_names_the_job_it_requeues(app, stack, tmp_path):
    w = stack.worker(name="doomed", concurrency=1)
    job = apps.hold.delay("d1")
    wait_for(lambda: job.refresh().state == "running", what="the job to start")
    os.killpg(w.pid, signal.SIGKILL)
    w.wait()
    path = tmp_path / "d.log"
    d = spawn_logged(stack, path, "dispatcher", "-A", "tests.apps", "--log-format", "json")
    wait_for(lambda: job.refresh().state == "pending", what="the job to be requeued")
    stop(d)
    lines = parsed(path)
    lost = [x for x in lines if x.get("job_id") == job.id]
    assert len(lost) == 1 and "lost its process" in lost[0]["message"], lines
    assert {k: lost[0][k] for k in JOB_FIELDS} == {"job_id": job.id, "task": apps.hold.name, "queue": "default",
                                                   "attempt": 1, "worker": "doomed"}



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_of(url: str) -> int | None:
    """The HTTP status of GET url; None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


@pytest.mark.parametrize("server", ["gunicorn", "taskrunner"])
def test_dashboard_json_log_under_gunicorn_and_the_development_server(stack, tmp_path, server):
    """Redis is down: the dashboard's page logs a warning; gunicorn's own lines (and its
    access lines, on stdout) and the development server's are JSON objects too."""
    env = {**stack.env, "REDIS_URL": f"redis://127.0.0.1:{free_port()}", "TASKRUNNER_APP": "tests.apps",
           "TASKRUNNER_LOG_FORMAT": "json"}
    port = free_port()
    args = (["gunicorn", "-c", "python:dashboard.gunicorn_conf", "-w", "1", "-b", f"127.0.0.1:{port}",
             "--access-logfile", "-", "dashboard:create_app()"] if server == "gunicorn"
            else ["taskrunner", "dashboard", "--port", str(port)])
    err, out = tmp_path / "err", tmp_path / "out"
    with err.open("w") as e, out.open("w") as o:
        p = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, start_new_session=True, stdout=o,
                             stderr=e)
    stack.procs.append(p)
    assert wait_for(lambda: p.poll() is not None or status_of(f"http://127.0.0.1:{port}/"),
                    what=f"{server} to answer") == 503
    wait_for(lambda: "taskrunner.dashboard" in err.read_text(), what="the warning")
    p.send_signal(signal.SIGTERM)
    p.wait(30)
    lines = parsed(err)
    assert any(x["logger"] == "taskrunner.dashboard" and x["level"] == "WARNING" for x in lines), lines
    if server == "gunicorn":
        assert any(x["logger"] == "gunicorn.error" for x in lines), lines
        assert any(x["logger"] == "gunicorn.access" for x in parsed(out)), out.read_text()
    else:
        assert any(x["logger"] == "werkzeug" for x in lines), lines
