"""taskrunner vs Celery, RQ and Dramatiq, side by side, on one redis-server of our own.

    make bench                      # or: python bench/bench.py
    make bench ARGS=--quick         # N=2000, 1 repeat
    python bench/bench.py --only taskrunner,rq --json /tmp/bench.json

Metrics (each repeated --repeat times; the table shows median and min-max):
  1. enqueue one at a time from one process, jobs/s; plus redis-py EVALSHA of `return 1`
     on one connection as the reference of what one round trip costs; and in batches
     (enqueue_many, 1000 jobs per round trip: taskrunner and RQ, the systems that have one);
  2. drain: --jobs no-op jobs enqueued first, then 2 worker processes started; seconds
     from starting them to the last completion (each job appends a byte to a file;
     --recorder redis: INCRs a counter in Redis instead, the method before 2026-11-21);
  3. pickup latency: idle workers, 200 jobs enqueued 20 ms apart, start - enqueue in ms;
  4. taskrunner only: the job of a SIGKILLed worker running again on a new worker;
  5. Redis work per job during the drain: commands, and Redis CPU per 1000 jobs;
     beside it (--metrics rt) the same drain with each job making one Redis round trip (an INCR:
     the redis recorder), and (io) jobs of 20 ms each at --io-concurrency, run unbatched
     (taskrunner: a child per concurrent job; RQ: a worker process each; Dramatiq and Celery:
     2 processes of threads), as bench/io_bound.py runs them: jobs/s and Redis CPU per job.

    python -m bench.bench --cluster [OPTIONS]   # one hot queue: a sharded queue on a local
                                                # 3-primary cluster vs one server (bench/cluster.py)

The peers run from their own virtualenv, bench/.venv-peers, made here on first use.
Every process started here runs in its own session and is killed as a group at the end;
every wait has a deadline, and the whole run stops after --max-time seconds."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
VENV = BENCH / ".venv-peers"
PEERS_BIN = VENV / "bin"
RESULTS = BENCH / "results"
LOGS = RESULTS / "logs"

SYSTEMS = ("taskrunner", "celery", "rq", "dramatiq")
BATCH_SYSTEMS = ("taskrunner", "rq")  # those with a batch enqueue call
#: The versions measured in docs/PERFORMANCE.md. Unpinned, pip's resolver (2026-11-26) went back
#: through every celery and kombu release for one that agrees with the newest arq on redis-py,
#: down to kombu 3, whose setup.py no longer builds: `make bench` failed on a fresh machine.
PEER_PACKAGES = ["celery[redis]==5.7.0", "rq", "dramatiq[redis]==2.2.1", "arq==0.25.0", "redis[hiredis]"]
#: Each peer's distribution, importable under the same name (arq: only in bench/io_bound.py).
PEER_MODULES = {"celery": "celery", "rq": "rq", "dramatiq": "dramatiq", "arq": "arq"}

sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402
from bench.limits import stop_after  # noqa: E402


class BenchError(Exception):
    pass


class BenchTimeout(BenchError):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- processes -------------------------------------------------------------------------------


def exited(p: subprocess.Popen) -> bool:
    """Has the leader exited? Without reaping it: while it is a zombie its PID, and so its
    group ID, cannot be reused, and killpg cannot hit a stranger."""
    if p.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class Procs:
    """Every process we start: each in its own session (so its group is its own),
    killed as a group."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict[str, str], logfile: Path) -> subprocess.Popen:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(logfile, "ab") as out:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.live.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 10.0, sig: int | None = signal.SIGTERM) -> bool:
        """Signal the group (sig None: already done), give the leader `grace` seconds, then
        SIGKILL the whole group (whatever is left of it) and reap the leader. True if it
        ended without SIGKILL."""
        clean = True
        if not exited(p):
            if sig is not None:
                self._killpg(p, sig)
            deadline = time.monotonic() + grace
            while not exited(p) and time.monotonic() < deadline:
                time.sleep(0.05)
            clean = exited(p) or sig == signal.SIGKILL
        if p.returncode is None:
            self._killpg(p, signal.SIGKILL)  # stray children of the group too
            p.wait()
        if p in self.live:
            self.live.remove(p)
        return clean

    @staticmethod
    def _killpg(p: subprocess.Popen, sig: int) -> None:
        if p.returncode is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_all(self, grace: float = 5.0) -> None:
        for p in list(self.live):
            self._killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in list(self.live):
            while not exited(p) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.stop(p, grace=0, sig=signal.SIGKILL)


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.01,
             procs: list[subprocess.Popen] | None = None) -> float:
    """Poll `check` until true; fail after `timeout` s or when one of `procs` has exited.
    Returns time.monotonic() when it became true."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return time.monotonic()
        for p in procs or []:
            if exited(p):  # not reaped: its group is killed safely later
                raise BenchError(f"{what}: a process exited early ({' '.join(map(str, p.args))[:120]})")
        if time.monotonic() > deadline:
            raise BenchTimeout(f"{what}: not done within {timeout:.0f}s")
        time.sleep(interval)


# -- the systems -----------------------------------------------------------------------------


@dataclass
class Env:
    socket: str
    procs: Procs
    timeout: float
    tr_python: str = sys.executable
    peers_python: str = str(PEERS_BIN / "python")
    heartbeat: float = 1.0
    dead_after: float = 5.0

    def base(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("TASKRUNNER_APP", None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        env[record.SOCKET_ENV] = self.socket
        env["REDIS_URL"] = f"unix://{self.socket}"
        env["TASKRUNNER_PREFIX"] = "trbench"
        return env

    def python(self, system: str) -> str:
        return self.tr_python if system in ("taskrunner", "evalsha") else self.peers_python

    def drive(self, system: str, *args: Any, timeout: float | None = None) -> dict[str, Any]:
        """Run bench/driver.py with the system's interpreter; its JSON answer."""
        cmd = [self.python(system), "-m", "bench.driver", system, *map(str, args)]
        logfile = LOGS / f"driver-{system}.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(logfile, "ab") as err:
            p = subprocess.Popen(cmd, cwd=ROOT, env=self.base(), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=err, start_new_session=True)
            self.procs.live.append(p)
            try:
                out, _ = p.communicate(timeout=timeout or self.timeout)
            except subprocess.TimeoutExpired:
                raise BenchTimeout(f"driver {system} {' '.join(map(str, args))}: not done within "
                                   f"{timeout or self.timeout:.0f}s") from None
            finally:
                self.procs.stop(p, grace=2)
        if p.returncode != 0:
            raise BenchError(f"driver {system} {' '.join(map(str, args))} exited {p.returncode}; see {logfile}")
        return json.loads(out.decode().strip().splitlines()[-1])

    def start_workers(self, system: str, tag: str, extra_env: dict[str, str] | None = None,
                      concurrency: int = 2) -> list[subprocess.Popen]:
        """Two worker processes' worth of the system (see WORKERS in the report)."""
        env = {**self.base(), **(extra_env or {})}
        logfile = LOGS / f"{system}-{tag}.log"
        if system == "taskrunner":
            cmds = [[self.tr_python, "-m", "taskrunner", "worker", "-A", "bench.tasks_taskrunner",
                     "-c", str(concurrency), "--log-level", "warning"]]
        elif system == "celery":
            cmds = [[str(PEERS_BIN / "celery"), "-A", "bench.tasks_celery", "worker", "-P", "prefork",
                     "-c", str(concurrency), "--loglevel", "WARNING", *CELERY_FLAGS]]
        elif system == "rq":
            cmds = [[str(PEERS_BIN / "rq"), "worker", "--url", f"unix://{self.socket}",
                     "--worker-class", "rq.worker.SimpleWorker", "--logging_level", "WARNING", "default"]
                    for _ in range(concurrency)]
        elif system == "dramatiq":
            cmds = [[str(PEERS_BIN / "dramatiq"), "bench.tasks_dramatiq", "--processes", str(concurrency),
                     "--threads", "8"]]
        else:
            raise ValueError(system)
        return [self.procs.start(cmd, env, logfile) for cmd in cmds]

    def start_dispatcher(self, tag: str, extra_env: dict[str, str], other_host: bool = False) -> subprocess.Popen:
        """other_host: in a UTS namespace of its own with another hostname, so that it
        cannot check the worker's PID and only the heartbeat tells (as across hosts)."""
        cmd = [self.tr_python, "-m", "taskrunner", "dispatcher", "-A", "bench.tasks_taskrunner", "--log-level", "info"]
        if other_host:
            cmd = [*UNSHARE, 'hostname "$0" && exec "$@"', OTHER_HOST, *cmd]
        return self.procs.start(cmd, {**self.base(), **extra_env}, LOGS / f"taskrunner-dispatcher-{tag}.log")

    def stop_workers(self, workers: list[subprocess.Popen], what: str, sig: int = signal.SIGTERM,
                     grace: float = 10.0) -> None:
        """One signal to every group at once, then up to `grace` s before SIGKILL."""
        for p in workers:
            self.procs._killpg(p, sig)
        for p in workers:
            if not self.procs.stop(p, grace=grace, sig=None) and sig != signal.SIGKILL:
                log(f"  note: {what} did not stop within {grace:.0f}s of {signal.Signals(sig).name}; SIGKILLed")


UNSHARE = ["unshare", "--uts", "sh", "-c"]
OTHER_HOST = "bench-other-host"


def can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run([*UNSHARE, 'hostname "$0"', OTHER_HOST], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


CELERY_FLAGS = ["--without-gossip", "--without-mingle", "--without-heartbeat"]
WORKERS = {
    "taskrunner": "taskrunner worker -c 2 (1 worker process + 2 child processes)",
    "celery": "celery worker -P prefork -c 2 " + " ".join(CELERY_FLAGS) + " (no result backend)",
    "rq": "2 x rq worker --worker-class rq.worker.SimpleWorker",
    "dramatiq": "dramatiq --processes 2 --threads 8",
}


# -- Redis bookkeeping -----------------------------------------------------------------------


@dataclass
class Snapshot:
    commands: int
    cpu: float  # seconds
    net: int  # bytes in + out
    stats: dict[str, int]
    reads: int  # reads of client input: a pipelined batch is one, however many commands it holds

    @classmethod
    def take(cls, r: redis.Redis) -> Snapshot:
        info = r.info("all")
        stats = {k[len("cmdstat_"):]: int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_")}
        return cls(int(info["total_commands_processed"]), float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                   int(info["total_net_input_bytes"]) + int(info["total_net_output_bytes"]), stats,
                   int(info["total_reads_processed"]))


@dataclass
class Series:
    """One metric's values for one system, one per repeat."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    fmt: str = "{:,.0f}"
    group: str = "drain"
    short: str = ""


METRICS = [
    Metric("enqueue_rate", "1. enqueue, one at a time", "jobs/s", True, group="enqueue", short="enqueue rate"),
    Metric("batch_rate", "   enqueue in batches (enqueue_many)", "jobs/s", True, group="batch",
           short="batch enqueue rate"),
    Metric("drain_seconds", "2. drain {jobs} no-op jobs (incl. worker start)", "s", False, "{:,.2f}",
           short="drain time"),
    Metric("drain_rate", "   drain throughput", "jobs/s", True, short="drain throughput"),
    Metric("rt_drain_rate", "   drain throughput, each job one Redis round trip (INCR)", "jobs/s", True, group="rt",
           short="drain, 1 round trip/job"),
    Metric("io_rate", "   {io_c}-way, 20 ms jobs, unbatched (last 80%)", "jobs/s", True, group="io",
           short="20 ms jobs throughput"),
    Metric("latency_p50", "3. pickup latency, idle workers, p50", "ms", False, "{:,.1f}", "latency",
           "pickup latency p50"),
    Metric("latency_p99", "   pickup latency, idle workers, p99", "ms", False, "{:,.1f}", "latency",
           "pickup latency p99"),
    Metric("redis_cmds_per_job", "5. Redis commands per job (drain)", "cmds", False, "{:,.1f}",
           short="Redis commands per job"),
    Metric("redis_scripts_per_job", "   of which Lua script calls (EVALSHA...)", "calls", False, "{:,.2f}",
           short="-"),
    Metric("redis_bytes_per_job", "   Redis network bytes in+out per job (drain)", "B", False, "{:,.0f}",
           short="Redis bytes per job"),
    Metric("redis_cpu_per_1000", "   Redis CPU per 1000 jobs (drain)", "ms", False, "{:,.1f}",
           short="Redis CPU per 1000 jobs"),
    Metric("rt_redis_cpu_per_1000", "   Redis CPU per 1000 jobs (drain, 1 round trip/job)", "ms", False, "{:,.1f}",
           group="rt", short="Redis CPU, round trip"),
    Metric("io_redis_cpu_per_1000", "   Redis CPU per 1000 jobs ({io_c}-way, 20 ms jobs, unbatched)", "ms", False,
           "{:,.1f}", group="io", short="Redis CPU, 20 ms jobs"),
]
#: The io metrics start a process per concurrent job for taskrunner and RQ (bench/io_bound.py's MAX_CHILDREN).
MAX_IO_CONCURRENCY = 64
GROUPS = ("enqueue", "batch", "drain", "rt", "io", "latency", "recovery")
#: The system of bench/io_bound.py that runs each system's 20 ms jobs for the io metrics: one job per
#: process or thread at a time, as real jobs come (taskrunner: a child per concurrent job).
IO_SYSTEMS = {"taskrunner": "taskrunner-processes", "celery": "celery", "rq": "rq", "dramatiq": "dramatiq"}
SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


@contextmanager
def recording(name: str) -> Iterator[None]:
    """No-op jobs record their runs with `name` (record.RECORDERS) in what starts meanwhile
    (and in record.count() here)."""
    before = os.environ.get(record.RECORDER_ENV)
    os.environ[record.RECORDER_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(record.RECORDER_ENV, None)
        else:
            os.environ[record.RECORDER_ENV] = before


def flush(r: redis.Redis) -> None:
    """A clean slate before each run: no keys, command statistics zeroed, no job recorded."""
    r.flushall()
    r.config_resetstat()
    record.reset()


class Bench:
    def __init__(self, args: argparse.Namespace, env: Env, r: redis.Redis) -> None:
        self.a, self.env, self.r = args, env, r
        self.rdb = redis.Redis(unix_socket_path=env.socket, db=record.BENCH_DB)
        self.results: dict[str, dict[str, Series]] = {}
        self.failures: dict[tuple[str, str], int] = {}  # (metric group, system) -> failed repeats
        self.unshare = "recovery" in args.metric_set and "taskrunner" in args.systems and can_unshare()
        self.details: dict[str, Any] = {"drain": [], "latency": [], "recovery": [], "enqueue": [], "batch": [],
                                        "io": []}

    def add(self, metric: str, system: str, value: float) -> None:
        self.results.setdefault(metric, {}).setdefault(system, Series()).values.append(value)

    def flush(self) -> None:
        flush(self.r)

    # 1. enqueue ---------------------------------------------------------------------------

    def enqueue(self, system: str, rep: int) -> None:
        self.flush()
        out = self.env.drive(system, "enqueue", self.a.enqueue_n)
        self.add("evalsha_rate" if system == "evalsha" else "enqueue_rate", system, out["rate"])
        self.details["enqueue"].append({"system": system, "rep": rep, **out})
        log(f"  enqueue {system:10} {out['rate']:>10,.0f} /s")

    def batch(self, system: str, rep: int) -> None:
        self.flush()
        out = self.env.drive(system, "batch", self.a.batch_n)
        self.add("batch_rate", system, out["rate"])
        self.details["batch"].append({"system": system, "rep": rep, **out})
        log(f"  batch   {system:10} {out['rate']:>10,.0f} /s")

    # 2 + 5. drain -----------------------------------------------------------------------

    def drain(self, system: str, rep: int, recorder: str | None = None) -> None:
        """recorder: how the jobs record their run (record.RECORDERS), for this drain; its
        figures then go under the metrics of that name (rt: one Redis round trip per job)."""
        if recorder is not None:
            with recording(recorder):
                return self._drain(system, rep, "rt_" if recorder == "redis" else "")
        return self._drain(system, rep, "")

    def _drain(self, system: str, rep: int, key: str) -> None:
        n = self.a.jobs
        self.flush()
        fill = self.env.drive(system, "fill", n, timeout=max(self.a.timeout, n / 200))
        before = Snapshot.take(self.r)
        polls = 0

        def finished() -> bool:
            nonlocal polls
            polls += 1
            return record.count(self.rdb) >= n

        t0 = time.monotonic()
        workers = self.env.start_workers(system, f"drain{rep}")
        try:
            t1 = wait_for(f"{system} drain", finished, self.a.timeout, 0.01, workers)
            after = Snapshot.take(self.r)
        finally:
            self.env.stop_workers(workers, f"{system} workers")
        seconds = t1 - t0
        # Our own polling (GET, with the redis recorder) and the INFO that ends the window
        # are not the system's work.
        polls = polls if record.recorder() == "redis" else 0
        commands = after.commands - before.commands - polls - 1
        delta = {k: v - before.stats.get(k, 0) for k, v in after.stats.items() if v - before.stats.get(k, 0)}
        delta["get"] = delta.get("get", 0) - polls
        delta["info"] = delta.get("info", 0) - 1
        delta = {k: v for k, v in delta.items() if v > 0}
        # Redis counts a command called from Lua like one sent by a client, in commandstats and
        # total_commands_processed alike; so the script calls are shown apart as well.
        scripts = sum(delta.get(c, 0) for c in SCRIPT_COMMANDS)
        cpu_ms = (after.cpu - before.cpu) * 1000
        self.add(key + "drain_rate", system, n / seconds)
        self.add(key + "redis_cpu_per_1000", system, cpu_ms / n * 1000)
        if not key:
            self.add("drain_seconds", system, seconds)
            self.add("redis_cmds_per_job", system, commands / n)
            self.add("redis_scripts_per_job", system, scripts / n)
            self.add("redis_bytes_per_job", system, (after.net - before.net) / n)
        self.details["drain"].append({"system": system, "rep": rep, "round_trip": bool(key), "jobs": n,
                                      "seconds": seconds,
                                      "fill_seconds": fill["seconds"], "total_commands": commands,
                                      "script_calls": scripts, "redis_cpu_ms": cpu_ms, "commandstats": delta,
                                      "net_bytes": after.net - before.net, "polls": polls})
        log(f"  drain{'+rt' if key else '   '} {system:10} {seconds:8.2f} s  {n / seconds:8,.0f} jobs/s  "
            f"{commands / n:5.1f} cmds/job  {cpu_ms / n * 1000:6.1f} ms cpu/1000  (fill {fill['seconds']:.1f}s)")

    # 5, unbatched: 20 ms jobs, as bench/io_bound.py runs them --------------------------

    def io(self, system: str, rep: int) -> None:
        from bench import io_bound  # it imports this module

        name, c = IO_SYSTEMS[system], self.a.io_concurrency
        res = io_bound.drain(self.env, self.r, io_bound.SYSTEMS[name], c, self.a.io_jobs, LOGS / f"io-{name}-{rep}.log")
        self.add("io_rate", system, res["rate"])
        self.add("io_redis_cpu_per_1000", system, res["redis_cpu_us_per_job"])  # us per job = ms per 1000
        self.details["io"].append({"rep": rep, **res})

    # 3. latency -------------------------------------------------------------------------

    def latency(self, system: str, rep: int) -> None:
        self.flush()
        workers = self.env.start_workers(system, f"latency{rep}")
        try:
            warm = 4
            for _ in range(warm):
                self.env.drive(system, "fill", 1)
            wait_for(f"{system} warm-up", lambda: record.count(self.rdb) >= warm, self.a.timeout,
                     0.02, workers)
            time.sleep(self.a.idle)  # idle workers: whatever they do when there is nothing to do
            count = self.a.latency_jobs
            self.env.drive(system, "latency", count, self.a.latency_interval,
                           timeout=self.a.timeout + count * self.a.latency_interval)
            wait_for(f"{system} latency jobs", lambda: self.rdb.llen(record.LATENCY) >= count, self.a.timeout,
                     0.02, workers)
            values = sorted(float(v) * 1000 for v in self.rdb.lrange(record.LATENCY, 0, -1))
        finally:
            self.env.stop_workers(workers, f"{system} workers")
        p50, p99 = percentile(values, 50), percentile(values, 99)
        self.add("latency_p50", system, p50)
        self.add("latency_p99", system, p99)
        self.details["latency"].append({"system": system, "rep": rep, "p50_ms": p50, "p99_ms": p99,
                                        "min_ms": values[0], "max_ms": values[-1], "n": len(values)})
        log(f"  latency {system:10} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  max {values[-1]:7.1f} ms")

    # 4. recovery ------------------------------------------------------------------------

    def recovery(self, rep: int, other_host: bool = False) -> None:
        self.flush()
        extra = {"TASKRUNNER_HEARTBEAT": str(self.env.heartbeat), "TASKRUNNER_DEAD_AFTER": str(self.env.dead_after)}
        tag = f"recovery{'-hb' if other_host else ''}{rep}"
        dispatcher = self.env.start_dispatcher(tag, extra, other_host)
        started: list[subprocess.Popen] = [dispatcher]
        try:
            first = self.env.start_workers("taskrunner", f"{tag}-a", extra, concurrency=1)
            started += first
            self.env.drive("taskrunner", "sleep", 30)
            wait_for("recovery: job running", lambda: self.rdb.llen(record.STARTS) >= 1, self.a.timeout, 0.01,
                     started)
            time.sleep(0.5)  # a heartbeat or so with the job running, as in life
            killed_at = time.time()
            self.env.procs.stop(first[0], grace=0, sig=signal.SIGKILL)  # the whole group: worker and child
            started.remove(first[0])
            second = self.env.start_workers("taskrunner", f"{tag}-b", extra, concurrency=1)
            started += second
            wait_for("recovery: job running again", lambda: self.rdb.llen(record.STARTS) >= 2, self.a.timeout,
                     0.01, started)
            again = float(self.rdb.lindex(record.STARTS, 1))
        finally:
            # The 30 s job is still running: no graceful stop (FLUSHALL follows anyway).
            self.env.stop_workers(started, "taskrunner worker/dispatcher", signal.SIGKILL, grace=2)
        key = "recovery_hb_seconds" if other_host else "recovery_seconds"
        self.add(key, "taskrunner", again - killed_at)
        self.details["recovery"].append({"rep": rep, "seconds": again - killed_at,
                                         "dispatcher_on_other_host": other_host,
                                         "heartbeat": self.env.heartbeat, "dead_after": self.env.dead_after})
        log(f"  recovery taskrunner {again - killed_at:6.2f} s from SIGKILL to running again"
            f"{' (dispatcher as on another host)' if other_host else ''}")


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


# -- report ----------------------------------------------------------------------------------


def cell(series: Series | None, fmt: str, failed: int = 0) -> str:
    """median (min–max); '[k failed]' when some repeats failed, 'FAILED' when all did."""
    if series is None or not series.values:
        return "FAILED" if failed else "-"
    med = fmt.format(series.median)
    text = med if len(series.values) == 1 else \
        f"{med} ({fmt.format(min(series.values))}–{fmt.format(max(series.values))})"
    return text + (f" [{failed} failed]" if failed else "")


def ratio_line(metric: Metric, results: dict[str, Series], systems: list[str]) -> str | None:
    tr = results.get("taskrunner")
    peers = {s: results[s].median for s in systems if s != "taskrunner" and s in results and results[s].values}
    if tr is None or not tr.values or not peers:
        return None
    pick = max if metric.higher_is_better else min
    best = pick(peers, key=peers.get)
    if peers[best] == 0:
        return None
    r = tr.median / peers[best]
    better = r > 1 if metric.higher_is_better else r < 1
    factor = r if r >= 1 else 1 / r
    if abs(r - 1) < 0.05:
        verdict = "about the same"
    else:
        verdict = f"taskrunner {factor:.2f}x {'higher' if r > 1 else 'lower'}: {'better' if better else 'worse'}"
    direction = "higher is better" if metric.higher_is_better else "lower is better"
    return f"{r:6.2f}  vs {best:<9} ({direction}; {verdict})"


def report(b: Bench, systems: list[str], meta: dict[str, Any]) -> str:
    a = b.a
    lines = [f"taskrunner benchmark — {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"machine: {meta['machine']}",
             f"redis-server {meta['redis_version']} on a unix socket (appendonly no), one server for all systems; "
             f"FLUSHALL between runs; no-op jobs record their completion "
             f"{'with an INCR in Redis' if a.recorder == 'redis' else 'by appending a byte to a file'}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"repeats: {a.repeat} (cells: median (min–max)); enqueue N={a.enqueue_n}; drain N={a.jobs}; "
             f"latency: {a.latency_jobs} jobs {a.latency_interval * 1000:.0f} ms apart after {a.idle:.0f} s idle",
             "workers:"]
    lines += [f"  {s:10} {WORKERS[s]}" for s in systems]
    lines.append("")
    cols = systems
    rows: list[list[str]] = [["metric", "unit", *cols]]
    for m in METRICS:
        res = b.results.get(m.key, {})
        if not res and not any(f[0] == m.group for f in b.failures):
            continue
        rows.append([m.label.format(jobs=a.jobs, io_c=a.io_concurrency), m.unit,
                     *(cell(res.get(s), m.fmt, b.failures.get((m.group, s), 0)) for s in cols)])
    ev = b.results.get("evalsha_rate", {}).get("evalsha")
    if ev:
        rows.insert(2, ["   reference: redis-py EVALSHA 'return 1'", "calls/s", cell(ev, "{:,.0f}"),
                        *([""] * (len(cols) - 1))])
    settings = f"HEARTBEAT={b.env.heartbeat:g} DEAD_AFTER={b.env.dead_after:g}"
    for key, group, label in [
            ("recovery_seconds", "recovery", f"4. SIGKILLed worker's job runs again ({settings})"),
            ("recovery_hb_seconds", "recovery-hb", "   same, dispatcher on 'another host' (heartbeat only)")]:
        rec = b.results.get(key, {}).get("taskrunner")
        rec_failed = b.failures.get((group, "taskrunner"), 0)
        if rec or rec_failed:
            rows.append([label, "s", cell(rec, "{:,.2f}", rec_failed), *(["see note"] * (len(cols) - 1))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[j]) if j < 2 else c.rjust(widths[j]) for j, c in enumerate(r)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if len(systems) > 1 and "taskrunner" in systems:
        lines += ["", "ratios: taskrunner median / best peer median"]
        for m in METRICS:
            line = ratio_line(m, b.results.get(m.key, {}), systems) if m.short != "-" else None
            if line:
                lines.append(f"  {m.short:24} {line}")
    drains = [d for d in b.details["drain"] if not d["round_trip"]]
    if drains:
        lines += ["", "Redis commands per job in the drain (last repeat; commands called from Lua count too):"]
        last = {d["system"]: d for d in drains}
        for s in systems:
            d = last.get(s)
            if d:
                top = sorted(d["commandstats"].items(), key=lambda kv: -kv[1])[:8]
                lines.append(f"  {s:10} " + "  ".join(f"{k} {v / d['jobs']:.2f}" for k, v in top))
    lines += ["", "notes:",
              "  - enqueue: one process, one job per call, after 50 warm-up calls; workers not running.",
              "  - drain: jobs enqueued first; the clock starts just before the worker processes are spawned",
              "    and stops when N jobs have recorded their run (polled every 10 ms): each appends one byte",
              "    to a file (O_APPEND), or with --recorder redis INCRs a counter in db 1 (then 1 command per",
              "    job is the task's own, and about 50 us of each job's CPU is redis-py's).",
              "    Redis figures cover the same window: commands less the bench's own polling; network bytes",
              "    include it (a few bytes per job at most).",
              "  - drain, 1 round trip/job (rt): the same drain, each job INCRs a counter in Redis (db 1) to",
              "    record its run (--recorder redis): a job that talks to Redis once, as most real jobs do.",
              f"  - {a.io_concurrency}-way, 20 ms jobs (io): {a.io_jobs:,} jobs that each sleep 20 ms then append",
              "    a byte to a file, run as bench/io_bound.py runs them, one job at a time per process or thread",
              "    (so claims and acks are for one job or few): taskrunner worker -c C (a child per job), C x rq",
              "    worker, dramatiq --processes 2 --threads C/2, 2 x celery worker -P threads -c C/2; jobs/s over",
              "    the last 80% of the jobs, Redis CPU from the workers' start to the last job (make bench-io).",
              "  - latency: start of the task (time.time()) minus time.time() just before the enqueue call.",
              "  - Celery runs with --without-gossip --without-mingle --without-heartbeat: no start-up sync",
              "    with other nodes and no broadcast traffic (as commonly advised for Redis; favours Celery).",
              "  - 4. (taskrunner only) time from SIGKILL of the worker's process group (job of 30 s running) to",
              "    the job's next start, on a second worker (-c 1) started right after the kill; a dispatcher runs",
              "    throughout. On the same host the dispatcher sees the worker's PID gone at once, without waiting",
              "    for DEAD_AFTER. The second figure runs the dispatcher in a UTS namespace of its own with another",
              "    hostname (`unshare --uts`), so it cannot check the PID and only the missed heartbeats tell, as",
              "    when the worker's host dies." + ("" if b.unshare else " (not run: unshare unavailable here)"),
              "  - peers on a killed worker (their defaults; a note, not a measurement): Celery acks early by",
              "    default, so the job is lost; with acks_late it is redelivered once the visibility timeout",
              "    (1 h by default) has passed. RQ moves it to the FailedJobRegistry (AbandonedJobError; retried",
              "    only if it was given retries) after the dead worker's heartbeat TTL, at a worker's periodic",
              "    maintenance (every 10 min by default). Dramatiq requeues the unacked messages of a worker whose",
              "    heartbeat is older than its heartbeat timeout (60 s by default), in a maintenance pass that",
              "    another worker's broker calls trigger at random (0.1% of them by default).",
              "  - the machine has 2 cores and other work may run on it: figures are noisy."]
    if b.details.get("errors"):
        lines += ["", "errors (failed runs are missing from the table):"]
        lines += [f"  - {e}" for e in b.details["errors"]]
    if b.details.get("warnings"):
        lines += ["", "warnings:"]
        lines += [f"  - {e}" for e in b.details["warnings"]]
    return "\n".join(lines) + "\n"


# -- setup and main --------------------------------------------------------------------------


def ensure_peers(systems: list[str], timeout: float) -> None:
    """The peers' virtualenv, with every package in PEER_PACKAGES, once one of `systems`
    needs a peer that it cannot import."""
    peers = [s for s in systems if s in PEER_MODULES]
    if not peers:
        return
    py = PEERS_BIN / "python"
    check = [str(py), "-c", "import redis, hiredis, " + ", ".join(PEER_MODULES[s] for s in peers)]
    if py.exists() and subprocess.run(check, capture_output=True, timeout=60).returncode == 0:
        return
    log(f"setting up {VENV} with {' '.join(PEER_PACKAGES)} ...")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=timeout)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PEER_PACKAGES],
                   check=True, timeout=timeout)
    subprocess.run(check, check=True, timeout=60)


def git_revision() -> str:
    """The commit the taskrunner under test is at, '+dirty' with changes not committed,
    and a digest of its source as it is on disk (workers import it when they start)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "taskrunner"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    return f"git {head or '?'}{'+dirty' if dirty else ''}, source {source_digest()}"


def source_digest() -> str:
    h = hashlib.sha1()
    for f in sorted((ROOT / "taskrunner").rglob("*")):
        if f.suffix in (".py", ".lua") and f.is_file():
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:10]


def versions(systems: list[str]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("taskrunner")
    except PackageNotFoundError:  # run from a checkout on PYTHONPATH, not installed (a bare machine's run)
        ours = "not installed"
    out = {"python": platform.python_version(), "taskrunner": f"{ours} ({git_revision()})",
           "redis-py": version("redis")}
    peers = [s for s in systems if s in PEER_MODULES]
    if peers:
        code = ("import json, platform; from importlib.metadata import version; "
                f"print(json.dumps({{**{{p: version(p) for p in {peers!r}}}, 'peers python': platform.python_version(),"
                " 'peers redis-py': version('redis')}))")
        res = subprocess.run([str(PEERS_BIN / "python"), "-c", code], capture_output=True, text=True, timeout=60)
        if res.returncode == 0:
            out.update(json.loads(res.stdout))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N=2000, 1 repeat: a fast check")
    p.add_argument("--only", help="comma-separated systems among " + ",".join(SYSTEMS))
    p.add_argument("--json", help="also write the results as JSON to this path")
    p.add_argument("--repeat", type=int, help="repeats of each measurement (default 3; --quick: 1)")
    p.add_argument("--enqueue-n", type=int, help="jobs for the enqueue rate (default 5000; --quick: 2000)")
    p.add_argument("--jobs", type=int, help="jobs for the drain (default 20000; --quick: 2000)")
    p.add_argument("--latency-jobs", type=int, default=200)
    p.add_argument("--latency-interval", type=float, default=0.02, help="seconds between latency jobs")
    p.add_argument("--idle", type=float, default=3.0, help="seconds workers idle before the latency jobs")
    p.add_argument("--heartbeat", type=float, default=1.0, help="TASKRUNNER_HEARTBEAT for the recovery test")
    p.add_argument("--dead-after", type=float, default=5.0, help="TASKRUNNER_DEAD_AFTER for the recovery test")
    p.add_argument("--batch-n", type=int, help="jobs for the batch enqueue rate (default 20000; --quick: 5000)")
    p.add_argument("--metrics", default=",".join(GROUPS), help="which to run, among " + ",".join(GROUPS)
                   + " (rt: the drain with one Redis round trip per job; io: 20 ms jobs, unbatched)")
    p.add_argument("--io-jobs", type=int, help="20 ms jobs per run of the io metrics (default 10000; --quick: 1000)")
    p.add_argument("--io-concurrency", type=int, default=64,
                   help=f"concurrent 20 ms jobs in the io metrics, even, at most {MAX_IO_CONCURRENCY} (default 64)")
    p.add_argument("--cluster", action="store_true",
                   help="run bench/cluster.py instead, with the options that follow (its own; see "
                        "python -m bench.cluster --help): one hot queue, sharded on a local 3-primary cluster, "
                        "vs one server")
    p.add_argument("--recorder", choices=record.RECORDERS, default="file",
                   help="how a no-op job records that it ran: append a byte to a file (default), or INCR a "
                        "counter in Redis (the method before 2026-11-21; it costs every system a round trip)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of each wait, seconds")
    p.add_argument("--max-time", type=float, default=3600.0, help="the whole run stops after this many seconds")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop at the first failed run (default: record it as FAILED and go on)")
    a = p.parse_args(argv)
    a.repeat = a.repeat or (1 if a.quick else 3)
    a.enqueue_n = a.enqueue_n or (2000 if a.quick else 5000)
    a.batch_n = a.batch_n or (5000 if a.quick else 20000)
    a.jobs = a.jobs or (2000 if a.quick else 20000)
    a.io_jobs = a.io_jobs or (1000 if a.quick else 10000)
    if a.io_concurrency < 2 or a.io_concurrency % 2 or a.io_concurrency > MAX_IO_CONCURRENCY:
        p.error(f"--io-concurrency: an even number from 2 to {MAX_IO_CONCURRENCY}")
    a.systems = [s.strip() for s in (a.only or ",".join(SYSTEMS)).split(",") if s.strip()]
    bad = set(a.systems) - set(SYSTEMS)
    if bad:
        p.error(f"unknown system(s) {', '.join(sorted(bad))}; choose among {', '.join(SYSTEMS)}")
    a.metric_set = {m.strip() for m in a.metrics.split(",") if m.strip()}
    bad = a.metric_set - set(GROUPS)
    if bad:
        p.error(f"unknown metric(s) {', '.join(sorted(bad))}")
    return a


@contextmanager
def own_server(max_time: float, systems: list[str], recorder: str = "file") -> Iterator[tuple[Procs, str]]:
    """A run's stage: the peers' venv if `systems` need it, a redis-server of our own in a
    temporary folder (its socket in the environment, for record here and in every process
    we start), and a Procs for what we start. On the way out, however it is left, every
    process is stopped and the folder removed; the run stops after `max_time` s."""
    from taskrunner.ops.redis_server import RedisServer

    stop_after(max_time, lambda: BenchTimeout(f"the whole bench passed --max-time {max_time:.0f}s"))
    procs = Procs()
    tmp = Path(tempfile.mkdtemp(prefix="trbench-"))
    server = RedisServer(tmp, appendonly=False)
    try:
        ensure_peers(systems, timeout=900)
        server.start()
        os.environ[record.SOCKET_ENV] = str(server.socket)
        os.environ[record.RECORDER_ENV] = recorder
        yield procs, str(server.socket)
    finally:
        signal.alarm(0)
        procs.stop_all()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run_meta(r: redis.Redis, systems: list[str]) -> dict[str, Any]:
    """What a report says of the run's conditions."""
    return {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
                       f"load avg {' '.join(f'{x:.1f}' for x in os.getloadavg())} at start",
            "redis_version": r.info("server")["redis_version"], "versions": versions(systems),
            "source": source_digest()}


def save(text: str, out: Path, json_path: str | None, data: Callable[[], dict[str, Any]]) -> None:
    """Print the report and save it to `out`; and data() as JSON to `json_path`, if given."""
    print(text, end="")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"saved {out}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(data(), indent=2, default=str))
        log(f"saved {json_path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--cluster" in argv:  # with --help: bench/cluster.py's
        from bench import cluster  # it imports this module

        return cluster.main([x for x in argv if x != "--cluster"])
    a = parse_args(argv)
    os.chdir(ROOT)
    if LOGS.exists():
        shutil.rmtree(LOGS)
    LOGS.mkdir(parents=True)
    try:
        with own_server(a.max_time, a.systems, a.recorder) as (procs, socket):
            return run(a, procs, socket)
    except (BenchError, KeyboardInterrupt, subprocess.SubprocessError) as e:
        log(f"bench stopped: {type(e).__name__}: {e} (logs in {LOGS})")
        return 2


def run(a: argparse.Namespace, procs: Procs, socket: str) -> int:
    r = redis.Redis(unix_socket_path=socket)
    env = Env(socket, procs, a.timeout, heartbeat=a.heartbeat, dead_after=a.dead_after)
    b = Bench(a, env, r)
    b.details["errors"], b.details["warnings"] = [], []
    meta = run_meta(r, a.systems)
    log(f"redis-server at {socket}; systems {','.join(a.systems)}; logs in {LOGS}")

    def attempt(group: str, system: str, rep: int, fn: Callable[[], None]) -> None:
        what = f"{group} {system} #{rep + 1}"
        try:
            fn()
        except BenchError as e:
            if "--max-time" in str(e) or a.fail_fast:
                raise
            b.details["errors"].append(f"{what}: {e}")
            b.failures[(group, system)] = b.failures.get((group, system), 0) + 1
            log(f"  FAILED {what}: {e}")

    # Repeats are the outer loop, systems the inner one: drift (other load on the
    # machine) spreads over every system instead of landing on one.
    try:
        for rep in range(a.repeat):
            if "enqueue" in a.metric_set:
                log(f"repeat {rep + 1}/{a.repeat}: enqueue")
                for s in ["evalsha", *a.systems]:
                    attempt("enqueue", s, rep, lambda s=s, rep=rep: b.enqueue(s, rep))
            if "batch" in a.metric_set:
                log(f"repeat {rep + 1}/{a.repeat}: batch enqueue")
                for s in [s for s in a.systems if s in BATCH_SYSTEMS]:
                    attempt("batch", s, rep, lambda s=s, rep=rep: b.batch(s, rep))
            if "drain" in a.metric_set:
                log(f"repeat {rep + 1}/{a.repeat}: drain")
                for s in a.systems:
                    attempt("drain", s, rep, lambda s=s, rep=rep: b.drain(s, rep))
            if "rt" in a.metric_set:
                log(f"repeat {rep + 1}/{a.repeat}: drain, each job one Redis round trip")
                for s in a.systems:
                    attempt("rt", s, rep, lambda s=s, rep=rep: b.drain(s, rep, recorder="redis"))
            if "io" in a.metric_set:
                log(f"repeat {rep + 1}/{a.repeat}: 20 ms jobs at {a.io_concurrency}-way, unbatched")
                for s in a.systems:
                    attempt("io", s, rep, lambda s=s, rep=rep: b.io(s, rep))
            if "latency" in a.metric_set:
                log(f"repeat {rep + 1}/{a.repeat}: latency")
                for s in a.systems:
                    attempt("latency", s, rep, lambda s=s, rep=rep: b.latency(s, rep))
            if "recovery" in a.metric_set and "taskrunner" in a.systems:
                log(f"repeat {rep + 1}/{a.repeat}: recovery")
                attempt("recovery", "taskrunner", rep, lambda rep=rep: b.recovery(rep))
                if b.unshare:
                    attempt("recovery-hb", "taskrunner", rep, lambda rep=rep: b.recovery(rep, other_host=True))
    except BenchError as e:  # --max-time, or --fail-fast: report what was measured
        b.details["errors"].append(f"bench stopped early: {e}")
        log(f"bench stopped early: {e}")
    signal.alarm(0)
    if "taskrunner" in a.systems and source_digest() != meta["source"]:
        b.details["warnings"].append(f"taskrunner's source changed during the run (digest {meta['source']} at "
                                   f"start, {source_digest()} at the end): its figures may mix two versions")
    text = report(b, a.systems, meta)
    save(text, RESULTS / "latest.txt", a.json, lambda: {
        "meta": meta, "args": {k: v for k, v in vars(a).items() if k != "metric_set"},
        "results": {m: {s: {"median": v.median, "min": min(v.values), "max": max(v.values), "values": v.values}
                        for s, v in res.items()} for m, res in b.results.items()},
        "details": b.details})
    return 1 if b.details["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
