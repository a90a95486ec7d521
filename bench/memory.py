"""Worker memory over a long run: does anything grow with the number of jobs done?

    python -m bench.memory                    # 1,000,000 no-op jobs through `worker -c 2`
    python -m bench.memory --jobs 200000 --interval 2

Starts its own redis-server (unix socket, no persistence), a dispatcher and one worker with
two children, keeps the queue topped up (enqueue_many, never more than 100,000 waiting) and
samples, every --interval seconds: jobs done, the RSS of the worker's main process and of
its children (psutil), the dispatcher's RSS, and Redis's used memory and key count. Results
(and failures) expire after TASKRUNNER_RESULT_TTL=30 s (TASKRUNNER_FAILED_TTL=30) here, so
Redis's size is flat once that many jobs are done. Prints a table and the growth of each
figure between the sample at 10% of the jobs (warm: imports and buffers done) and the last
one; writes bench/results/memory.txt.
Every process started here is killed as a group at the end; the run stops after --max-time."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import redis

from bench import record
from bench.bench import LOGS, RESULTS, Env, Procs, log
from taskrunner.ops.redis_server import RedisServer

TOP_UP = 20_000
MAX_WAITING = 100_000


def rss(pid: int, children: bool = False, pss: bool = False) -> int:
    """Bytes resident in the process (children: in all its descendants instead). pss: its
    proportional set size instead, each page shared with other processes (a fork's
    copy-on-write) counted as its share: what it costs the machine."""
    try:
        p = psutil.Process(pid)
        procs = p.children(recursive=True) if children else [p]
        return sum(c.memory_full_info().pss if pss else c.memory_info().rss for c in procs)
    except psutil.Error:
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1_000_000)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--max-time", type=float, default=1800.0, help="stop after this many seconds")
    a = p.parse_args(argv)
    procs = Procs()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), appendonly=False).start()
        try:
            return run(a, server, procs)
        finally:
            procs.stop_all()
            server.stop()


def run(a: argparse.Namespace, server: RedisServer, procs: Procs) -> int:
    env = Env(str(server.socket), procs, timeout=a.max_time)
    extra = {"TASKRUNNER_RESULT_TTL": "30", "TASKRUNNER_FAILED_TTL": "30", "TASKRUNNER_HISTORY_INTERVAL": "0"}
    base = {**env.base(), **extra}
    os.environ.update(base)  # for the producer below
    from bench import tasks_taskrunner as tasks  # noqa: E402 (needs the socket in the environment)

    r = redis.Redis(unix_socket_path=str(server.socket))
    done_db = redis.Redis(unix_socket_path=str(server.socket), db=record.BENCH_DB)
    pending = tasks.app.keys.q("default") + "pending"
    enqueued = 0
    stop = threading.Event()

    def produce() -> None:
        nonlocal enqueued
        while enqueued < a.jobs and not stop.is_set():
            if r.llen(pending) < MAX_WAITING - TOP_UP:
                n = min(TOP_UP, a.jobs - enqueued)
                tasks.app.enqueue_many({"task": "bench.noop"} for _ in range(n))
                enqueued += n
            else:
                stop.wait(0.2)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    dispatcher = procs.start([sys.executable, "-m", "taskrunner", "dispatcher", "-A", "bench.tasks_taskrunner",
                              "--log-level", "warning"], base, LOGS / "memory-dispatcher.log")
    [worker] = env.start_workers("taskrunner", "memory", extra)
    t0 = time.monotonic()
    rows: list[tuple[float, int, int, int, int, int, int]] = []
    try:
        while True:
            done = record.count(done_db)
            info = r.info("memory")
            rows.append((time.monotonic() - t0, done, rss(worker.pid), rss(worker.pid, children=True),
                         rss(dispatcher.pid), info["used_memory"], r.dbsize()))
            log(f"{rows[-1][0]:7.0f} s  {done:>9,} jobs  worker {rows[-1][2] / 2**20:6.1f} MB  children "
                f"{rows[-1][3] / 2**20:6.1f} MB  dispatcher {rows[-1][4] / 2**20:6.1f} MB  redis "
                f"{rows[-1][5] / 2**20:7.1f} MB  {rows[-1][6]:>8,} keys")
            if done >= a.jobs or worker.poll() is not None or time.monotonic() - t0 > a.max_time:
                break
            time.sleep(a.interval)
    finally:
        stop.set()
    text = report(a, rows)
    print(text, end="")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.txt").write_text(text)
    return 0 if rows[-1][1] >= a.jobs else 1


def report(a: argparse.Namespace, rows: list[tuple[float, int, int, int, int, int, int]]) -> str:
    mb = 2 ** 20
    lines = [f"taskrunner memory over {a.jobs:,} no-op jobs ({time.strftime('%Y-%m-%d %H:%M')}); worker -c 2,"
             " a dispatcher, results kept 30 s", "",
             f"{'s':>7} {'jobs done':>10} {'worker MB':>10} {'children MB':>12} {'dispatcher MB':>14} "
             f"{'redis MB':>9} {'keys':>9}"]
    step = max(1, len(rows) // 20)
    for t, done, w, c, d, m, k in rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else []):
        lines.append(f"{t:7.0f} {done:>10,} {w / mb:10.1f} {c / mb:12.1f} {d / mb:14.1f} {m / mb:9.1f} {k:>9,}")
    warm = next((row for row in rows if row[1] >= a.jobs // 10), rows[0])
    last = rows[-1]
    jobs = last[1] - warm[1]
    lines += ["", f"from {warm[1]:,} to {last[1]:,} jobs done ({jobs:,} jobs, {last[0] - warm[0]:.0f} s):"]
    for label, i in [("worker main process RSS", 2), ("children RSS (together)", 3), ("dispatcher RSS", 4),
                     ("Redis used memory", 5)]:
        lines.append(f"  {label:26} {warm[i] / mb:7.1f} MB -> {last[i] / mb:7.1f} MB  "
                     f"({(last[i] - warm[i]) / mb:+.1f} MB)")
    lines.append(f"  {'Redis keys':26} {warm[6]:>10,} -> {last[6]:>10,}")
    lines.append(f"  throughput {jobs / max(last[0] - warm[0], 1e-9):,.0f} jobs/s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
