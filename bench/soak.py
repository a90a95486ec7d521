"""Soak: jobs at a steady rate for a long time, to show that nothing grows without bound.

    python -m bench.soak                          # 30 minutes at 50 jobs/s
    python -m bench.soak --minutes 5 --rate 100 --every 10
    make soak ARGS="--minutes 60"

Runs the chaos harness's stack without faults: a redis-server with AOF (everysec),
2 dispatchers and --workers workers (`-c 2`), real processes. Every second it enqueues
--rate jobs (a small JSON payload, a 0-20 ms sleep; one in ten delayed by 1-5 s) and a
cron schedule ticks every 2 s. Finished jobs expire after --result-ttl seconds (the default
of a day would make the key count grow for a day by design), and the dispatchers archive
job history to Parquet every 5 s, which keeps the history stream short.

Every --every seconds it samples: RSS of each worker (main process and children) and of
each dispatcher (psutil), and Redis's key count (DBSIZE), used_memory, pending, delayed and
history stream lengths. It prints the table as it goes (stderr) and at the end (stdout),
then the growth of each figure from the end of the warm-up (--result-ttl + 60 s, when the
expiring jobs balance the new ones) to the last sample taken while jobs were still being
enqueued, as a total and a per-hour slope of a least-squares line. The last line is a
one-line summary. Exit 1 if any enqueued job did not run, or any process exited on its own."""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import tasks_chaos  # noqa: E402
from bench.chaos import PREFIX, Supervisor, free_port, log  # noqa: E402
from bench.limits import stop_after  # noqa: E402
from taskrunner.ops.redis_server import RedisServer  # noqa: E402

COLUMNS = ("worker_rss", "child_rss", "dispatcher_rss", "keys", "used_memory", "pending", "delayed", "history")
LABELS = {"worker_rss": "worker MB", "child_rss": "children MB", "dispatcher_rss": "dispatcher MB",
          "keys": "redis keys", "used_memory": "redis MB", "pending": "pending", "delayed": "delayed",
          "history": "history"}
#: What must stay flat; the queue and stream lengths go up and down by the second.
GROWTH = ("worker_rss", "child_rss", "dispatcher_rss", "keys", "used_memory")
MB = 1024 * 1024


@dataclass
class Sample:
    t: float  # seconds since start
    enqueued: int
    done: int
    values: dict[str, float]


def rss(pid: int) -> tuple[float, float]:
    """RSS of a process and the sum of its children's, in MB."""
    try:
        p = psutil.Process(pid)
        kids = sum(c.memory_info().rss for c in p.children())
        return p.memory_info().rss / MB, kids / MB
    except psutil.Error:
        return 0.0, 0.0


def sample(sup: Supervisor, r: redis.Redis, ledger: redis.Redis, t: float, enqueued: int) -> Sample:
    """Memory per process kind (summed over the processes of that kind) and Redis's size."""
    v: dict[str, float] = collections.defaultdict(float)
    for (role, _), proc in sup.slots.items():
        if proc is None:
            continue
        main, kids = rss(proc.popen.pid)
        if role == "worker":
            v["worker_rss"] += main
            v["child_rss"] += kids
        else:
            v["dispatcher_rss"] += main
    q = tasks_chaos.app.keys.q("default")
    pipe = r.pipeline(transaction=False)
    pipe.dbsize().info("memory").llen(q + "pending").zcard(q + "delayed").xlen(q + "history")
    keys, memory, pending, delayed, history = pipe.execute()
    v.update(keys=keys, used_memory=memory["used_memory"] / MB, pending=pending, delayed=delayed, history=history)
    return Sample(t, enqueued, int(ledger.get("soak:done") or 0), dict(v))


def row(s: Sample) -> str:
    cells = [f"{s.t / 60:6.1f}", f"{s.enqueued:9d}", f"{s.done:9d}"]
    cells += [f"{s.values[c]:>{len(LABELS[c])}.1f}" if "MB" in LABELS[c] else f"{s.values[c]:>{len(LABELS[c])}.0f}"
              for c in COLUMNS]
    return "  ".join(cells)


HEADER = "  ".join(["   min", " enqueued", "      ran", *(LABELS[c] for c in COLUMNS)])


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per hour."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if var == 0 else 3600 * sum((x - mx) * (y - my) for x, y in points) / var


def growth(samples: list[Sample], warmup: float) -> list[str]:
    """Per figure: value after the warm-up, at the end, change, and slope per hour."""
    steady = [s for s in samples if s.t >= warmup] or samples[-1:]
    lines = [f"growth after the warm-up ({warmup / 60:.1f} min), {len(steady)} samples:"]
    for c in GROWTH:
        first, last = steady[0].values[c], steady[-1].values[c]
        change = f"{100 * (last - first) / first:+.1f}%" if first else "n/a"
        slope = slope_per_hour([(s.t, s.values[c]) for s in steady]) if len(steady) > 1 else 0.0
        lines.append(f"  {LABELS[c]:14s} {first:10.1f} -> {last:10.1f}  {change:>8s}  slope {slope:+.2f}/hour")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    head, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30, help="how long to enqueue (default 30)")
    p.add_argument("--rate", type=float, default=50, help="jobs enqueued per second (default 50)")
    p.add_argument("--every", type=float, default=30, help="seconds between samples (default 30)")
    p.add_argument("--workers", type=int, default=3, help="worker processes, each -c 2 (default 3)")
    p.add_argument("--result-ttl", type=int, default=120, help="seconds finished jobs are kept (default 120)")
    p.add_argument("--seed", type=int, default=1, help="seed of the payloads and delays (default 1)")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.rate <= 0 or a.every <= 0 or a.workers < 1:
        p.error("--minutes, --rate, --every and --workers must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    limit = a.minutes * 60 + a.result_ttl + 300

    stop_after(limit, lambda: TimeoutError(f"the soak passed its time limit of {limit:.0f}s"))
    rng = random.Random(f"soak-{a.seed}")
    run_dir = Path(tempfile.mkdtemp(prefix="trsoak-"))
    port = free_port()
    server = RedisServer(run_dir / "redis", appendonly=True, appendfsync="everysec", port=port,
                         extra=("--bind", "127.0.0.1"))
    ledger_server = RedisServer(run_dir / "ledger", appendonly=False)
    url = f"redis://127.0.0.1:{port}/0"
    # Failed and killed jobs too (kept 7 days by default): Redis's size is flat after the TTL.
    env = {**os.environ, "REDIS_URL": url, "TASKRUNNER_PREFIX": PREFIX, "TASKRUNNER_RESULT_TTL": str(a.result_ttl),
           "TASKRUNNER_FAILED_TTL": str(a.result_ttl),
           tasks_chaos.LEDGER_ENV: ledger_server.url, "TASKRUNNER_HISTORY_DIR": str(run_dir / "history"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    env.pop("TASKRUNNER_APP", None)
    tasks_chaos.app.configure(redis_url=url, prefix=PREFIX)
    sup: Supervisor | None = None
    samples: list[Sample] = []
    try:
        server.start()
        ledger_server.start()
        r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10)
        ledger = redis.Redis.from_url(ledger_server.url, decode_responses=True)
        sup = Supervisor(run_dir, env, a.workers)
        log(f"soak: {a.minutes:g} min at {a.rate:g} jobs/s, {a.workers} workers (-c 2), 2 dispatchers, result TTL "
            f"{a.result_ttl}s, a sample every {a.every:g}s; logs in {run_dir}")
        print(HEADER, file=sys.stderr)
        start = time.monotonic()
        enqueued, next_sample, n = 0, start, 0
        while (now := time.monotonic()) < start + a.minutes * 60:
            sup.tick(now)
            due = int((now - start) * a.rate)
            jobs = []
            for _ in range(due - enqueued):
                n += 1
                delay = rng.uniform(1, 5) if n % 10 == 0 else 0
                jobs.append({"task": "chaos.soak", "delay": delay,
                             "args": [{"n": n, "tags": ["a", "b"], "note": "x" * rng.randrange(200)},
                                      round(rng.uniform(0, 0.02), 4)]})
            if jobs:
                tasks_chaos.app.enqueue_many(jobs)
                enqueued += len(jobs)
            if now >= next_sample:
                samples.append(sample(sup, r, ledger, now - start, enqueued))
                print(row(samples[-1]), file=sys.stderr, flush=True)
                next_sample += a.every
            time.sleep(0.1)
        drain_deadline = time.monotonic() + 60
        while int(ledger.get("soak:done") or 0) < enqueued and time.monotonic() < drain_deadline:
            sup.tick(time.monotonic())
            time.sleep(0.2)
        drained = sample(sup, r, ledger, time.monotonic() - start, enqueued)
        unexpected = list(sup.unexpected)
    except (KeyboardInterrupt, TimeoutError) as e:
        log(f"soak stopped: {e}; logs in {run_dir}")
        return 2
    finally:
        signal.alarm(0)
        if sup is not None:
            sup.kill_all()
        server.stop()
        ledger_server.stop()
    done = drained.done
    print(f"soak: {a.minutes:g} min at {a.rate:g} jobs/s, {a.workers} workers (-c 2), 2 dispatchers, "
          f"result TTL {a.result_ttl}s; figures summed over the processes of each kind")
    print(HEADER)
    for s in samples:
        print(row(s))
    print(f"{row(drained)}   <- drained, after the enqueueing stopped")
    lines = growth(samples, a.result_ttl + 60)
    print("\n".join(lines))
    passed = done >= enqueued and not unexpected
    for u in unexpected:
        print(f"  exited on its own: {u}")
    if passed:
        shutil.rmtree(run_dir, ignore_errors=True)
    steady = [s for s in samples if s.t >= a.result_ttl + 60] or samples[-1:]

    def change(c: str) -> str:
        first, last = steady[0].values[c], steady[-1].values[c]
        return f"{100 * (last - first) / first:+.0f}%" if first else "n/a"

    print(f"soak {'OK' if passed else 'FAIL'}: {enqueued} jobs enqueued, {done} ran; after warm-up: worker RSS "
          f"{change('worker_rss')}, children {change('child_rss')}, dispatcher RSS {change('dispatcher_rss')}, "
          f"redis keys {change('keys')}, used_memory {change('used_memory')}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
