"""One hot queue on a Redis Cluster: a sharded queue on a local cluster of N primaries against
the same queue, unsharded, on one server, in one run (issue 18, goal 3).

    python -m bench.cluster                                 # 3 primaries, 12 shards, 8 workers -c 2
    python -m bench.cluster --jobs 50000 --workers 4 --repeat 1 --json /tmp/cluster.json
    python -m bench.cluster --jobs 100000 --workers 5 --concurrency 3 --shards 3 --primaries 1   # a control

For each topology (`one`: one redis-server; `cluster`: --primaries primaries, the queue made
with `--shards`), and each repeat: --jobs no-op jobs are enqueued (enqueue_many), then
--workers worker processes (`taskrunner worker -A bench.tasks_taskrunner -c C -Q q`) drain
them; each job appends a byte to a file (bench/record.py). Reported per topology: jobs/s over
the last 80% of the jobs (the clock starts once 20% are done: every worker has started),
Redis CPU per job (used_cpu_sys + used_cpu_user, summed over the nodes; the kernel's share
of it, where a node's network system calls count) and the busiest node's share of it, jobs per
script call, the same Redis figures over the measured window alone (`measured`: the Redis
CPU per job and the busiest node's cores while the rate was taken: near 1.0, Redis bound
the run), Redis reads per job (its system calls reading its clients' sockets: a round trip
or a pipelined batch is one), BRPOPs, the workers' CPU per job (their processes and children, start and stop
included: with the busiest node's cores, what tells whether Redis, the machine's cores or
neither bound a run), and the ratio cluster / one. Every server runs on TCP on loopback,
without persistence. A job's placement over shards is round robin per producer: the shards
get even loads. Needs as many cores as workers + nodes to show what a cluster adds: on a 2-core machine
both topologies are bound by the cores, not by Redis. `--primaries 1` is a control: the
queue's shards all on one cluster node, which costs what one server does when cluster mode and
sharding add no work per job.

Every process started here runs in its own session and is stopped at the end; every wait has a
deadline, and the whole run stops after --max-time seconds."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench import record
from bench.bench import BenchError, BenchTimeout, Procs, log, wait_for
from bench.limits import stop_after
from taskrunner import TaskRunner
from taskrunner.ops import queue
from tests.topologies import DATA_NODE, Topology, redis_cluster

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "q"
WARM = 0.2  # share of the jobs done before the clock starts


def counts(nodes: list[redis.Redis]) -> list[dict[str, float]]:
    """Each node's counters so far: CPU seconds in the kernel (`sys`: its system calls, the
    network's among them) and in user space (`user`), the reads and writes it made on its
    clients' sockets (a round trip is one of each, a pipelined batch being one), script
    calls (FCALL or EVALSHA) and BRPOPs."""
    out = []
    for n in nodes:
        info = n.info("all")
        out.append({"sys": float(info["used_cpu_sys"]), "user": float(info["used_cpu_user"]),
                    "reads": int(info["total_reads_processed"]), "writes": int(info["total_writes_processed"]),
                    "calls": sum(info.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("fcall", "evalsha")),
                    "brpop": info.get("cmdstat_brpop", {}).get("calls", 0)})
    return out


def spent(after: list[dict[str, float]], before: list[dict[str, float]]) -> list[dict[str, float]]:
    """counts() after less counts() before, node by node."""
    return [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]


def drain(a: argparse.Namespace, url: str, nodes: list[redis.Redis], shards: int | None, work: Path,
          tag: str) -> dict[str, Any]:
    """One run on the topology at `url`: fill, drain, figures."""
    for n in nodes:
        n.flushall()
    prefix = f"bc{os.getpid()}"
    app = TaskRunner("bench-cluster", redis_url=url, prefix=prefix)
    if shards:
        queue.create(app, QUEUE, shards=shards)
    t = time.monotonic()
    for start in range(0, a.jobs, 10_000):
        app.enqueue_many([{"task": "bench.noop", "queue": QUEUE} for _ in range(min(10_000, a.jobs - start))])
    fill = time.monotonic() - t
    socket = work / f"{tag}.sock"  # record.py's done file is named after it; no server listens there
    env = {**os.environ, "REDIS_URL": url, "TASKRUNNER_PREFIX": prefix, record.SOCKET_ENV: str(socket),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    os.environ[record.SOCKET_ENV] = str(socket)  # for record.reset() and done_file() here
    record.reset()
    done_file = Path(record.done_file())
    before = counts(nodes)
    workers_before = _reaped_cpu()
    procs = Procs()
    logfile = work / f"{tag}-workers.log"
    mark: tuple[float, int] | None = None
    at_mark = before

    def finished() -> bool:
        nonlocal mark, at_mark
        done = done_file.stat().st_size if done_file.exists() else 0
        if mark is None and a.jobs * WARM <= done < a.jobs:
            mark = (time.monotonic(), done)
            at_mark = counts(nodes)
        return done >= a.jobs

    t0 = time.monotonic()
    try:
        workers = [procs.start([sys.executable, "-m", "taskrunner", "worker", "-A", "bench.tasks_taskrunner", "-c",
                                str(a.concurrency), "-Q", QUEUE, "-n", f"{tag}-{i}", "--log-level", "warning"],
                               env, logfile) for i in range(a.workers)]
        t1 = wait_for(f"{tag} drain", finished, a.timeout, 0.005, workers)
        after = counts(nodes)
    except BenchError as e:
        raise BenchError(f"{e}; the workers' log ends:\n{logfile.read_text()[-2000:]}") from None
    finally:
        procs.stop_all(grace=30)
    workers_cpu = _reaped_cpu() - workers_before  # every worker was waited for: its CPU and its children's
    if mark is None:  # ended between two looks, before one saw it past the warm-up
        mark = (t0, 0)
    nodes_spent = spent(after, before)
    used = [x["sys"] + x["user"] for x in nodes_spent]
    measured = [x["sys"] + x["user"] for x in spent(after, at_mark)]  # the window the rate is of
    total = {k: sum(x[k] for x in nodes_spent) for k in nodes_spent[0]}
    res = {"topology": tag, "jobs": a.jobs, "rate": (a.jobs - mark[1]) / max(t1 - mark[0], 1e-9),
           "redis_cpu_us_per_job": sum(used) / a.jobs * 1e6,
           "redis_sys_share": total["sys"] / sum(used) if sum(used) else 0.0,
           "busiest_node_share": max(used) / sum(used) if sum(used) else 0.0,
           "busiest_node_cpu_per_s": max(used) / max(t1 - t0, 1e-9),
           "measured_redis_cpu_us_per_job": sum(measured) / max(a.jobs - mark[1], 1) * 1e6,
           "measured_busiest_node_cores": max(measured) / max(t1 - mark[0], 1e-9),
           "redis_reads_per_job": total["reads"] / a.jobs, "redis_writes_per_job": total["writes"] / a.jobs,
           "jobs_per_script_call": a.jobs / max(total["calls"], 1), "brpops": int(total["brpop"]),
           "workers_cpu_us_per_job": workers_cpu / a.jobs * 1e6,
           "seconds_incl_start": t1 - t0, "fill_seconds": fill, "nodes": nodes_spent}
    log(f"  {tag:8} {res['rate']:9,.0f} jobs/s  Redis {res['redis_cpu_us_per_job']:5.1f} us/job "
        f"({res['redis_sys_share']:.0%} in the kernel)  busiest node {res['busiest_node_share']:.0%} of it, "
        f"{res['busiest_node_cpu_per_s']:.2f} cores (measured: {res['measured_redis_cpu_us_per_job']:.1f} us/job, "
        f"busiest {res['measured_busiest_node_cores']:.2f} cores)  "
        f"workers {res['workers_cpu_us_per_job']:5.1f} us/job  "
        f"{res['jobs_per_script_call']:.1f} jobs/script call  {res['redis_reads_per_job']:.3f} reads/job  "
        f"{res['brpops']} BRPOPs  (fill {fill:.1f} s)")
    return res


def _reaped_cpu() -> float:
    """CPU seconds of this process's children that were waited for (the workers, and through
    them their children; the Redis servers still run, so they are not in it)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=200_000, help="no-op jobs per run (default 200,000)")
    p.add_argument("--primaries", type=int, default=3, help="primaries of the cluster (default 3)")
    p.add_argument("--shards", type=int, default=12, help="shards of the queue on the cluster (default 12)")
    p.add_argument("--workers", type=int, default=8, help="worker processes (default 8)")
    p.add_argument("--concurrency", type=int, default=2, help="children per worker (default 2)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each topology, alternating (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each drain, seconds")
    p.add_argument("--max-time", type=float, default=1200.0, help="the whole run stops after this many seconds")
    p.add_argument("--json", help="also write every run's figures as JSON to this path")
    a = p.parse_args(argv)
    if a.jobs < 100 or a.repeat < 1 or a.workers < 1 or a.primaries < 1 or not 1 <= a.shards <= 64:
        p.error("--jobs >= 100, --repeat, --workers and --primaries >= 1, --shards from 1 to 64")
    stop_after(a.max_time, lambda: BenchTimeout(f"the run passed --max-time {a.max_time:g} s"))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp, Topology(Path(tmp) / "one") as one_t, \
            Topology(Path(tmp) / "cluster") as cluster_t:
        single = one_t.start(*DATA_NODE)
        cluster = redis_cluster(cluster_t, a.primaries)
        one_nodes = [single.client()]
        cluster_nodes = [n.client() for n in cluster.primaries]
        log(f"one server at 127.0.0.1:{single.port}; cluster {cluster.url()}; {a.jobs:,} jobs, "
            f"{a.workers} workers -c {a.concurrency}, queue {QUEUE} with {a.shards} shards on the cluster")
        try:
            for rep in range(a.repeat):
                log(f"repeat {rep + 1}/{a.repeat}")
                runs.append(drain(a, f"redis://127.0.0.1:{single.port}", one_nodes, None, Path(tmp), "one"))
                runs.append(drain(a, cluster.url(), cluster_nodes, a.shards, Path(tmp), "cluster"))
        except BenchError as e:
            log(f"bench stopped: {e}")
            return 2
        finally:
            for n in one_nodes + cluster_nodes:
                n.close()
    rate = {t: statistics.median(r["rate"] for r in runs if r["topology"] == t) for t in ("one", "cluster")}
    cpu_job, workers_job, reads, per_call, measured, busiest = (
        {t: statistics.median(r[k] for r in runs if r["topology"] == t) for t in ("one", "cluster")}
        for k in ("redis_cpu_us_per_job", "workers_cpu_us_per_job", "redis_reads_per_job", "jobs_per_script_call",
                  "measured_redis_cpu_us_per_job", "measured_busiest_node_cores"))
    print(f"one hot queue, {a.jobs:,} no-op jobs, {a.workers} workers -c {a.concurrency}, {os.cpu_count()} cores, "
          f"medians of {a.repeat}")
    print(f"  one server:                {rate['one']:9,.0f} jobs/s  Redis {cpu_job['one']:.1f} us/job  "
          f"(measured: {measured['one']:.1f}, {busiest['one']:.2f} cores)  workers {workers_job['one']:.1f} us/job  "
          f"{per_call['one']:.1f} jobs/script call  "
          f"{reads['one']:.3f} reads/job")
    print(f"  cluster of {a.primaries}, {a.shards} shards: {rate['cluster']:9,.0f} jobs/s  "
          f"Redis {cpu_job['cluster']:.1f} us/job (all nodes; measured: {measured['cluster']:.1f}, busiest node "
          f"{busiest['cluster']:.2f} cores)  workers {workers_job['cluster']:.1f} us/job  "
          f"{per_call['cluster']:.1f} jobs/script call  {reads['cluster']:.3f} reads/job")
    # Each repeat's own pair too: where one server's cost per job swings from run to run (a
    # VM's host, PERFORMANCE.md, *Ninth session*), the ratio of the runs made side by side.
    pairs = [c["rate"] / o["rate"] for o, c in zip(runs[0::2], runs[1::2])]
    print(f"  cluster / one server: {rate['cluster'] / rate['one']:.2f}x jobs/s (of the medians); each repeat's: "
          f"{', '.join(f'{x:.2f}x' for x in pairs)} (median {statistics.median(pairs):.2f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
