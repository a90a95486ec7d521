"""taskrunner as users install it, not this checkout: a wheel built from the source tree and
installed into fresh virtualenvs (the core alone; with the dashboard extra), and the
repository installed from requirements.txt alone and run by its Procfile under honcho, as
Heroku's Python buildpack does. Every process runs from its virtualenv, outside the
checkout, with no PYTHONPATH. The wheel and the virtualenvs are built once per session (the
packages come from pip's cache)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from taskrunner import TaskRunner
from taskrunner.client.consumer import Consumer
from taskrunner.ops.redis_server import RedisServer
from tests.conftest import FAST, ROOT, kill_groups, wait_for
from tests.topologies import free_port

#: What a fresh clone would not have: build leftovers, virtualenvs, caches.
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "var",
                                     "test-artifacts", ".pytest_cache", ".ruff_cache", "node_modules")
#: Parts of the dashboard that only the `dashboard` extra brings (and the other extras' parts).
EXTRA_MODULES = ("flask", "gunicorn", "pyarrow", "pyspark")


def _run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-3000:]}")
    return r


def _source(dest: Path) -> Path:
    """The repository as a fresh clone has it."""
    shutil.copytree(ROOT, dest, ignore=_NOT_SOURCE)
    return dest


def _venv(path: Path, *requirements: str, cwd: Path | None = None) -> Path:
    """A fresh virtualenv at `path` with `requirements` installed (pip arguments); its bin/."""
    _run(sys.executable, "-m", "venv", "--without-pip", path)
    _run(sys.executable, "-m", "pip", "--python", path / "bin" / "python", "install", "-q", *requirements, cwd=cwd)
    return path / "bin"


def _clean_env(bin_dir: Path, **more: str) -> dict[str, str]:
    """The environment of a process on a machine where only this virtualenv is installed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TASKRUNNER_", "PYTHON", "VIRTUAL_ENV", "REDIS_URL", "PORT"))}
    return {**env, "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", **more}


def _modules(bin_dir: Path, env: dict[str, str], cwd: Path) -> dict[str, str | None]:
    """Where the virtualenv's Python finds taskrunner, dashboard and the extras' modules."""
    code = ("import importlib.util, json, sys; print(json.dumps({m: (s.origin if (s := importlib.util.find_spec(m))"
            " else None) for m in sys.argv[1:]}))")
    out = _run(bin_dir / "python", "-c", code, "taskrunner", "dashboard", *EXTRA_MODULES, cwd=cwd, env=env)
    return json.loads(out.stdout)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel `pip wheel` builds from a fresh copy of the source tree, and pip's verbose log
    of the build (the setuptools output)."""
    src = _source(tmp_path_factory.mktemp("wheel") / "src")
    out = src.parent / "dist"
    r = _run(sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", out, src)
    (built,) = out.glob("taskrunner-*.whl")
    return built, r.stdout + r.stderr


@pytest.fixture(scope="session")
def core_bin(wheel: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install taskrunner`: the wheel without extras."""
    return _venv(tmp_path_factory.mktemp("core") / "venv", str(wheel[0]))


@pytest.fixture(scope="session")
def dashboard_bin(wheel: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install 'taskrunner[dashboard]'`."""
    return _venv(tmp_path_factory.mktemp("dashboard") / "venv", f"{wheel[0]}[dashboard]")


class Processes:
    """Processes a test starts, each in its own session; stop() kills whatever is left."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd, self.env = cwd, env
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str | Path, log: str) -> subprocess.Popen:
        with open(self.cwd / log, "w") as out:
            p = subprocess.Popen([str(a) for a in args], cwd=self.cwd, env=self.env, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        return (self.cwd / name).read_text()

    def stop(self) -> None:
        kill_groups(self.procs)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path, {})
    yield procs
    procs.stop()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _answers(url: str) -> bool:
    """Whether an HTTP server answers there (any status)."""
    try:
        _get(url)
        return True
    except OSError:
        return False


# -- the wheel -------------------------------------------------------------------------------


def test_wheel_carries_templates_static_and_scripts_and_builds_without_warnings(wheel: tuple[Path, str]) -> None:
    built, log = wheel
    names = set(zipfile.ZipFile(built).namelist())
    data = [*(ROOT / "dashboard" / "templates").iterdir(), *(ROOT / "dashboard" / "static").iterdir(),
            *(ROOT / "taskrunner" / "protocol" / "scripts").glob("*.lua")]
    assert data and all(f.is_file() for f in data)
    missing = [str(f.relative_to(ROOT)) for f in data if str(f.relative_to(ROOT)) not in names]
    assert not missing, f"not in the wheel: {missing}"
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "bench/"))]
    # setuptools' warnings about data directories that are not listed as packages
    warnings = [line for line in log.splitlines() if re.search(r"_Warning|would be ignored|as data is deprecated",
                                                                line)]
    assert not warnings, "\n".join(warnings)


def test_installed_dashboard_serves_every_page_json_route_and_static_file(
        dashboard_bin: Path, app: TaskRunner, redis_server: RedisServer, processes: Processes) -> None:
    job = app.enqueue("tests.apps.add", [1, 2])  # nobody runs it: a pending job to show
    port = free_port()
    processes.env = env = _clean_env(dashboard_bin, REDIS_URL=redis_server.url,
                                     TASKRUNNER_PREFIX=app.settings.prefix, TASKRUNNER_DASHBOARD_PASSWORD="pw")
    found = _modules(dashboard_bin, env, processes.cwd)
    venv = str(dashboard_bin.parent)
    assert found["dashboard"].startswith(venv) and found["taskrunner"].startswith(venv), found
    assert found["flask"] and found["gunicorn"] and not found["pyarrow"], found
    # every GET route the installed dashboard has, from its own URL map
    code = ("import json; from dashboard import create_app; print(json.dumps(sorted(r.rule for r in "
            "create_app().url_map.iter_rules() if 'GET' in r.methods)))")
    rules = json.loads(_run(dashboard_bin / "python", "-c", code, cwd=processes.cwd, env=env).stdout)
    assert {"/", "/running", "/jobs/<job_id>", "/api/overview", "/static/<path:filename>"} <= set(rules), rules
    values = {"name": "default", "job_id": job.id}
    server = processes.start(dashboard_bin / "taskrunner", "dashboard", "--port", str(port), log="dashboard.log")
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: server.poll() is not None or _answers(base + "/"), 60, "the dashboard to answer")
    assert server.poll() is None, processes.log("dashboard.log")

    urls = []
    for rule in rules:
        if rule.startswith("/static/"):
            continue
        unknown = set(re.findall(r"<(?:\w+:)?(\w+)>", rule)) - set(values)
        assert not unknown, f"{rule}: give this test a value for {unknown}"
        urls.append(re.sub(r"<(?:\w+:)?(\w+)>", lambda m: values[m.group(1)], rule)
                    + ("?q=add" if rule.endswith("/search") else ""))  # a search needs something to look for
    urls += ["/?fragment=1", "/running?fragment=1", "/stuck?fragment=1", "/failed?state=killed",
             "/queues/default?state=completed"]
    pages: dict[str, bytes] = {}
    # /readyz wants a dispatcher that passed lately: one that says so
    app.redis.hset(app.keys.dispatchers, "d", json.dumps({"name": "d", "last_pass": app.redis.time()[0] + 60}))
    Consumer(app, ["default"], name="default").heartbeat()  # /workers/<name>: a live one of that name
    for url in urls:
        status, body = _get(base + url)
        assert status == 200 and b"TemplateNotFound" not in body, f"GET {url}: {status} {body[:300]!r}"
        pages[url] = body
    status, body = _get(base + "/jobs/no-such-job")  # error.html
    assert status == 404 and b"no-such-job" in body, body[:300]

    static = ROOT / "dashboard" / "static"
    linked = {m for body in pages.values() for m in re.findall(rb'(?:href|src)="/static/([^"?]+)', body)}
    assert linked, "no page links a static file"
    for name in {f.name for f in static.iterdir()} | {n.decode() for n in linked}:
        status, body = _get(f"{base}/static/{name}")
        assert status == 200 and body == (static / name).read_bytes(), f"/static/{name}: {status}"
    assert "TemplateNotFound" not in processes.log("dashboard.log")


# -- the core install ------------------------------------------------------------------------

CORE_APP = '''\
from taskrunner import TaskRunner

app = TaskRunner("core")


@app.task
def add(a, b):
    return a + b
'''


def test_core_install_runs_a_job_without_flask_gunicorn_or_pyarrow(
        core_bin: Path, app: TaskRunner, redis_server: RedisServer, processes: Processes) -> None:
    (processes.cwd / "coreapp.py").write_text(CORE_APP)
    processes.env = env = _clean_env(core_bin, **{**FAST, "TASKRUNNER_HISTORY_INTERVAL": "0.1"},
                                     REDIS_URL=redis_server.url, TASKRUNNER_PREFIX=app.settings.prefix)
    found = _modules(core_bin, env, processes.cwd)
    assert found["taskrunner"].startswith(str(core_bin.parent)), found
    assert not [m for m in EXTRA_MODULES if found[m]], found

    processes.start(core_bin / "taskrunner", "worker", "-A", "coreapp", "-c", "1", log="worker.log")
    dispatcher = processes.start(core_bin / "taskrunner", "dispatcher", "-A", "coreapp", log="dispatcher.log")
    job = app.enqueue("coreapp.add", [2, 3])
    wait_for(lambda: job.state == "completed", 60, f"the job to complete:\n{processes.log('worker.log')}")
    assert job.refresh().result == 5

    # archiving is off, said once, and the dispatcher goes on with its passes
    def passes() -> int:
        raw = app.redis.hget(app.keys.dispatchers, f"{socket.gethostname()}.{dispatcher.pid}")
        return json.loads(raw)["passes"] if raw else 0

    wait_for(lambda: passes() >= 20, 60, f"dispatcher passes:\n{processes.log('dispatcher.log')}")
    dispatcher.send_signal(signal.SIGTERM)
    assert dispatcher.wait(30) == 0
    lines = processes.log("dispatcher.log").splitlines()
    notices = [line for line in lines if "not archived" in line]
    assert len(notices) == 1 and "pip install 'taskrunner[history]'" in notices[0], lines
    assert not [line for line in lines if "Traceback" in line or "failed" in line], lines


@pytest.mark.parametrize(("command", "extra"), [
    (["dashboard"], "dashboard"), (["up", "--demo"], "dashboard"), (["history", "archive"], "history"),
    (["analyze"], "spark")])
def test_core_install_commands_name_the_extra_they_need(core_bin: Path, redis_server: RedisServer,
                                                        tmp_path: Path, command: list[str], extra: str) -> None:
    env = _clean_env(core_bin, REDIS_URL=redis_server.url, TASKRUNNER_PREFIX=f"x{uuid.uuid4().hex[:8]}")
    r = subprocess.run([core_bin / "taskrunner", *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
    assert r.stderr.startswith("Error: ") and f"pip install 'taskrunner[{extra}]'" in r.stderr, r.stderr
    assert not (tmp_path / "var").exists()  # `up` started no Redis before saying so


def test_core_install_history_status_works(core_bin: Path, redis_server: RedisServer, tmp_path: Path) -> None:
    env = _clean_env(core_bin, REDIS_URL=redis_server.url, TASKRUNNER_PREFIX=f"x{uuid.uuid4().hex[:8]}")
    r = _run(core_bin / "taskrunner", "history", "status", "--json", cwd=tmp_path, env=env)
    assert json.loads(r.stdout) == {}


# -- a Heroku-style deploy -------------------------------------------------------------------


@pytest.fixture(scope="session")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """What Heroku's Python buildpack does with this repository: install requirements.txt,
    and nothing else, from the app's root. The app directory and the virtualenv's bin/."""
    src = _source(tmp_path_factory.mktemp("heroku") / "app")
    return src, _venv(src.parent / "venv", "-r", "requirements.txt", cwd=src)


def test_repository_is_deployable_as_it_is() -> None:
    """The files the buildpack and the deploy button read."""
    version = (ROOT / ".python-version").read_text().strip()
    assert re.fullmatch(r"3\.\d+", version) and int(version.split(".")[1]) >= 10, version
    types = [line.split(":")[0] for line in (ROOT / "Procfile").read_text().splitlines() if line.strip()]
    spec = json.loads((ROOT / "app.json").read_text())
    assert sorted(spec["formation"]) == sorted(types) == ["dispatcher", "web", "worker"]
    assert spec["env"]["TASKRUNNER_DASHBOARD_PASSWORD"]["required"] is True  # web binds 0.0.0.0


def test_procfile_under_honcho_serves_runs_a_job_and_stops_cleanly_on_sigterm(
        deployed: tuple[Path, Path], app: TaskRunner, redis_server: RedisServer, tmp_path: Path) -> None:
    src, bin_dir = deployed
    port, marker = free_port(), uuid.uuid4().hex
    # As the platform sets it: PORT, REDIS_URL, the config vars; TASKRUNNER_APP unset (the demo)
    env = _clean_env(bin_dir, PORT=str(port), REDIS_URL=redis_server.url, TASKRUNNER_PREFIX=app.settings.prefix,
                     TASKRUNNER_DASHBOARD_PASSWORD="pw", TASKRUNNER_DASHBOARD_PROXIES="1", DEPLOY_MARKER=marker)
    found = _modules(bin_dir, env, tmp_path)
    assert found["dashboard"].startswith(str(bin_dir.parent)) and not found["pyarrow"], found

    def ours() -> list[psutil.Process]:
        """Every process of this deploy, found by the marker in its environment."""
        procs = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("DEPLOY_MARKER") == marker:
                    procs.append(p)
            except (psutil.Error, OSError):
                pass
        return procs

    with open(tmp_path / "honcho.log", "w") as out:
        honcho = subprocess.Popen([sys.executable, "-m", "honcho", "start"], cwd=src, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log = lambda: (tmp_path / "honcho.log").read_text()  # noqa: E731
    try:
        wait_for(lambda: honcho.poll() is not None or _answers(f"http://127.0.0.1:{port}/"), 60,
                 "the web process on $PORT")
        assert honcho.poll() is None, log()
        status, body = _get(f"http://127.0.0.1:{port}/")
        assert status == 200 and b"taskrunner <span>demo</span>" in body, body[:300]  # the demo app, by default
        job = app.enqueue("taskrunner.demo.add", [1, 2])
        wait_for(lambda: job.state == "completed", 60, f"the demo job:\n{log()}")
        assert job.refresh().result == 3

        running = app.enqueue("taskrunner.demo.sleep", [3])
        wait_for(lambda: running.state == "running", 60, f"the job to start:\n{log()}")
        # Its SIGTERM handler is set before it logs its start: a dispatcher still importing
        # (a loaded machine) dies of the signal, with nothing to stop yet.
        wait_for(lambda: re.search(r"dispatcher \S+: every", log()), 60, f"the dispatcher to start:\n{log()}")
        procs = ours()
        assert len(procs) >= 8, procs  # honcho; web: gunicorn and 2 workers; worker and 2 children; dispatcher
        # The platform sends SIGTERM to every process, once: honcho does so to each process
        # group (a process that got two would take the second as "hurry up").
        honcho.send_signal(signal.SIGTERM)
        gone, alive = psutil.wait_procs(procs, timeout=30)
        assert not alive, f"still running 30 s after SIGTERM: {alive}\n{log()}"
        assert honcho.wait(5) is not None and not ours(), "orphans"
        assert running.state == "completed" and running.refresh().result == 3, log()
        assert "Traceback" not in log() and "stop now" not in log(), log()
        for stopped in (r"worker \S+: stopped after", r"dispatcher \S+: stopped after", r"Shutting down: Master"):
            assert re.search(stopped, log()), log()
    finally:
        for p in ours():
            p.kill()
        if honcho.poll() is None:
            honcho.kill()
        honcho.wait()
