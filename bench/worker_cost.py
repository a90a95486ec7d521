"""What one worker costs per job, and where: its main process, its children and Redis, on one
server or on a local Redis Cluster with the queue sharded (issue 18). Where bench.cluster asks
how fast a topology drains on many cores, this asks what a worker spends per job on any
machine: a 2-core one shows a change to the worker's syncs (docs/PERFORMANCE.md, eighth slice).

    python -m bench.worker_cost                             # one server, 40,000 no-op jobs, -c 2
    python -m bench.worker_cost --shards 12                 # a 3-primary cluster, the queue in 12 shards
    python -m bench.worker_cost --shards 3 --jobs 100000 --concurrency 4 --json /tmp/w.json

The jobs are enqueued first (enqueue_many), then one worker (`taskrunner worker -A
bench.tasks_taskrunner -c C -Q q`) drains them; each appends a byte to a file
(bench/record.py). Reported: jobs/s (start included), the CPU per job of the worker's main
process and of its children (read once every job is done, before they stop), Redis's CPU per
job summed over the nodes, jobs per script call (FCALL or EVALSHA), Redis reads per job (a
round trip, a pipelined batch being one) and the BRPOPs made (idle rounds on wake lists).
Every process started here is stopped at the end; every wait has a deadline."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from bench import record
from bench.bench import BenchError, BenchTimeout, Procs, log, wait_for
from bench.cluster import counts
from bench.limits import stop_after
from taskrunner import TaskRunner
from taskrunner.ops import queue
from tests.topologies import DATA_NODE, Topology, redis_cluster

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "q"


def redis_counts(nodes: list[redis.Redis]) -> dict[str, float]:
    """CPU seconds, script calls, reads and BRPOPs so far, summed over the nodes (cluster.counts())."""
    each = counts(nodes)
    out = {k: sum(x[k] for x in each) for k in ("calls", "reads", "brpop")}
    out["cpu"] = sum(x["sys"] + x["user"] for x in each)
    return out


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    with Topology(work / "redis") as topology:
        if a.shards:
            cluster = redis_cluster(topology, a.primaries)
            url, nodes = cluster.url(), [n.client() for n in cluster.primaries]
        else:
            single = topology.start(*DATA_NODE)
            url, nodes = f"redis://127.0.0.1:{single.port}", [single.client()]
        socket = work / "done.sock"  # record.py's done file is named after it; no server listens there
        os.environ[record.SOCKET_ENV] = str(socket)
        record.reset()
        prefix = f"wc{os.getpid()}"
        app = TaskRunner("bench-worker-cost", redis_url=url, prefix=prefix)
        if a.shards:
            queue.create(app, QUEUE, shards=a.shards)
        for start in range(0, a.jobs, 10_000):
            app.enqueue_many([{"task": "bench.noop", "queue": QUEUE} for _ in range(min(10_000, a.jobs - start))])
        done_file = Path(record.done_file())
        env = {**os.environ, "REDIS_URL": url, "TASKRUNNER_PREFIX": prefix, record.SOCKET_ENV: str(socket),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        before = redis_counts(nodes)
        procs = Procs()
        logfile = work / "worker.log"
        t0 = time.monotonic()
        try:
            worker = procs.start([sys.executable, "-m", "taskrunner", "worker", "-A", "bench.tasks_taskrunner", "-c",
                                  str(a.concurrency), "-Q", QUEUE, "--log-level", "warning"], env, logfile)
            t1 = wait_for("the drain", lambda: done_file.exists() and done_file.stat().st_size >= a.jobs,
                          a.timeout, 0.01, [worker])
            main = psutil.Process(worker.pid)
            main_cpu = sum(main.cpu_times()[:2])
            children_cpu = sum(sum(c.cpu_times()[:2]) for c in main.children(recursive=True))
            after = redis_counts(nodes)
        except BenchError as e:
            raise BenchError(f"{e}; the worker's log ends:\n{logfile.read_text()[-2000:]}") from None
        finally:
            procs.stop_all(grace=30)
            for n in nodes:
                n.close()
    n = a.jobs
    return {"topology": f"cluster of {a.primaries}, {a.shards} shards" if a.shards else "one server",
            "jobs": n, "rate": n / max(t1 - t0, 1e-9), "main_cpu_us_per_job": main_cpu / n * 1e6,
            "children_cpu_us_per_job": children_cpu / n * 1e6,
            "redis_cpu_us_per_job": (after["cpu"] - before["cpu"]) / n * 1e6,
            "jobs_per_script_call": n / max(after["calls"] - before["calls"], 1),
            "reads_per_job": (after["reads"] - before["reads"]) / n, "brpops": int(after["brpop"] - before["brpop"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=40_000, help="no-op jobs (default 40,000)")
    p.add_argument("--concurrency", type=int, default=2, help="the worker's children (default 2)")
    p.add_argument("--shards", type=int, default=0,
                   help="on a local cluster, the queue in this many shards (default 0: one server)")
    p.add_argument("--primaries", type=int, default=3, help="the cluster's primaries (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the drain, seconds")
    p.add_argument("--max-time", type=float, default=600.0, help="the whole run stops after this many seconds")
    p.add_argument("--json", help="also write the figures as JSON to this path")
    a = p.parse_args(argv)
    if a.jobs < 100 or a.concurrency < 1 or a.primaries < 1 or not 0 <= a.shards <= 64:
        p.error("--jobs >= 100, --concurrency and --primaries >= 1, --shards from 0 (one server) to 64")
    stop_after(a.max_time, lambda: BenchTimeout(f"the run passed --max-time {a.max_time:g} s"))
    with tempfile.TemporaryDirectory(prefix="bench-worker-cost-") as tmp:
        try:
            res = run(a, Path(tmp))
        except BenchError as e:
            log(f"bench stopped: {e}")
            return 2
    print(f"{res['topology']}: {res['jobs']:,} no-op jobs, one worker -c {a.concurrency}: {res['rate']:,.0f} jobs/s; "
          f"CPU per job: main {res['main_cpu_us_per_job']:.1f} us, children {res['children_cpu_us_per_job']:.1f} us, "
          f"Redis {res['redis_cpu_us_per_job']:.1f} us; {res['jobs_per_script_call']:.1f} jobs per script call, "
          f"{res['reads_per_job']:.3f} Redis reads per job, {res['brpops']} BRPOPs")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
