"""Fixtures: a real redis-server per session (and per module where a test restarts it),
real worker and dispatcher processes, each stopped by the test that started it."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from taskrunner import TaskRunner
from taskrunner.ops.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
#: Settings that make failures show up in a test's lifetime.
FAST = {
    "TASKRUNNER_HEARTBEAT": "0.2",
    "TASKRUNNER_DEAD_AFTER": "1.5",
    "TASKRUNNER_DISPATCH_INTERVAL": "0.1",
    "TASKRUNNER_KILL_GRACE": "1",
    "TASKRUNNER_SHUTDOWN_GRACE": "5",
    "TASKRUNNER_IDLE_BLOCK": "1",
    "TASKRUNNER_STUCK_RECHECK": "1",
    "TASKRUNNER_HISTORY_INTERVAL": "0",  # tests that archive say where
}
_prefixes = itertools.count()


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll until cond() is truthy; fail with `what` after a generous deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def until_logged(p: subprocess.Popen, text: str) -> None:
    """Read a process's output until a line has `text` (each signal must be seen before
    the next is sent: two pending at once are handled as one)."""
    wait_for(lambda: text in p.stdout.readline(), what=repr(text))


#: Test files that run Spark (a JVM each, heavy on 2 cores), by the pytest process that runs
#: their group: at most two JVM-heavy files at once (the groups' lengths are about even).
JVM_FILES = {"test_analyze.py": "jvm-1", "test_spark_enqueue.py": "jvm-2", "test_spark_tasks.py": "jvm-2"}


def pytest_configure(config: pytest.Config) -> None:
    """The processes the tests start take Ctrl-C and Ctrl-\\ as a terminal's foreground
    command does, however the suite was started. A shell starts a background command of a
    script (`make test &`, nohup) with SIGINT and SIGQUIT ignored, which every process
    started inherits, and Python then installs no KeyboardInterrupt: `taskrunner wait` was
    deaf to test_ctrl_c_exits_130's SIGINT, and the test hung 30 s and failed."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without it (-p no:xdist) must still collect
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs 4 pytest processes (pytest-xdist): each test file goes whole to one
    of them (its module fixtures made once, as --dist loadfile does), and the JVM_FILES of a
    group to the same one, so that no more than two JVM-heavy tests compete for the cores
    (three at once under load outlived pytest-timeout, and a Py4J call cut off there broke
    the rest of the file)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return JVM_FILES.get(Path(path).name, path)

    return ByFile(config, log)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


class SparkCluster:
    """A Spark standalone master and one worker (2 cores, 2 GB), from pyspark's own scripts,
    on loopback: `master` is its spark:// URL, `status()` the master's JSON status page."""

    def __init__(self, root: Path) -> None:
        import pyspark

        self.root, self.home = root, os.path.dirname(pyspark.__file__)
        self.env = {**os.environ, "SPARK_HOME": self.home, "SPARK_LOCAL_IP": "127.0.0.1",
                    "PYSPARK_PYTHON": sys.executable}
        self.port, self.ui_port = free_port(), free_port()
        self.master = f"spark://127.0.0.1:{self.port}"
        self.logs = {name: root / f"{name}.log" for name in ("master", "worker")}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> SparkCluster:
        self._spawn("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                    str(self.port), "--webui-port", str(self.ui_port))
        wait_for(lambda: "I have been elected leader" in self.logs["master"].read_text(), 90, "the Spark master up")
        self._spawn("worker", "org.apache.spark.deploy.worker.Worker", self.master, "--host", "127.0.0.1",
                    "--cores", "2", "--memory", "2g", "--webui-port", str(free_port()))
        wait_for(lambda: "Successfully registered with master" in self.logs["worker"].read_text(), 90,
                 "the Spark worker registered")
        return self

    def _spawn(self, name: str, *args: str) -> None:
        self.procs.append(subprocess.Popen([os.path.join(self.home, "bin", "spark-class"), *args], env=self.env,
                                           stdout=self.logs[name].open("w"), stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def status(self) -> dict[str, Any]:
        """The master's status (GET /json/): its workers, active and completed applications."""
        import json
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=10) as r:
            return json.load(r)

    def stop(self) -> None:
        kill_groups(self.procs)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory):
    """One Spark standalone cluster for the tests of a process that ask for it (its JVMs
    take 10-20 s to start on 2 cores: not one per test); they run their applications one
    at a time."""
    cluster = SparkCluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class Stack:
    """Starts worker/dispatcher processes in their own process groups; stops them all."""

    def __init__(self, app: TaskRunner, url: str):
        self.app, self.url = app, url
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, **FAST, "REDIS_URL": url, "TASKRUNNER_PREFIX": app.settings.prefix,
                    "PYTHONPATH": str(ROOT)}

    def spawn(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "taskrunner", *args], cwd=ROOT, env={**self.env, **(env or {})},
                             start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def worker(self, *args: str, app: str = "tests.apps", concurrency: int = 2, name: str | None = None,
               env: dict[str, str] | None = None) -> subprocess.Popen:
        extra = ["-n", name] if name else []
        return self.spawn("worker", "-A", app, "-c", str(concurrency), *extra, *args, env=env)

    def dispatcher(self, app: str = "tests.apps", env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.spawn("dispatcher", "-A", app, env=env)

    def cli(self, *args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "taskrunner", *args], cwd=ROOT, env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"taskrunner {' '.join(args)} exited {r.returncode}: {r.stderr}")
        return r

    def ended_jobs(self) -> dict[str, Any]:
        """A job of each end a kill can find — killed (while pending), completed, failed —
        the last two run by a worker of this stack: {state: Job}."""
        from taskrunner.errors import JobFailed
        from tests import apps

        killed = apps.add.delay(1, 2)
        assert killed.kill("tests") == "killed"
        self.worker(concurrency=1)
        completed, failed = apps.add.delay(2, 3), apps.boom.delay("on purpose")
        assert completed.wait(30) == 5
        with pytest.raises(JobFailed):
            failed.wait(30)
        return {"killed": killed, "completed": completed, "failed": failed}

    def children_of(self, p: subprocess.Popen) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process(p.pid).children()]

    def stop(self) -> None:
        kill_groups(self.procs)


def kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the process group of each process still running (each started in its own
    session), and reap them all."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


@pytest.fixture
def app(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> TaskRunner:
    """The tests' app (tests/apps.py) on a fresh key prefix of the session's Redis."""
    prefix = f"t{os.getpid()}x{next(_prefixes)}"
    for k, v in FAST.items():
        monkeypatch.setenv(k, v)
    from taskrunner.config import Settings
    from tests import apps

    apps.app.settings = Settings.from_env()  # the same fast settings as the processes started
    apps.app.configure(redis_url=redis_server.url, prefix=prefix)
    return apps.app


@pytest.fixture
def stack(app: TaskRunner, redis_server: RedisServer):
    s = Stack(app, redis_server.url)
    yield s
    s.stop()
