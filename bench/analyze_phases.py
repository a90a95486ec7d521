"""Where `taskrunner analyze`'s time goes: `python -m bench.analyze_phases [--records N]
[--dir D] [--rounds R]` (default 1,000,000 records, 2 rounds).

Writes N records into D (bench.history's distributions, in the archiver's layout and schema:
bench.history.write_archive, batches of 50,000) unless D holds an archive already, starts a
`local[2]` session with analyze's settings, runs one analysis untimed (the JVM's warm-up),
then R rounds of analyze's steps, each timed, wall clock and the JVM's CPU time: the listing
(`plan`, pyarrow), Spark's file index and query analysis (`load`), the counts job (`counts`:
counts, outcomes, error types and the names' hashes) and the percentiles job (`histograms`)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.history import write_archive
from taskrunner.ops import analyze


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--dir", default="/tmp/taskrunner-bench-history", help="the archive (made if absent)")
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    now = time.time()
    if not os.path.isdir(a.dir):
        write_archive(a.dir, a.records, now)
    from pyspark.sql import functions as F

    spark = analyze.spark_session("local[2]")
    jvm = spark.sparkContext._gateway.proc.pid

    def cpu() -> float:  # the JVM's user + system time: steadier than the wall clock on a shared machine
        fields = open(f"/proc/{jvm}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    root, start = analyze.spark_location(a.dir), now - 7 * 86400
    analyze.analyze(a.dir, 7 * 86400, now=now, spark=spark)  # warm-up, untimed
    try:
        for r in range(a.rounds):
            times: dict[str, tuple[float, float]] = {}
            t, c = time.perf_counter(), cpu()

            def lap(name: str, times: dict[str, tuple[float, float]] = times) -> None:
                nonlocal t, c
                times[name] = (time.perf_counter() - t, cpu() - c)
                t, c = time.perf_counter(), cpu()

            files, read = analyze.plan(a.dir, start)
            lap("plan")
            df = analyze._load(spark, root, files, start, F)
            df.schema  # noqa: B018 — the file index is built as the query is analysed
            lap("load")
            counts, _, _ = analyze._counts(spark, df)
            lap("counts")
            analyze._histograms(spark, df)
            lap("histograms")
            assert sum(row["count"] for (name, _), row in counts.items() if name == "tasks") == a.records
            print(f"round {r + 1} ({read['files']} files, load average {os.getloadavg()[0]:.1f}): " +
                  ", ".join(f"{k} {w:.2f} s ({cp:.1f} s CPU)" for k, (w, cp) in times.items()), flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
