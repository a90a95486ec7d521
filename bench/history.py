"""Time to archive, analyse and compact N history records: `python -m bench.history [N ...]
[--batch B] [--direct]` (default 1,000,000 and 10,000,000; batches of 50,000).

Records are generated straight into a queue's history stream (the shape the scripts write),
in slices that the stream's cap never reaches, archived to Parquet by the real archiver in
batches of B (clock running only while it archives; --direct: written straight to Parquet
by write_archive instead, not timed), then analysed by `taskrunner analyze --since 7d` as an
operator runs it (a fresh process: Python's and the JVM's start included: "cold"), then in
local mode in this process (a SparkSession started, and one analysis run, beforehand, not
timed: the JVM's start and warm-up): over 7 days as archived (small files), compacted
(`taskrunner history compact`, timed), over 7 days again, and over 1 day (pruned: the last 2
date partitions read)."""

from __future__ import annotations

import argparse
import math
import random
import shutil
import subprocess
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


def write_archive(directory: str, n: int, now: float, batch: int = 50_000, seed: int = 1) -> None:
    """`n` records of generate()'s distributions written straight to Parquet in the archiver's
    layout and schema (a batch of `batch` consecutive records: one file per date partition it
    touches, named after its stream-id range), with pyarrow's vectorised kernels: 10M records
    in about a minute, where generating and archiving them through Redis takes 15 (for timing
    the analysis only; the values are not generate()'s, their distributions are)."""
    import os

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from taskrunner.ops.history import schema

    base_ms = int(now * 1000) - n // 1000 - 1
    for start in range(0, n, batch):
        size = min(batch, n - start)
        ids = range(start, start + size)
        u = [pc.random(size, initializer=seed * 1_000_003 + start * 5 + k) for k in range(5)]
        finished = pc.subtract(now, pc.multiply(u[0], 6 * 86400))
        normal = pc.multiply(pc.sqrt(pc.multiply(pc.ln(pc.subtract(1, u[1])), -2)),  # Box-Muller
                             pc.cos(pc.multiply(u[2], 2 * math.pi)))
        runtime = pc.round(pc.exp(pc.subtract(normal, 2)), 6)
        wait = pc.round(pc.divide(pc.ln(pc.subtract(1, u[3])), -5), 6)
        state_index = pc.cast(pc.floor(pc.multiply(u[4], 10)), pa.int32())
        states = pa.array(["completed"] * 8 + ["failed", "requeued"])
        errors = pa.array([None] * 8 + ["ValueError", None], pa.string())


        def ts(seconds: pa.Array) -> pa.Array:
            return pc.cast(pc.cast(pc.round(pc.multiply(seconds, 1e6)), pa.int64()), pa.timestamp("us", tz="UTC"))

        def cycle(names: list[str], ids: range = ids) -> pa.Array:
            return pc.take(pa.array(names), pa.array([i % len(names) for i in ids], pa.int32()))

        stream = [f"{base_ms + i // 1000}-{i % 1000}" for i in ids]
        table = pa.table({
            "id": [f"j{i}" for i in ids], "task": cycle([f"shop.task{k}" for k in range(12)]),
            "queue": pa.array(["default"] * size), "state": pc.take(states, state_index),
            "attempt": pa.array([1] * size, pa.int64()),
            "enqueued_at": ts(pc.subtract(pc.subtract(finished, runtime), wait)),
            "started_at": ts(pc.subtract(finished, runtime)), "finished_at": ts(finished),
            "runtime": runtime, "wait": wait, "worker": cycle([f"w{k}" for k in range(8)]),
            "host": cycle([f"host{k}" for k in range(4)]), "pid": pa.array([1000] * size, pa.int64()),
            "error_type": pc.take(errors, state_index), "stream_id": stream}, schema=schema())
        day = pc.strftime(table["finished_at"], format="%Y-%m-%d")
        for d in pc.unique(day).to_pylist():
            folder = f"{directory}/date={d}/queue=default"
            os.makedirs(folder, exist_ok=True)
            pq.write_table(table.filter(pc.equal(day, d)), f"{folder}/{stream[0]}_{stream[-1]}.parquet")


def run(n: int, batch: int, direct: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(f"{tmp}/redis", appendonly=False) as server:
        app = TaskRunner("bench", redis_url=server.url, prefix="trhist")
        app.redis.sadd(app.keys.queues, "default")
        archive = f"{tmp}/history"
        archiver = Archiver(app, archive, batch=batch)
        rnd, now = random.Random(1), time.time()
        out: dict[str, float] = {"archive": 0.0 if not direct else math.nan}
        if direct:
            write_archive(archive, n, now, batch)
        for start in range(0, n if not direct else 0, SLICE):
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

            t = time.perf_counter()  # as an operator runs it: a fresh process, its JVM started
            cli = subprocess.run([sys.executable, "-m", "taskrunner", "analyze", "--since", "7d", "--history-dir",
                                  archive, "--redis-url", server.url, "--json"], capture_output=True, text=True)
            out["analyse cold"] = time.perf_counter() - t
            assert cli.returncode == 0, cli.stderr[-2000:]
            print(f"  analysed (taskrunner analyze, a fresh process): {out['analyse cold']:.1f} s", file=sys.stderr)
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
    parser.add_argument("--direct", action="store_true",
                        help="write the records straight to Parquet (write_archive: the archiver's layout, no Redis; "
                             "10M in about a minute instead of 15) and time the analyses and compaction only")
    a = parser.parse_args()
    rows = []
    for n in a.sizes:
        print(f"{n:,} records:", file=sys.stderr)
        rows.append((n, run(n, a.batch, a.direct)))
    print(f"\n{'records':>12} {'archive s':>10} {'records/s':>10} {'files':>7} {'cold s':>7} {'analyse s':>10} "
          f"{'compact s':>10} {'files':>6} {'analyse s':>10} {'1d s':>6} {'Parquet MB':>11}")
    for n, r in rows:
        print(f"{n:>12,} {r['archive']:>10.1f} {n / r['archive']:>10,.0f} {r['files']:>7.0f} {r['analyse cold']:>7.1f} "
              f"{r['analyse']:>10.1f} "
              f"{r['compact']:>10.1f} {r['files compacted']:>6.0f} {r['analyse compacted']:>10.1f} "
              f"{r['analyse 1d']:>6.1f} {r['mb']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
