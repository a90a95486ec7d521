"""Time to archive and to analyse N history records: `python -m bench.history [N ...]`
(default 1,000,000 and 10,000,000).

Records are generated straight into a queue's history stream (the shape the scripts write),
in slices that the stream's cap never reaches, archived to Parquet by the real archiver
(clock running only while it archives), then analysed by `taskrunner analyze` in local
mode on this machine."""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time

from taskrunner import TaskRunner
from taskrunner.ops import analyze
from taskrunner.ops.history import Archiver
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


def run(n: int) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(f"{tmp}/redis", appendonly=False) as server:
        app = TaskRunner("bench", redis_url=server.url, prefix="trhist")
        app.redis.sadd(app.keys.queues, "default")
        archiver = Archiver(app, f"{tmp}/history", batch=50_000)
        rnd, now = random.Random(1), time.time()
        archive_s = 0.0
        for start in range(0, n, SLICE):
            generate(app, min(SLICE, n - start), rnd, now)
            t = time.perf_counter()
            archiver.archive()
            archive_s += time.perf_counter() - t
            print(f"  {min(start + SLICE, n):>11,} records archived ({archive_s:.1f} s so far)", file=sys.stderr)
        spark = analyze.spark_session("local[2]")
        try:
            t = time.perf_counter()
            summary = analyze.analyze(f"{tmp}/history", 7 * 86400, now=now, spark=spark)
            analyse_s = time.perf_counter() - t
        finally:
            spark.stop()
        size = sum(f.stat().st_size for f in __import__("pathlib").Path(f"{tmp}/history").rglob("*.parquet"))
        assert summary["records"] == n, summary["records"]
        shutil.rmtree(f"{tmp}/history", ignore_errors=True)
        return archive_s, analyse_s, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sizes", nargs="*", type=int, default=[1_000_000, 10_000_000])
    a = parser.parse_args()
    rows = []
    for n in a.sizes:
        print(f"{n:,} records:", file=sys.stderr)
        archive_s, analyse_s, size = run(n)
        rows.append((n, archive_s, analyse_s, size))
    print(f"\n{'records':>12} {'archive s':>10} {'records/s':>10} {'analyse s':>10} {'Parquet MB':>11}")
    for n, archive_s, analyse_s, size in rows:
        print(f"{n:>12,} {archive_s:>10.1f} {n / archive_s:>10,.0f} {analyse_s:>10.1f} {size / 1e6:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
