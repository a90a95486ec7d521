"""Time to archive, analyse and compact N history records: `python -m bench.history [N ...]
[--batch B]` (default 1,000,000 and 10,000,000; batches of 50,000).

Records are generated straight into a queue's history stream (the shape the scripts write),
in slices that the stream's cap never reaches, archived to Parquet by the real archiver in
batches of B (clock running only while it archives), then analysed by `taskrunner analyze`
in local mode on this machine (a SparkSession started, and one analysis run, beforehand, not
timed: the JVM's start and warm-up): over 7 days as archived (small files), compacted
(`taskrunner history compact`, timed), over 7 days again, and over 1 day (pruned: the last 2
date partitions read)."""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time

from taskrunner import TaskRunner
from taskrunner.ops import analyze
from taskrunner.ops.compact import Compactor
from taskrunner.ops.history import Archiver, dates
from taskrunner.ops.redis_server import RedisServer

SLICE = 200_000


def generate(app: TaskRunner, n: int, rnd: random.Random, now: float) -> None:
    key = app.keys.q("default") + "history"
    pipe = app.redis.pipeline(transaction=False)
    for i in range(n):
        finished = now - rnd.uniform(0, 6 * 86400)
        runtime, wait = rnd.lognormvariate(-2, 1), rnd.expovariate(5)
        state = rnd.choice(("completed",) * 8 + ("failed", "requeued"))
        pipe.xadd(key, {"id": f"j{i}", "task": f"shop.task{i % 12}", "queue": "default", "state": state,
                        "attempt": "1", "enqueued_at": f"{finished - runtime - wait:.6f}",
                        "started_at": f"{finished - runtime:.6f}", "finished_at": f"{finished:.6f}",
                        "runtime": f"{runtime:.6f}", "wait": f"{wait:.6f}", "worker": f"w{i % 8}",
                        "host": f"host{i % 4}", "pid": "1000", "error_type": "ValueError" if state == "failed" else ""})
        if len(pipe) >= 5000:
            pipe.execute()
    pipe.execute()


def run(n: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(f"{tmp}/redis", appendonly=False) as server:
        app = TaskRunner("bench", redis_url=server.url, prefix="trhist")
        app.redis.sadd(app.keys.queues, "default")
        archive = f"{tmp}/history"
        archiver = Archiver(app, archive, batch=batch)
        rnd, now = random.Random(1), time.time()
        out: dict[str, float] = {"archive": 0.0}
        for start in range(0, n, SLICE):
            generate(app, min(SLICE, n - start), rnd, now)
            t = time.perf_counter()
            archiver.archive()
            out["archive"] += time.perf_counter() - t
            print(f"  {min(start + SLICE, n):>11,} records archived ({out['archive']:.1f} s so far)", file=sys.stderr)
        spark = analyze.spark_session("local[2]")
        try:
            def timed(since: float, name: str) -> dict:
                t = time.perf_counter()
                summary = analyze.analyze(archive, since, now=now, spark=spark)
                out[name] = time.perf_counter() - t
                print(f"  analysed ({name}): {out[name]:.1f} s, read {summary['read']}", file=sys.stderr)
                return summary

            analyze.analyze(archive, 7 * 86400, now=now, spark=spark)  # warm-up: the JVM's first job, untimed
            summary = timed(7 * 86400, "analyse")
            assert summary["records"] == n, summary["records"]
            out["files"] = summary["read"]["files"]
            c = Compactor(app, archive)
            t = time.perf_counter()
            c.run(dates(c.fs, c.root))
            out["compact"] = time.perf_counter() - t
            summary = timed(7 * 86400, "analyse compacted")
            assert summary["records"] == n, summary["records"]
            out["files compacted"] = summary["read"]["files"]
            out["mb"] = summary["read"]["bytes"] / 1e6
            timed(86400, "analyse 1d")
        finally:
            spark.stop()
        shutil.rmtree(archive, ignore_errors=True)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sizes", nargs="*", type=int, default=[1_000_000, 10_000_000])
    parser.add_argument("--batch", type=int, default=50_000, help="records per archiver batch (default 50,000)")
    a = parser.parse_args()
    rows = []
    for n in a.sizes:
        print(f"{n:,} records:", file=sys.stderr)
        rows.append((n, run(n, a.batch)))
    print(f"\n{'records':>12} {'archive s':>10} {'records/s':>10} {'files':>7} {'analyse s':>10} {'compact s':>10} "
          f"{'files':>6} {'analyse s':>10} {'1d s':>6} {'Parquet MB':>11}")
    for n, r in rows:
        print(f"{n:>12,} {r['archive']:>10.1f} {n / r['archive']:>10,.0f} {r['files']:>7.0f} {r['analyse']:>10.1f} "
              f"{r['compact']:>10.1f} {r['files compacted']:>6.0f} {r['analyse compacted']:>10.1f} "
              f"{r['analyse 1d']:>6.1f} {r['mb']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
