"""Where `taskrunner analyze`'s time goes: `python -m bench.analyze_phases [--records N]
[--dir D] [--rounds R]` (default 1,000,000 records, 2 rounds).

Archives N records into D (bench.history's distributions, through Redis and the real
archiver, batches of 50,000) unless D holds an archive already, starts a `local[2]` session
with analyze's settings, runs one analysis untimed (the JVM's warm-up), then R rounds of
analyze's steps, each timed: the listing (`plan`, pyarrow), Spark's file index and query
analysis (`load`), the figures job (`groups`: counts, outcomes and percentiles, GROUPING
SETS), the error types job (`errors`); and, to split the figures job, the same GROUPING SETS
without the percentiles and the percentiles of one grouping (per task) alone."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from bench.history import SLICE, generate
from taskrunner import TaskRunner
from taskrunner.ops import analyze
from taskrunner.ops.history import Archiver
from taskrunner.ops.redis_server import RedisServer


def archive(n: int, directory: str) -> None:
    with RedisServer(f"{directory}.redis", appendonly=False) as server:
        app = TaskRunner("bench", redis_url=server.url, prefix="trhist")
        app.redis.sadd(app.keys.queues, "default")
        archiver, rnd, now = Archiver(app, directory, batch=50_000), random.Random(1), time.time()
        for start in range(0, n, SLICE):
            generate(app, min(SLICE, n - start), rnd, now)
            archiver.archive()
            print(f"  {min(start + SLICE, n):>11,} records archived", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--dir", default="/tmp/taskrunner-bench-history", help="the archive (made if absent)")
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    if not os.path.isdir(a.dir):
        archive(a.records, a.dir)
    from pyspark.sql import functions as F

    spark = analyze.spark_session("local[2]")
    root, start = analyze.spark_location(a.dir), time.time() - 7 * 86400
    analyze.analyze(a.dir, 7 * 86400, spark=spark)  # warm-up, untimed
    sets = "GROUP BY GROUPING SETS ((task), (queue), (host), (hour))"
    try:
        for r in range(a.rounds):
            times = {}
            t = time.perf_counter()
            files, read = analyze.plan(a.dir, start)
            times["plan"], t = time.perf_counter() - t, time.perf_counter()
            df = analyze._load(spark, root, files, start, F)
            df.schema  # noqa: B018 — the file index is built as the query is analysed
            times["load"], t = time.perf_counter() - t, time.perf_counter()
            figures = analyze._groups(spark, df)
            times["groups"], t = time.perf_counter() - t, time.perf_counter()
            analyze._errors(spark, df)
            times["errors"], t = time.perf_counter() - t, time.perf_counter()
            spark.sql(f"SELECT task, queue, host, hour, count(1) FROM {{df}} {sets}", df=df).collect()
            times["groups without percentiles"], t = time.perf_counter() - t, time.perf_counter()
            spark.sql(f"SELECT task, percentile_approx(runtime, array(0.5, 0.95, 0.99), {analyze.ACCURACY}), "
                      f"percentile_approx(wait, array(0.5, 0.95), {analyze.ACCURACY}) FROM {{df}} GROUP BY task",
                      df=df).collect()
            times["percentiles per task alone"] = time.perf_counter() - t
            assert sum(row["count"] for row in figures["tasks"]) == a.records
            print(f"round {r + 1} ({read['files']} files, load average {os.getloadavg()[0]:.1f}): " +
                  ", ".join(f"{k} {v:.2f} s" for k, v in times.items()), flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
