"""Chaos harness: run many jobs on a real stack while killing its parts, then check that
no job was lost.

    python -m bench.chaos                      # 20,000 jobs, fsync everysec then always (~15 min)
    python -m bench.chaos --jobs 2000 --window 40 --fsync always --seed 7
    python -m bench.chaos --cluster --jobs 2000 --window 40    # on a 3-primary Redis Cluster
    make chaos ARGS="--seed 3"

One run: a redis-server with AOF on (TCP on 127.0.0.1, `appendfsync` from --fsync), 2
dispatchers and --workers workers (`-c 2`), all real `python -m taskrunner` processes in
their own process groups. An enqueuer spreads --jobs jobs over the first 70% of the fault
window (no-ops, short sleeps, delayed no-ops, planned failures retried once, jobs over
their max duration; a cron schedule ticks every 2 s), and records each id whose enqueue
Redis acknowledged, with the time, in a ledger: a second redis-server that is never
faulted. Each run of a task writes there too (bench/tasks_chaos.py).

Faults follow a schedule made from --seed, --window and --workers alone (the same values,
the same faults at the same offsets against the same targets), at least two of each kind:

  worker-kill      SIGKILL of a worker's process group (worker and children)
  child-kill       SIGKILL of one child process of a worker
  dispatcher-kill  SIGKILL of a dispatcher's process group
  worker-pause     SIGSTOP of a worker's group for dead_after + 2 s, then SIGCONT: a zombie
                   that comes back after its jobs went to others
  redis-term       SIGTERM of redis-server (it syncs its AOF and exits), restart
  redis-kill       SIGKILL of redis-server (a process crash: what it wrote is in the OS's
                   page cache and survives), restart on the same AOF, dir and port
  redis-powerloss  SIGKILL, and the AOF cut back to its size of 1 s before: what a power
                   loss drops under everysec (Redis fsyncs once a second). Under always
                   every acknowledged write was fsynced: nothing is cut.
  client-kill      CLIENT KILL TYPE normal: every client's connection dropped

--cluster [N] runs the same on a local Redis Cluster of N primaries (3), each with its AOF
and no replica, queue default sharded over them (--shards, 3 by default there): a Redis
fault stops one primary (the target's slot modulo N; a power loss cuts that node's AOF) and
restarts it on its AOF, dir and ports; client-kill drops the connections of every node.

Killed processes are started again 0.5 s later, as a supervisor would. When the window
ends, it waits (at most --drain s) until every acknowledged job is final, stops the stack
and checks every job against the ledger and its record in Redis. A job is *lost* if Redis
has no record of it and it never ran to the end; the loss is put down to everysec only
when the job's enqueue was acknowledged after the point the AOF was cut back to (its
record was in the dropped second). Runs beyond those a job is designed to have are
classified by the timeline of its record (`end:<n>`: how delivery n ended). Exit status 1
on: a loss not put down to everysec; a job still pending, delayed or running after the
drain; a record that disagrees with the ledger; an extra run that no delivery on record
explains; a job that ended with no history record of its end (the archive, as `analyze`
reads it, after the rest of the streams is archived at the end); and under always, any
enqueue or delivery Redis forgot, or a job with two records of its end.

--workflows adds, at the start of the window, a chord of --chord members (500) and a chain
of --chain steps (50) on queue wf, and its own fault schedule (from --seed + 1000) to the
run's: every member and step must complete (each ran at least once, by the ledger), the
chain's last step give its length, and the chord's callback complete, every run of it given
all the members' results in order (the ledger keeps each list it was given); its deliveries
and runs are reported (more than one only after a fault that hit it).

Progress goes to stderr; the report to stdout, its last line a one-line summary. Logs of
every process and the Redis dirs stay in the run directory (printed) when a run fails.
--max-time bounds everything; every process started here is killed (as a group) at the
end, on Ctrl-C and on errors."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import tasks_chaos  # noqa: E402
from bench.bench import exited  # noqa: E402
from bench.limits import stop_after  # noqa: E402
from taskrunner.ops import queue as queue_ops  # noqa: E402
from taskrunner.ops.redis_server import RedisServer  # noqa: E402
from taskrunner.protocol import codec, shards  # noqa: E402
from taskrunner.protocol.connection import connect  # noqa: E402
from taskrunner.protocol.outages import transient  # noqa: E402

KINDS = ("worker-kill", "child-kill", "dispatcher-kill", "worker-pause",
         "redis-term", "redis-kill", "redis-powerloss", "client-kill")
#: Extra faults beyond the minimum are drawn with these weights: mostly process deaths.
WEIGHTS = (4, 4, 2, 2, 1, 1, 1, 2)
#: Seconds after which a fault whose target was down is tried again (within the window).
RETRY_AFTER = 1.0
PREFIX = "chaos"
QUEUES = ("default", "cron", "wf")  # wf: the workflow mode's jobs (--workflows)
DISPATCHERS = 2
CONCURRENCY = 2
RESTART_DELAY = 0.5
#: Settings that make deaths visible within a run (defaults: heartbeat 2 s, dead after 10 s).
SETTINGS = {
    "TASKRUNNER_HEARTBEAT": "0.5",
    "TASKRUNNER_DEAD_AFTER": "3",
    "TASKRUNNER_DISPATCH_INTERVAL": "0.2",
    "TASKRUNNER_KILL_GRACE": "1",
    "TASKRUNNER_STUCK_RECHECK": "2",
    "TASKRUNNER_IDLE_BLOCK": "1",
    "TASKRUNNER_SHUTDOWN_GRACE": "5",
}
DEAD_AFTER = float(SETTINGS["TASKRUNNER_DEAD_AFTER"])
FINAL = ("completed", "failed", "killed")
#: The mix of jobs: (kind, weight). "fail" runs twice by design (one retry).
MIX = (("noop", 880), ("sleep", 70), ("delayed", 25), ("fail", 15), ("overtime", 3))
PLANNED_RUNS = {"fail": 2}
#: What a Redis (or Redis Cluster) call may raise; transient() tells which pass by themselves.
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class ChaosError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- plans made from the seed ------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    at: float  # seconds into the window
    kind: str
    target: int  # worker or dispatcher slot; for child-kill, worker slot * 10 + child index


def fault_schedule(seed: int, window: float, workers: int, min_each: int = 2, every: float = 4.0) -> list[Fault]:
    """At least `min_each` faults of each kind, about one every `every` seconds, spread
    evenly (with jitter) over the window minus 5 s at each end. Depends only on the args."""
    rng = random.Random(f"faults-{seed}")
    total = max(min_each * len(KINDS), int(window / every))
    kinds = [k for k in KINDS for _ in range(min_each)]
    kinds += rng.choices(KINDS, WEIGHTS, k=total - len(kinds))
    rng.shuffle(kinds)
    span = max(window - 10.0, 1.0)
    slot = span / total
    faults = []
    for i, kind in enumerate(kinds):
        at = 5.0 + slot * (i + 0.5 + rng.uniform(-0.4, 0.4))
        if kind == "child-kill":
            target = rng.randrange(workers) * 10 + rng.randrange(CONCURRENCY)
        elif kind == "dispatcher-kill":
            target = rng.randrange(DISPATCHERS)
        else:
            target = rng.randrange(workers)
        faults.append(Fault(round(at, 3), kind, target))
    return faults


def job_plan(seed: int, n: int) -> list[dict[str, Any]]:
    """The jobs to enqueue, as enqueue_many takes them; the id says the kind."""
    rng = random.Random(f"jobs-{seed}")
    kinds, weights = zip(*MIX)
    jobs = []
    for i, kind in enumerate(rng.choices(kinds, weights, k=n)):
        key = f"{i:06d}.{kind}"
        if kind == "sleep":
            jobs.append({"id": key, "task": "chaos.sleep", "args": [key, round(rng.uniform(0.05, 0.5), 3)]})
        elif kind == "delayed":
            jobs.append({"id": key, "task": "chaos.noop", "args": [key], "delay": round(rng.uniform(1, 20), 3)})
        else:
            jobs.append({"id": key, "task": f"chaos.{kind}", "args": [key]})
    return jobs


def kind_of(job_id: str) -> str:
    return job_id.rsplit(".", 1)[1]


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """Signal p's process group, unless p was reaped (its group ID may be reused then)."""
    if p.returncode is None:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap(p: subprocess.Popen) -> int:
    """SIGKILL whatever is left of the group, then reap the leader; its exit code."""
    signal_group(p, signal.SIGKILL)
    return p.wait()


@dataclass
class Proc:
    slot: int
    name: str
    popen: subprocess.Popen
    by_us: bool = False  # we killed it: its exit is expected
    paused_until: float | None = None


class Supervisor:
    """Keeps `workers` workers and DISPATCHERS dispatchers running: a process that exits
    is started again RESTART_DELAY s later under a new name (a restarted worker's old
    name stays taken until its heartbeat is dead_after old)."""

    def __init__(self, run_dir: Path, env: dict[str, str], workers: int) -> None:
        self.run_dir, self.env = run_dir, env
        self.slots: dict[tuple[str, int], Proc | None] = {}
        self.restart_at: dict[tuple[str, int], float] = {}
        self.generation: collections.Counter[tuple[str, int]] = collections.Counter()
        self.starts = 0
        self.unexpected: list[str] = []
        for slot in range(workers):
            self.start("worker", slot)
        for slot in range(DISPATCHERS):
            self.start("dispatcher", slot)

    def start(self, role: str, slot: int) -> Proc:
        self.generation[role, slot] += 1
        name = f"{role[0]}{slot}.{self.generation[role, slot]}"
        cmd = [sys.executable, "-m", "taskrunner", role, "-A", "bench.tasks_chaos", "-n", name, "--log-level", "info"]
        if role == "worker":
            cmd += ["-Q", ",".join(QUEUES), "-c", str(CONCURRENCY)]
        with open(self.run_dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        proc = self.slots[role, slot] = Proc(slot, name, p)
        self.starts += 1
        return proc

    def last_line(self, name: str) -> str:
        try:
            lines = (self.run_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1][:200] if lines else "(empty log)"

    def alive(self, role: str, slot: int) -> Proc | None:
        proc = self.slots.get((role, slot))
        return proc if proc is not None and not exited(proc.popen) else None

    def tick(self, now: float) -> None:
        """Resume paused processes that are due, notice exits, restart what is due."""
        for key, proc in list(self.slots.items()):
            if proc is None:
                if now >= self.restart_at[key]:
                    self.start(*key)
                continue
            if proc.paused_until is not None and now >= proc.paused_until:
                self.resume(proc)
            if exited(proc.popen):
                code = reap(proc.popen)
                if not proc.by_us:
                    self.unexpected.append(f"{proc.name} exited with {code}: {self.last_line(proc.name)}")
                    log(f"  exited on its own: {self.unexpected[-1]}")
                self.slots[key] = None
                self.restart_at[key] = now + RESTART_DELAY

    def kill(self, proc: Proc) -> None:
        proc.by_us = True
        signal_group(proc.popen, signal.SIGKILL)

    def pause(self, proc: Proc, seconds: float) -> None:
        signal_group(proc.popen, signal.SIGSTOP)
        proc.paused_until = time.monotonic() + seconds

    def resume(self, proc: Proc) -> None:
        signal_group(proc.popen, signal.SIGCONT)
        proc.paused_until = None

    def stop(self, role: str, grace: float) -> None:
        """SIGTERM every process of the role (resumed first), SIGKILL what outlives grace."""
        procs = [p for (r, _), p in self.slots.items() if r == role and p is not None]
        for proc in procs:
            proc.by_us = True
            self.resume(proc)
            signal_group(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            while not exited(proc.popen) and time.monotonic() < deadline:
                time.sleep(0.05)
            reap(proc.popen)
            self.slots[role, proc.slot] = None
            self.restart_at[role, proc.slot] = float("inf")

    def kill_all(self) -> None:
        for proc in self.slots.values():
            if proc is not None:
                proc.by_us = True
                signal_group(proc.popen, signal.SIGCONT)
                reap(proc.popen)
        self.slots = {k: None for k in self.slots}
        self.restart_at = {k: float("inf") for k in self.slots}


# -- the AOF tail a power loss would drop --------------------------------------------------------


class AofTail:
    """Samples the size of the AOF file Redis appends to, every 50 ms, so that a power loss
    can be simulated: after a SIGKILL, the file is cut back to its size of 1 s earlier
    (everysec fsyncs once a second; the page cache holds the rest). A write acknowledged
    before a sample is inside that sample's size: Redis writes the AOF before it replies
    (unless it postponed a write behind a slow fsync: INFO's aof_delayed_fsync counts those)."""

    LOST_SECONDS = 1.0

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.samples: collections.deque[tuple[float, Path, int]] = collections.deque(maxlen=100)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="aof-sampler", daemon=True)
        self.thread.start()

    def current(self) -> Path | None:
        """The file appended to: the last incr file of the manifest (Redis 7), else appendonly.aof."""
        manifest = self.dir / "appendonlydir" / "appendonly.aof.manifest"
        try:
            lines = manifest.read_text().splitlines()
        except OSError:
            legacy = self.dir / "appendonly.aof"
            return legacy if legacy.exists() else None
        incr = [line.split()[1] for line in lines if line.split()[-1:] == ["i"]]
        return self.dir / "appendonlydir" / incr[-1] if incr else None

    def _run(self) -> None:
        while not self.stopped.wait(0.05):
            path = self.current()
            try:
                size = path.stat().st_size if path else None
            except OSError:
                size = None
            if path is not None and size is not None:
                with self.lock:
                    self.samples.append((time.time(), path, size))

    def cut(self, killed_at: float) -> tuple[float, int]:
        """Cut the file back to its last sample at least LOST_SECONDS older than killed_at
        (Redis must be dead). Returns (that sample's time, bytes dropped)."""
        path = self.current()
        if path is None:
            return killed_at, 0
        with self.lock:
            older = [(t, s) for t, p, s in self.samples if p == path and t <= killed_at - self.LOST_SECONDS]
        at, size = older[-1] if older else (killed_at - self.LOST_SECONDS, 0)
        dropped = max(0, path.stat().st_size - size)
        if dropped:
            os.truncate(path, size)
        with self.lock:
            self.samples.clear()
        return at, dropped

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(2)


# -- enqueueing ------------------------------------------------------------------------------


class Enqueuer(threading.Thread):
    """Enqueues the plan at a steady rate in chunks of 50. After Redis answers a chunk,
    records its ids and the time in the ledger's `acked` hash. A chunk whose answer never
    came is sent again (an id is enqueued once: a repeat answers "exists")."""

    CHUNK = 50

    def __init__(self, jobs: list[dict[str, Any]], seconds: float, ledger: redis.Redis, deadline: float) -> None:
        super().__init__(name="enqueuer", daemon=True)
        self.jobs, self.seconds, self.ledger, self.deadline = jobs, seconds, ledger, deadline
        self.acked = 0
        self.retries = 0
        self.error: str | None = None
        self.stop_now = threading.Event()

    def run(self) -> None:
        app = tasks_chaos.app
        begin = time.monotonic()
        chunks = [self.jobs[i:i + self.CHUNK] for i in range(0, len(self.jobs), self.CHUNK)]
        for n, chunk in enumerate(chunks):
            due = begin + self.seconds * n / len(chunks)
            if self.stop_now.wait(max(0.0, due - time.monotonic())):
                return
            while True:
                try:
                    app.enqueue_many(chunk)
                    break
                except REDIS_ERRORS as e:
                    if not transient(e) and not isinstance(e, redis.BusyLoadingError):
                        raise
                    self.retries += 1
                    if time.monotonic() > self.deadline or self.stop_now.wait(0.2):
                        self.error = f"gave up on {len(self.jobs) - self.acked} jobs: Redis unreachable"
                        return
            now = time.time()
            self.ledger.hset("acked", mapping={j["id"]: f"{now:.6f}" for j in chunk})
            self.acked += len(chunk)


# -- faults ------------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything one run knows: its servers, processes and what was done to them."""

    args: argparse.Namespace
    fsync: str
    dir: Path
    servers: list[RedisServer]  # one, or the primaries of a cluster (--cluster)
    r: Any  # a client of it (redis.Redis, or redis.RedisCluster)
    ledger: redis.Redis
    sup: Supervisor
    aofs: list[AofTail]  # one per server
    injected: collections.Counter[str] = field(default_factory=collections.Counter)
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    #: (kind, wall time, job ids held by what was killed or paused)
    kills: list[tuple[str, float, list[str]]] = field(default_factory=list)
    #: (wall time of the cut-back point, wall time of the kill, bytes dropped)
    cuts: list[tuple[float, float, int]] = field(default_factory=list)
    redis_restarts: list[float] = field(default_factory=list)  # seconds each was down
    zombies: list[tuple[str, list[str]]] = field(default_factory=list)  # paused worker, ids it held
    delayed_fsyncs: int = 0


def held(run: Run, match: dict[str, Any]) -> list[str]:
    """Ids in the holding lists whose entry matches (e.g. {"worker": name}); [] if Redis
    does not answer."""
    ids = []
    try:
        for q in physical(run, QUEUES):
            for job_id, raw in run.r.hgetall(tasks_chaos.app.keys.q(q) + "running").items():
                entry = codec.loads(raw)
                if all(entry.get(k) == v for k, v in match.items()):
                    ids.append(job_id)
    except (*REDIS_ERRORS, ValueError):
        pass
    return ids


def pick(run: Run, role: str, slot: int, n: int) -> Any:
    """The target slot if it runs and is not paused, else the next one that is."""
    for i in range(n):
        proc = run.sup.alive(role, (slot + i) % n)
        if proc is not None and proc.paused_until is None:
            return proc
    return None


def node(server: RedisServer) -> redis.Redis:
    """A client of this very server (on a cluster, of this one node), on its unix socket."""
    return redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=10)


def delayed_fsyncs(server: RedisServer) -> int:
    """Writes the server postponed behind a slow fsync so far (INFO's aof_delayed_fsync)."""
    with node(server) as c:
        return int(c.info("persistence").get("aof_delayed_fsync", 0))


def restart_redis(run: Run, how: str, target: int) -> int:
    """Stop (as `how` says) and start again the server `target` (on a cluster, modulo its
    primaries); which one it was."""
    i = target % len(run.servers)
    server = run.servers[i]
    try:
        run.delayed_fsyncs += delayed_fsyncs(server)
    except REDIS_ERRORS:
        pass
    down = time.monotonic()
    killed_at = time.time()
    server.stop(kill=how != "redis-term")
    if how == "redis-powerloss" and run.fsync == "everysec":
        cut_at, dropped = run.aofs[i].cut(killed_at)
        run.cuts.append((cut_at, killed_at, dropped))
        log(f"  AOF cut back {dropped} bytes ({killed_at - cut_at:.2f}s of writes)")
    server.start()
    run.redis_restarts.append(time.monotonic() - down)
    return i


def inject(run: Run, fault: Fault) -> bool:
    """Make the fault happen; False when its target was not there (a worker killed and not
    yet back, one whose children are not forked yet, every node down): tried again later."""
    workers = run.args.workers
    now = time.time()
    if fault.kind in ("worker-kill", "worker-pause"):
        proc = pick(run, "worker", fault.target, workers)
        if proc is None:
            run.skipped[fault.kind] += 1
            return False
        ids = held(run, {"worker": proc.name})
        if fault.kind == "worker-kill":
            run.sup.kill(proc)
        else:
            run.sup.pause(proc, DEAD_AFTER + 2)
            run.zombies.append((proc.name, ids))
        run.kills.append((fault.kind, now, ids))
        detail = proc.name
    elif fault.kind == "child-kill":
        proc = pick(run, "worker", fault.target // 10, workers)
        try:
            children = sorted(c.pid for c in psutil.Process(proc.popen.pid).children()) if proc else []
        except psutil.Error:
            children = []
        if not children:
            run.skipped[fault.kind] += 1
            return False
        pid = children[(fault.target % 10) % len(children)]
        ids = held(run, {"pid": pid})
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            run.skipped[fault.kind] += 1
            return False
        run.kills.append((fault.kind, now, ids))
        detail = f"{proc.name} child {pid}"
    elif fault.kind == "dispatcher-kill":
        proc = pick(run, "dispatcher", fault.target, DISPATCHERS)
        if proc is None:
            run.skipped[fault.kind] += 1
            return False
        run.sup.kill(proc)
        detail = proc.name
    elif fault.kind.startswith("redis-"):
        i = restart_redis(run, fault.kind, fault.target)
        detail = f"{'node ' + str(i) + ' ' if len(run.servers) > 1 else ''}down {run.redis_restarts[-1]:.2f}s"
    elif fault.kind == "client-kill":  # on every server (each node of a cluster)
        dropped, reached = 0, 0
        for server in run.servers:  # a node down (restarting) is passed over; the others are hit
            try:
                with node(server) as c:
                    dropped += c.client_kill_filter(_type="normal", skipme=True)
                reached += 1
            except REDIS_ERRORS as e:
                log(f"  client-kill: a node passed over: {e}")
        if not reached:
            run.skipped[fault.kind] += 1
            return False
        detail = f"{dropped} connections on {reached} of {len(run.servers)} servers"
    else:
        raise ValueError(fault.kind)
    run.injected[fault.kind] += 1
    log(f"  fault {fault.at:6.1f}s {fault.kind}: {detail}")
    return True


# -- checking ----------------------------------------------------------------------------------

#: How a delivery ended (its `end:<n>` text) -> why the job ran again.
REASONS = (
    (re.compile(r"^requeued: worker \S+ is dead"), "its worker died (heartbeat gone or PID dead)"),
    (re.compile(r"^requeued: child process died"), "its child process was killed"),
    (re.compile(r"no longer ran it"), "released as an orphan by its worker (an answer lost with a connection)"),
    (re.compile(r"^requeued"), "requeued: {}"),
    (re.compile(r"^killed \(its process was gone"), "killed while its process was gone"),
)


#: A run no delivery on record accounts for: Redis lost the record of one (only a power loss may).
FORGOT = "Redis forgot a delivery (AOF tail dropped by a power loss)"


def reason_of(end: str) -> str:
    what = end.partition(" ")[2]
    for pattern, reason in REASONS:
        if pattern.search(what):
            return reason.format(what[:60])
    return f"other: {what[:60]}"


def batched(items: list[str], n: int = 1000) -> list[list[str]]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def physical(run: Run, queues: tuple[str, ...] | list[str]) -> list[str]:
    """The queues as Redis has them: with --shards, default's shards (docs/PROTOCOL.md, Sharded queues)."""
    return [s for q in queues for s in shards.names(q, run.args.shards if q == "default" else 1)]


def records(run: Run, ids: list[str], queue: str = "default") -> dict[str, dict[str, str]]:
    """Each job's record ({}: none), in whichever shard of `queue` it is."""
    out: dict[str, dict[str, str]] = {}
    where = physical(run, [queue])
    for chunk in batched(ids):
        pipe = run.r.pipeline(transaction=False)
        for job_id in chunk:
            for q in where:
                pipe.hgetall(tasks_chaos.app.keys.job(q, job_id))
        found = pipe.execute()
        for i, job_id in enumerate(chunk):
            out[job_id] = next((rec for rec in found[i * len(where):(i + 1) * len(where)] if rec), {})
    return out


def states(run: Run, ids: list[str]) -> dict[str, str | None]:
    return {job_id: rec.get("state") for job_id, rec in records(run, ids).items()}


def in_cut(run: Run, at: float) -> bool:
    """Was something acknowledged at `at` inside a second of writes a power loss dropped?"""
    return any(cut_at <= at <= killed_at for cut_at, killed_at, _ in run.cuts)


def check(run: Run, planned: list[dict[str, Any]]) -> dict[str, Any]:
    """Every acknowledged job against its record and the ledger."""
    acked = {k: float(v) for k, v in run.ledger.hgetall("acked").items()}
    runs = {k: int(v) for k, v in run.ledger.hgetall("runs").items()}
    done = {k: int(v) for k, v in run.ledger.hgetall("done").items()}
    recs = records(run, sorted(acked))
    res: dict[str, Any] = {
        "planned": len(planned), "enqueued": len(acked), "completed": 0,
        "failed_as_designed": collections.Counter(), "failed_otherwise": {}, "lost": {}, "lost_to_everysec": {},
        "stuck": {}, "inconsistent": {}, "duplicates": 0, "extra_runs": 0, "why": collections.Counter(),
        "unmatched_starts": {},
    }
    for job_id, rec in recs.items():
        kind, state = kind_of(job_id), rec.get("state")
        n_runs, n_done = runs.get(job_id, 0), done.get(job_id, 0)
        if not rec:
            what = f"acknowledged at {acked[job_id]:.3f}, ran {n_runs}, done {n_done}"
            if in_cut(run, acked[job_id]):
                res["lost_to_everysec"][job_id] = what
            elif n_done:
                res["inconsistent"][job_id] = f"record vanished; {what}"
            else:
                res["lost"][job_id] = what
            continue
        if state not in FINAL:
            res["stuck"][job_id] = rec
            continue
        if state == "completed":
            res["completed"] += 1
            if kind in ("fail", "overtime") or not n_done:
                res["inconsistent"][job_id] = f"completed, yet kind {kind}, done {n_done}"
        else:
            error = rec.get("error_type", "")
            designed = (kind == "fail" and error.endswith("PlannedFailure")) or (
                kind == "overtime" and error == "TimeLimitExceeded")
            if designed:
                res["failed_as_designed"][f"{kind}: {error.rsplit('.', 1)[-1]}"] += 1
            else:
                res["failed_otherwise"][job_id] = f"{state} {error}: {rec.get('error', '')[:100]}"
        extra = n_runs - PLANNED_RUNS.get(kind, 1)
        if extra > 0:
            res["duplicates"] += 1
            res["extra_runs"] += extra
            ends = [rec[f"end:{n}"] for n in range(1, int(rec.get("attempts", 0)) + 1) if f"end:{n}" in rec]
            why = {reason_of(e) for e in ends[:-1]
                   if "returned before it began" not in e and ", retry " not in e}
            unmatched = unmatched_starts(run.ledger.lrange(f"starts:{job_id}", 0, -1), rec)
            if unmatched:
                why.add(FORGOT)
                res["unmatched_starts"][job_id] = unmatched
            for w in why or {"unexplained"}:
                res["why"][w] += 1
    res["never_acknowledged"] = len(planned) - len(acked)
    res["cron"] = check_cron(run)
    res["recovery"] = recovery(run)
    res["zombies"] = zombies(run, recs)
    res["history"] = check_history(run, recs)
    return res


def check_history(run: Run, recs: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Every job that ended has one history record of its end: archived by the dispatchers
    while they were killed and restarted (and Redis with them), the rest archived here, the
    archive read as `analyze` reads it (live files only). `missing`: jobs that ended with no
    such record; `doubled`: with more than one (a power loss under everysec may drop an end
    that was archived already: the job ends again). Without pyarrow: not checked (None)."""
    from taskrunner.errors import MissingExtra
    from taskrunner.ops.history import Archiver, dates, live_files, open_dir, queue_dirs

    directory = str(run.dir / "history")
    where = physical(run, ["default"])
    # Every process is stopped: a lock left is a killed dispatcher's (it would hold for 300 s),
    # and the range it recorded is written again here, as the next archiver would.
    for q in where:  # one key a call: on a cluster each shard's is in a slot of its own
        run.r.delete(tasks_chaos.app.keys.q(q) + "history:lock")
    try:
        Archiver(tasks_chaos.app, directory).archive(where)
    except MissingExtra:
        return {"records": None, "missing": {}, "doubled": {}}
    import pyarrow.parquet as pq

    fs, root = open_dir(directory)
    ends: collections.Counter[tuple[str, str]] = collections.Counter()

    for day in dates(fs, root):
        for folder in queue_dirs(fs, root, day):
            if folder.rsplit("queue=", 1)[1] in where:
                for f in live_files(fs, folder):
                    table = pq.read_table(f.path, filesystem=fs, columns=["id", "state"])
                    ends.update(zip(table.column("id").to_pylist(), table.column("state").to_pylist()))
    out: dict[str, Any] = {"records": sum(ends.values()), "missing": {}, "doubled": {}}
    for job_id, rec in recs.items():
        state = rec.get("state")
        if state in FINAL:
            n = ends[(job_id, state)]
            if n == 0:
                out["missing"][job_id] = state
            elif n > 1:
                out["doubled"][job_id] = f"{n} {state} records"
    return out


def enqueue_workflows(args: argparse.Namespace, ledger: redis.Redis) -> None:
    """The chord and the chain of --workflows, each written by one call (fixed ids: a call
    repeated after a lost answer adds nothing); the time Redis acknowledged them, in the ledger."""
    from taskrunner import chain, chord

    t = tasks_chaos
    members = [t.member.s(f"wf-m-{i}", i).set(job_id=f"wf-m-{i}") for i in range(args.chord)]
    steps = [t.step.s(0, "wf-s-0").set(job_id="wf-s-0")]
    steps += [t.step.s(f"wf-s-{i}").set(job_id=f"wf-s-{i}") for i in range(1, args.chain)]
    for what in (chord(members, t.collect.s("wf-collect").set(job_id="wf-collect")), chain(*steps)):
        for _ in range(50):
            try:
                what.apply_async()
                break
            except REDIS_ERRORS as e:
                if not transient(e) and not isinstance(e, redis.BusyLoadingError):
                    raise
                time.sleep(0.2)
    ledger.set("wf:acked", f"{time.time():.6f}")


def check_workflows(run: Run) -> dict[str, Any]:
    """The chord and the chain of --workflows against their records and the ledger."""
    n, length = run.args.chord, run.args.chain
    members, steps = [f"wf-m-{i}" for i in range(n)], [f"wf-s-{i}" for i in range(length)]
    recs = records(run, [*members, *steps, "wf-collect"], queue="wf")
    runs = {k: int(v) for k, v in run.ledger.hgetall("runs").items()}
    collected = [json.loads(x) for x in run.ledger.lrange("wf:collected", 0, -1)]
    expected = [i * i for i in range(n)]
    callback = recs.get("wf-collect") or {}
    res: dict[str, Any] = {
        "members": n, "members_completed": sum(recs[m].get("state") == "completed" for m in members),
        "members_never_ran": [m for m in members if not runs.get(m)],
        "steps": length, "steps_completed": sum(recs[s].get("state") == "completed" for s in steps),
        "chain_result": (recs.get(steps[-1]) or {}).get("result"),
        "callback_state": callback.get("state"), "callback_deliveries": int(callback.get("attempts", 0)),
        "callback_runs": len(collected),
        "callback_runs_with_every_result_in_order": sum(c == expected for c in collected),
        "extra_member_runs": sum(max(0, runs.get(m, 0) - 1) for m in [*members, *steps]),
    }
    acked = float(run.ledger.get("wf:acked") or 0)
    res["dropped_by_everysec"] = not callback and in_cut(run, acked)
    res["ok"] = res["dropped_by_everysec"] or (
        res["members_completed"] == n and not res["members_never_ran"] and res["steps_completed"] == length
        and res["chain_result"] == str(length) and res["callback_state"] == "completed" and res["callback_runs"] >= 1
        and res["callback_runs_with_every_result_in_order"] == res["callback_runs"])
    return res


def unmatched_starts(starts: list[str], rec: dict[str, str]) -> list[str]:
    """Runs in the ledger ("<time> <pid>") that no delivery on record accounts for: each
    delivery that began (`run:<n>`, not ended "returned before it began") accounts for one
    start in its process (the holding entry's pid) at or after its claim."""
    deliveries = []
    for n in range(1, int(rec.get("attempts", 0)) + 1):
        if "returned before it began" in rec.get(f"end:{n}", ""):
            continue
        try:
            entry = codec.loads(rec.get(f"run:{n}", ""))
            deliveries.append((int(entry["pid"]), float(entry["started_at"])))
        except (ValueError, KeyError, TypeError):
            continue
    unmatched = []
    for start in starts:
        at, pid = float(start.split()[0]), int(start.split()[1])
        match = next((d for d in deliveries if d[0] == pid and d[1] <= at + 0.01), None)
        if match is None:
            unmatched.append(start)
        else:
            deliveries.remove(match)
    return unmatched


def zombies(run: Run, recs: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """What each paused worker held, whether another worker ran it to its end, and what
    the worker said when it came back: results fenced off, jobs stopped as no longer its."""
    out = []
    for name, ids in run.zombies:
        try:
            text = (run.dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            text = ""
        ids = [i for i in ids if not i.startswith("cron.")]
        last = [recs.get(i, {}).get("worker") for i in ids]
        out.append({"worker": name, "held": len(ids), "ended_elsewhere": sum(1 for w in last if w and w != name),
                    "results_fenced_off": sum(f"job {i} was requeued and taken" in text for i in ids),
                    "stopped_as_not_its_own": sum(f"job {i} is no longer ours" in text for i in ids)})
    return out


def check_cron(run: Run) -> dict[str, Any]:
    """Cron jobs are enqueued by the dispatchers; each found must be final, and the ledger
    must count at least one run per completed tick."""
    ids = [k.rsplit(":", 1)[1] for k in run.r.scan_iter(tasks_chaos.app.keys.job("cron", "*"), count=1000)]
    recs = records(run, ids, "cron")
    by_state = collections.Counter(r.get("state") for r in recs.values())
    ticks = sorted(int(i.rsplit(".", 1)[1]) for i in ids)
    due = (ticks[-1] - ticks[0]) // 2 + 1 if ticks else 0  # the schedule ticks every 2 s
    return {"ticks": len(ids), "missed": due - len(ticks), "states": dict(by_state),
            "runs": int(run.ledger.get("cron:runs") or 0),
            "stuck": sorted(i for i, r in recs.items() if r.get("state") not in FINAL)}


def recovery(run: Run) -> dict[str, list[float]]:
    """Per fault kind, for each job held by what was killed or paused: seconds from the
    fault to its next start (ledger), for jobs that started again."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for kind, at, ids in run.kills:
        for job_id in ids:
            if job_id.startswith("cron."):
                continue
            starts = [float(s.split()[0]) for s in run.ledger.lrange(f"starts:{job_id}", 0, -1)]
            later = [t for t in starts if t > at]
            if later:
                out[kind].append(min(later) - at)
    return dict(out)


# -- one run -----------------------------------------------------------------------------------


def wait_drained(run: Run, deadline: float, enqueuer: Enqueuer) -> int:
    """Until every acknowledged job is final (or gone), or the deadline; returns how many
    are not final."""
    open_ids: set[str] = set()
    seen: set[str] = set()
    last_log = 0.0
    while True:
        run.sup.tick(time.monotonic())
        try:
            fresh = set(run.ledger.hkeys("acked")) - seen
            seen |= fresh
            open_ids |= fresh
            found = states(run, sorted(open_ids))
            open_ids = {i for i, s in found.items() if s is not None and s not in FINAL}
        except REDIS_ERRORS:
            pass
        if not open_ids and not enqueuer.is_alive() and workflows_final(run):
            return 0
        if time.monotonic() > deadline:
            return len(open_ids)
        if time.monotonic() - last_log > 5:
            log(f"  draining: {len(open_ids)} of {len(seen)} acknowledged jobs not final")
            last_log = time.monotonic()
        time.sleep(0.5)


def workflows_final(run: Run) -> bool:
    """--workflows: the chord's callback and the chain's last step ended (or are gone: a
    workflow dropped by a power loss); True without --workflows."""
    if not run.args.workflows:
        return True
    try:
        p = tasks_chaos.app.keys.q("wf")
        ends = run.r.pipeline(transaction=False).hget(p + "job:wf-collect", "state").hget(
            p + f"job:wf-s-{run.args.chain - 1}", "state").execute()
    except REDIS_ERRORS:
        return False
    return all(s is None or s in (*FINAL, "canceled") for s in ends)


def start_servers(args: argparse.Namespace, fsync: str, run_dir: Path) -> tuple[list[RedisServer], str]:
    """The Redis under test, started: one server, or with --cluster a cluster of that many
    primaries (no replicas: a primary that goes down is restarted on its own AOF, dir and
    port, as one server is); and the URL that reaches it."""
    servers, buses = [], []
    for i in range(args.cluster or 1):
        extra: tuple[str, ...] = ("--bind", "127.0.0.1", "--auto-aof-rewrite-percentage", "0")
        if args.cluster:
            buses.append(free_port())
            extra += ("--cluster-enabled", "yes", "--cluster-port", str(buses[-1]),
                      "--cluster-config-file", "nodes.conf")
        folder = run_dir / (f"redis-{i}" if args.cluster else "redis")
        servers.append(RedisServer(folder, appendonly=True, appendfsync=fsync, port=free_port(), extra=extra))
        servers[-1].start()
    if not args.cluster:
        return servers, f"redis://127.0.0.1:{servers[0].port}/0"
    from tests.topologies import join_cluster

    join_cluster([lambda s=s: node(s) for s in servers], servers[0].port, buses[0])
    return servers, "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


def run_once(args: argparse.Namespace, fsync: str, base: Path) -> dict[str, Any]:
    run_dir = base / fsync
    run_dir.mkdir(parents=True)
    ledger_server = RedisServer(run_dir / "ledger", appendonly=False)
    servers: list[RedisServer] = []
    sup: Supervisor | None = None
    aofs: list[AofTail] = []
    enqueuer: Enqueuer | None = None
    try:
        servers, url = start_servers(args, fsync, run_dir)
        env = {**os.environ, **SETTINGS, "REDIS_URL": url, "TASKRUNNER_PREFIX": PREFIX,
               tasks_chaos.LEDGER_ENV: ledger_server.url, "TASKRUNNER_HISTORY_DIR": str(run_dir / "history"),
               "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "PYTHONUNBUFFERED": "1"}
        env.pop("TASKRUNNER_APP", None)
        tasks_chaos.app.configure(redis_url=url, prefix=PREFIX)
        ledger_server.start()
        r = connect(url, socket_timeout=10)
        ledger = redis.Redis.from_url(ledger_server.url, decode_responses=True)
        aofs = [AofTail(server.dir) for server in servers]
        if args.shards > 1:  # before the workers start (they read the count then) and any job
            queue_ops.create(tasks_chaos.app, "default", shards=args.shards)
        sup = Supervisor(run_dir, env, args.workers)
        run = Run(args, fsync, run_dir, servers, r, ledger, sup, aofs)
        faults = fault_schedule(args.seed, args.window, args.workers)
        if args.workflows:  # its own schedule beside the run's
            faults = sorted(faults + fault_schedule(args.seed + 1000, args.window, args.workers), key=lambda f: f.at)
            enqueue_workflows(args, ledger)
        plan = job_plan(args.seed, args.jobs)
        log(f"run fsync={fsync}: redis at {url}, {args.workers} workers (-c {CONCURRENCY}), "
            f"{DISPATCHERS} dispatchers, {len(plan)} jobs over {0.7 * args.window:.0f}s, "
            f"{len(faults)} faults over {args.window:.0f}s; logs in {run_dir}")
        started = time.monotonic()
        enqueuer = Enqueuer(plan, 0.7 * args.window, ledger, started + args.window + args.drain)
        enqueuer.start()
        pending_faults = collections.deque(faults)
        last_log = started
        while (now := time.monotonic()) < started + args.window:
            sup.tick(now)
            while pending_faults and now - started >= pending_faults[0].at:
                fault = pending_faults.popleft()
                if not inject(run, fault) and fault.at + RETRY_AFTER < args.window - 5:
                    # its target was down: the same fault a little later, so that every kind
                    # happens (a loaded machine restarts a killed worker slowly)
                    later = dataclasses.replace(fault, at=fault.at + RETRY_AFTER)
                    pending_faults = collections.deque(sorted([*pending_faults, later], key=lambda f: f.at))
            if now - last_log > 10:
                log(f"  {now - started:5.0f}s: {enqueuer.acked} enqueued, {sum(run.injected.values())} faults")
                last_log = now
            time.sleep(0.05)
        for proc in list(sup.slots.values()):
            if proc is not None and proc.paused_until is not None:
                sup.resume(proc)
        log(f"  fault window over: {enqueuer.acked} enqueued; draining (at most {args.drain:.0f}s)")
        not_final = wait_drained(run, time.monotonic() + args.drain, enqueuer)
        enqueuer.stop_now.set()
        enqueuer.join(5)
        drained_after = time.monotonic() - started
        sup.stop("dispatcher", grace=10)  # no more cron ticks; then let the last ones run
        cron_deadline = time.monotonic() + 30
        while time.monotonic() < cron_deadline and check_cron(run)["stuck"]:
            sup.tick(time.monotonic())
            time.sleep(0.2)
        sup.stop("worker", grace=15)
        run.delayed_fsyncs += sum(delayed_fsyncs(server) for server in servers)
        res = check(run, plan)
        res["workflows"] = check_workflows(run) if args.workflows else None
        res.update(fsync=fsync, seed=args.seed, workers=args.workers, window=args.window, seconds=drained_after,
                   cluster=args.cluster, shards=args.shards,
                   not_final_at_deadline=not_final, faults=dict(run.injected), skipped=dict(run.skipped),
                   planned_faults=len(faults), redis_down=run.redis_restarts, aof_cuts=run.cuts,
                   aof_delayed_fsync=run.delayed_fsyncs, process_starts=sup.starts, unexpected_exits=sup.unexpected,
                   enqueue_retries=enqueuer.retries, enqueue_error=enqueuer.error, dir=str(run_dir))
        return res
    finally:
        if enqueuer is not None:
            enqueuer.stop_now.set()
        if sup is not None:
            sup.kill_all()
        for aof in aofs:
            aof.stop()
        for server in servers:
            server.stop()
        ledger_server.stop()


# -- the report --------------------------------------------------------------------------------


def ok(res: dict[str, Any]) -> bool:
    if res.get("workflows") is not None and not res["workflows"]["ok"]:
        return False
    return not (res["lost"] or res["stuck"] or res["cron"]["stuck"] or res["inconsistent"]
                or res["why"].get("unexplained") or res["history"]["missing"]
                or (res["fsync"] == "always" and (res["lost_to_everysec"] or res["why"].get(FORGOT)
                                                   or res["history"]["doubled"])))


def stats(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"max {values[-1]:.2f}s, median {values[len(values) // 2]:.2f}s (n={len(values)})"


def report(res: dict[str, Any]) -> str:
    rec = res["recovery"]
    all_rec = [x for v in rec.values() for x in v]
    designed = res["failed_as_designed"]
    everysec = res["lost_to_everysec"]
    ran = sum(1 for v in everysec.values() if not v.endswith("done 0"))
    lines = [
        f"== fsync {res['fsync']}, seed {res['seed']}: {res['planned']} jobs, {res['workers']} workers "
        f"(-c {CONCURRENCY}), {DISPATCHERS} dispatchers, {res['window']:.0f}s of faults, "
        f"drained {res['seconds']:.0f}s after start ==",
        "redis                          "
        + (f"a cluster of {res['cluster']} primaries (faults hit one node each; client-kill every node)"
           if res["cluster"] else "one server")
        + (f"; queue default over {res['shards']} shards" if res["shards"] > 1 else ""),
        f"machine                        {res['machine']}",
        f"jobs enqueued (acknowledged)   {res['enqueued']}"
        + (f"  ({res['never_acknowledged']} never acknowledged: {res['enqueue_error']})"
           if res["never_acknowledged"] else "")
        + f"; enqueue calls retried {res['enqueue_retries']}",
        f"completed                      {res['completed']}",
        f"failed as designed             {sum(designed.values())}  "
        + ", ".join(f"{k} {v}" for k, v in sorted(designed.items())),
        f"failed otherwise               {len(res['failed_otherwise'])}",
        f"LOST (must be 0)               {len(res['lost'])}",
        f"dropped by Redis (everysec)    {len(everysec)}  (enqueue acknowledged inside the second of AOF a "
        f"simulated power loss dropped; {ran} of them had run to the end before)",
        f"stuck (not final after drain)  {len(res['stuck'])}",
        f"inconsistent with the ledger   {len(res['inconsistent'])}",
        f"ran more than once             {res['duplicates']} jobs, {res['extra_runs']} extra runs",
        *(f"    {n:5d}  {why}" for why, n in res["why"].most_common()),
        f"fault to running again         {stats(all_rec)}",
        *(f"    {k:15s} {stats(v)}" for k, v in sorted(rec.items())),
        f"faults injected                {sum(res['faults'].values())} of {res['planned_faults']}: "
        + ", ".join(f"{k} {res['faults'].get(k, 0)}" for k in KINDS)
        + (f"; targets found down (tried again 1 s later): {res['skipped']}" if res["skipped"] else ""),
        f"redis restarts                 {len(res['redis_down'])}, down {stats(res['redis_down'])}; "
        f"AOF cut by power losses: {sum(c[2] for c in res['aof_cuts'])} bytes in {len(res['aof_cuts'])}; "
        f"aof_delayed_fsync {res['aof_delayed_fsync']}",
        f"cron ticks                     {res['cron']['ticks']} fired ({res['cron']['missed']} between the first "
        f"and the last did not), {res['cron']['states']}, {res['cron']['runs']} runs",
        *(f"zombie {z['worker']:6s}                 held {z['held']}, {z['ended_elsewhere']} ended on another worker; "
          f"back: {z['results_fenced_off']} late results fenced off, {z['stopped_as_not_its_own']} jobs stopped as "
          f"no longer its own" for z in res["zombies"]),
        f"history                        {res['history']['records']} records archived (None: no pyarrow); "
        f"jobs ended without one {len(res['history']['missing'])} (must be 0), with more than one "
        f"{len(res['history']['doubled'])}"
        f"{' (must be 0 under always)' if res['fsync'] == 'always' else ''}",
        f"processes                      {res['process_starts']} started, "
        f"{len(res['unexpected_exits'])} exited on their own",
    ]
    wf = res.get("workflows")
    if wf is not None:
        lines += [
            f"workflows                      {'OK' if wf['ok'] else 'FAIL'}"
            + (" (dropped whole by everysec: enqueued in the second a power loss cut)" if wf["dropped_by_everysec"]
               else ""),
            f"  chord                        {wf['members_completed']} of {wf['members']} members completed "
            f"({len(wf['members_never_ran'])} never ran); callback {wf['callback_state']}, "
            f"{wf['callback_deliveries']} deliveries, {wf['callback_runs']} runs, "
            f"{wf['callback_runs_with_every_result_in_order']} of them given all {wf['members']} results in order",
            f"  chain                        {wf['steps_completed']} of {wf['steps']} steps completed, "
            f"last result {wf['chain_result']}; extra runs of members and steps {wf['extra_member_runs']}",
        ]
    for title, items in (("LOST", res["lost"]), ("dropped by Redis (everysec)", everysec),
                         ("run with no delivery on record", res["unmatched_starts"]),
                         ("failed otherwise", res["failed_otherwise"]), ("inconsistent", res["inconsistent"]),
                         ("stuck", res["stuck"]), ("no history record of its end", res["history"]["missing"]),
                         ("history records of its end", res["history"]["doubled"])):
        for job_id, what in list(items.items())[:10]:
            lines.append(f"  {title}: {job_id}: {what}")
    lines += [f"  exited on its own: {u}" for u in res["unexpected_exits"][:10]]
    return "\n".join(lines)


def summary(res: dict[str, Any]) -> str:
    rec = [x for v in res["recovery"].values() for x in v]
    where = f"cluster={res['cluster']} shards={res['shards']} " if res["cluster"] else ""
    return (f"fsync={res['fsync']} seed={res['seed']} {where}jobs={res['enqueued']} completed={res['completed']} "
            f"failed_as_designed={sum(res['failed_as_designed'].values())} lost={len(res['lost'])} "
            f"dropped_by_redis_everysec={len(res['lost_to_everysec'])} "
            f"stuck={len(res['stuck']) + len(res['cron']['stuck'])} "
            f"ran_twice={res['duplicates']} max_fault_to_rerun={f'{max(rec):.1f}s' if rec else '-'} "
            f"faults={sum(res['faults'].values())} {'OK' if ok(res) else 'FAIL'}")


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    head, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20000, help="jobs to enqueue per run (default 20000)")
    p.add_argument("--seed", type=int, default=1, help="seed of the job mix and the fault schedule (default 1)")
    p.add_argument("--workers", type=int, default=3, help="worker processes, each -c 2 (default 3)")
    p.add_argument("--fsync", choices=("both", "everysec", "always"), default="both",
                   help="Redis appendfsync: one run per setting with 'both' (default)")
    p.add_argument("--window", type=float, default=150,
                   help="seconds of faults; jobs are enqueued over its first 70%% (default 150)")
    p.add_argument("--drain", type=float, default=240,
                   help="after the window, seconds every job has to become final (default 240)")
    p.add_argument("--max-time", type=float, default=1800,
                   help="stop everything after this many seconds (default 1800)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs, AOF) even when the run passes")
    p.add_argument("--shards", type=int, help="spread queue default over this many shards "
                   "(docs/PROTOCOL.md, Sharded queues; default 1: not sharded; with --cluster, 3)")
    p.add_argument("--cluster", type=int, nargs="?", const=3, default=0, metavar="PRIMARIES",
                   help="run on a local Redis Cluster of this many primaries (3 if not given), each with its AOF, "
                        "queue default sharded over them; redis faults hit one primary each")
    p.add_argument("--workflows", action="store_true", help="also a chord and a chain, with their own faults (above)")
    p.add_argument("--chord", type=int, default=500, help="members of --workflows' chord (default 500)")
    p.add_argument("--chain", type=int, default=50, help="steps of --workflows' chain (default 50)")
    a = p.parse_args(argv)
    if a.jobs < 1 or a.workers < 1 or a.window < 20:
        p.error("--jobs and --workers must be >= 1, --window >= 20")
    if a.cluster and not 2 <= a.cluster <= 16:
        p.error("--cluster: from 2 to 16 primaries")
    a.shards = a.shards if a.shards is not None else (3 if a.cluster else 1)
    if not 1 <= a.shards <= 64:
        p.error("--shards: from 1 to 64")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)

    stop_after(a.max_time, lambda: ChaosError(f"--max-time {a.max_time:.0f}s passed"))
    base = Path(tempfile.mkdtemp(prefix="trchaos-"))
    machine = (f"{platform.node()}, {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
               f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())} at start")
    results = []
    try:
        for fsync in (("everysec", "always") if a.fsync == "both" else (a.fsync,)):
            res = run_once(a, fsync, base)
            res["machine"] = machine
            results.append(res)
            print(report(res), flush=True)
    except (ChaosError, KeyboardInterrupt, RuntimeError) as e:
        log(f"chaos stopped: {type(e).__name__}: {e}; logs in {base}")
        return 2
    finally:
        signal.alarm(0)
    passed = all(ok(r) for r in results)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine, "args": vars(a), "results": results},
                                           indent=1, default=str))
    if passed and not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        log(f"run directory kept: {base}")
    print(f"chaos {'OK' if passed else 'FAIL'}: " + " | ".join(summary(r) for r in results))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
