"""I/O-bound jobs: taskrunner beside Dramatiq (threads), Celery (threads pool), arq
(asyncio) and RQ (a process per concurrent job), on one redis-server of our own, in one run.

    make bench-io                      # 20,000 jobs at 64- and 256-way; ~3 minutes
    make bench-io ARGS=--quick         # 2,000 jobs: a one-minute check
    python -m bench.io_bound --only taskrunner-async,arq --concurrency 256 --json /tmp/io.json

Each job waits 20 ms (time.sleep in a sync task, asyncio.sleep in an async one), then records
its completion by appending a byte to a file (bench/record.py). For each concurrency C and
system: --jobs jobs are enqueued, then the workers (C jobs at once in all, in PROCESSES
processes; arq in one) are started and the queue drained. Per system and concurrency:
  - jobs/s, and as a fraction of the ideal C / 20 ms: over the last 80% of the jobs (the clock
    starts when 20% are done, so that every worker process has started and imported its code);
  - worker RSS per concurrent job: the highest sum of the RSS of the worker processes and all
    their children, sampled every RSS_EVERY s during the drain, divided by C; and the same with
    PSS, which counts a page shared by several processes (a fork's) as each one's share;
  - Redis CPU per job: used_cpu_sys + used_cpu_user from the worker start to the last job,
    divided by the jobs (and round trips per job: the reads of client input Redis made, a
    pipelined batch being one; and Redis commands per job; the log and --json split them per command,
    those the scripts ran included, with their microseconds: the profile);
and the ratios of taskrunner's figures to each peer's.

taskrunner runs twice: its async tasks in loop children (`worker -c 2 --async-slots C/2`),
and its sync tasks in threads (`worker -c 2 --threads C/2 --async-slots 0`): one child per
core, each running half of the jobs at once, as a user of a 2-core host would set it. Dramatiq
and Celery get the same 2 processes with C/2 each; arq one with C (see SYSTEMS).

Every process started here runs in its own session and is killed as a group at the end;
every wait has a deadline, and the whole run stops after --max-time seconds."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench import record
from bench.bench import (
    CELERY_FLAGS,
    LOGS,
    PEERS_BIN,
    RESULTS,
    ROOT,
    BenchError,
    Env,
    Series,
    Snapshot,
    cell,
    flush,
    log,
    own_server,
    run_meta,
    save,
    wait_for,
)
from bench.memory import rss

SLEEP = 0.020  # seconds each job waits
PROCESSES = 2  # worker processes (or children) per system: one per core of the development machine
WARM = 0.2  # share of the jobs done before the clock starts
RSS_EVERY = 0.1  # seconds between two samples of the workers' memory
#: taskrunner-processes runs one child process per concurrent job; past this many it is left out
#: (256 Python processes on a 2-core machine measure the machine, not Redis).
MAX_CHILDREN = 64


@dataclass(frozen=True)
class System:
    name: str
    driver: str  # what bench/driver.py and the peers' venv call it
    kind: str  # the job it runs: io (sync, time.sleep) or aio (async, asyncio.sleep)
    processes: int  # worker processes (taskrunner: children) sharing the concurrency; 0: one per job
    workers: str  # how its workers are started, for the report ({per}: concurrency / processes)


SYSTEMS = {s.name: s for s in [
    System("taskrunner-async", "taskrunner", "aio", PROCESSES,
           "taskrunner worker -c 2 --async-slots {per} (1 worker process + 2 children, async def tasks)"),
    System("taskrunner-threads", "taskrunner", "io", PROCESSES,
           "taskrunner worker -c 2 --threads {per} --async-slots 0 (1 worker process + 2 children, sync tasks)"),
    # The classic model, as the issue-18 figures of "real jobs, one per script call" were taken:
    # each child runs one sync job at a time, so each claim and finish is for few jobs.
    System("taskrunner-processes", "taskrunner", "io", 0,
           "taskrunner worker -c C --async-slots 0 (1 worker process + C children, one job at a time each)"),
    System("dramatiq", "dramatiq", "io", PROCESSES, "dramatiq --processes 2 --threads {per}"),
    # RQ runs one job at a time per worker process: C of them (bench/bench.py's -m io).
    System("rq", "rq", "io", 0, "C x rq worker --worker-class rq.worker.SimpleWorker"),
    System("celery", "celery", "io", PROCESSES, "2 x celery worker -P threads -c {per} " + " ".join(CELERY_FLAGS)
           + " (no result backend)"),
    # One process: arq's model (asyncio, no pool), and its best here: two workers read the same
    # job ids and race for each (WATCH), which made it slower and doubled its memory.
    System("arq", "arq", "aio", 1, "1 arq worker, max_jobs {per}, poll_delay 0.01 s (bench/tasks_arq.py)"),
]}
TASKRUNNER = [s for s in SYSTEMS if s.startswith("taskrunner")]


def commands(system: System, concurrency: int, env: Env) -> tuple[list[list[str]], dict[str, str]]:
    """The worker command lines of `system` at `concurrency`, and what they add to the environment."""
    n = system.processes
    if n == 0 and system.name == "rq":
        return [[str(PEERS_BIN / "rq"), "worker", "--url", f"unix://{env.socket}", "--worker-class",
                 "rq.worker.SimpleWorker", "--logging_level", "WARNING", "default"]] * concurrency, {}
    if n == 0:
        return [[env.tr_python, "-m", "taskrunner", "worker", "-A", "bench.tasks_taskrunner_io", "-c",
                 str(concurrency), "--async-slots", "0", "--log-level", "warning"]], {}
    per = str(concurrency // n)
    if system.driver == "taskrunner":
        mode = ["--async-slots", per] if system.kind == "aio" else ["--threads", per, "--async-slots", "0"]
        return [[env.tr_python, "-m", "taskrunner", "worker", "-A", "bench.tasks_taskrunner_io", "-c", str(n),
                 *mode, "--log-level", "warning"]], {}
    if system.name == "dramatiq":
        return [[str(PEERS_BIN / "dramatiq"), "bench.tasks_dramatiq", "--processes", str(n), "--threads", per]], {}
    if system.name == "celery":
        return [[str(PEERS_BIN / "celery"), "-A", "bench.tasks_celery", "worker", "-P", "threads", "-c", per,
                 "-n", f"io{i}@%h", "--loglevel", "WARNING", *CELERY_FLAGS] for i in range(n)], {}
    if system.name == "arq":
        # python -m, not arq's CLI: that one logs every job's start and end at INFO.
        return [[env.peers_python, "-m", "bench.tasks_arq", per]] * n, {}
    raise ValueError(system.name)


def tree_memory(pids: list[int], pss: bool = False) -> int:
    """Bytes resident in these processes and all their descendants: RSS (a page shared by
    several counts in each), or PSS (each its share)."""
    return sum(rss(pid, pss=pss) + rss(pid, children=True, pss=pss) for pid in pids)


def drain(env: Env, r: redis.Redis, system: System, concurrency: int, jobs: int, logs: Path) -> dict[str, Any]:
    """One run: fill the queue, start the workers, wait for the last job; its figures."""
    rdb = redis.Redis(unix_socket_path=env.socket, db=record.BENCH_DB)
    flush(r)
    fill = env.drive(system.driver, "fill", jobs, system.kind, SLEEP, timeout=max(env.timeout, jobs / 200))
    cmds, extra = commands(system, concurrency, env)
    stats0, before = commandstats(r), Snapshot.take(r)  # the first INFO is not counted in the run
    warm = int(jobs * WARM)
    mark: tuple[float, int] | None = None  # (time, jobs done) when the clock started
    peak, peak_pss, next_sample = 0, 0, 0.0
    workers: list = []

    def finished() -> bool:
        nonlocal mark, peak, peak_pss, next_sample
        now, done = time.monotonic(), record.count(rdb)
        if mark is None and warm <= done < jobs:
            mark = (now, done)
        if now >= next_sample:
            pids = [p.pid for p in workers]
            peak, peak_pss = max(peak, tree_memory(pids)), max(peak_pss, tree_memory(pids, pss=True))
            next_sample = now + RSS_EVERY
        return done >= jobs

    logs.unlink(missing_ok=True)  # of an earlier run
    t0 = time.monotonic()
    workers = [env.procs.start(cmd, {**env.base(), **extra}, logs) for cmd in cmds]
    try:
        t1 = wait_for(f"{system.name} {concurrency}-way drain", finished, env.timeout, 0.005, workers)
        after, stats1 = Snapshot.take(r), commandstats(r)
    finally:
        env.stop_workers(workers, f"{system.name} workers")
    if mark is None:  # the drain ended between two looks, before one saw it past the warm-up
        mark = (t0, 0)
    rate = (jobs - mark[1]) / max(t1 - mark[0], 1e-9)
    res = {"system": system.name, "concurrency": concurrency, "jobs": jobs, "rate": rate,
           "of_ideal": rate / (concurrency / SLEEP), "rss_per_job_mb": peak / concurrency / 2**20,
           "rss_peak_mb": peak / 2**20, "pss_per_job_mb": peak_pss / concurrency / 2**20,
           "redis_cpu_us_per_job": (after.cpu - before.cpu) / jobs * 1e6,
           "redis_cmds_per_job": (after.commands - before.commands - 1) / jobs,  # less the closing INFO
           # Round trips: the reads of client input Redis made (less the closing INFO's), each
           # one system call in and one out; a system that batches makes fewer than one per job.
           "redis_reads_per_job": (after.reads - before.reads - 1) / jobs,
           "commands": per_job(stats0, stats1, jobs),
           "counted_jobs": jobs - mark[1], "seconds_incl_start": t1 - t0, "fill_seconds": fill["seconds"]}
    log(f"  {system.name:18} {concurrency:4}-way {rate:8,.0f} jobs/s ({res['of_ideal']:6.1%} of ideal)  "
        f"RSS {res['rss_per_job_mb']:6.3f} MB/job (PSS {res['pss_per_job_mb']:5.3f})  "
        f"Redis {res['redis_cpu_us_per_job']:5.1f} us/job  "
        f"{res['redis_cmds_per_job']:5.1f} cmds/job  (incl. start {t1 - t0:.2f} s; fill {fill['seconds']:.1f} s)")
    top = sorted(res["commands"].items(), key=lambda kv: -kv[1]["calls"])
    log("    per job: " + ", ".join(f"{k} {v['calls']:.2f} ({v['us']:.1f} us)" for k, v in top if v["calls"] >= 0.01))
    return res


def commandstats(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """Per command (those scripts run included): calls and microseconds so far."""
    return {k[len("cmdstat_"):]: (int(v["calls"]), int(v["usec"])) for k, v in r.info("commandstats").items()}


def per_job(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], jobs: int) -> dict[str, Any]:
    """The commands a run made (less our INFOs), each with its calls and microseconds per job:
    the profile that says which command a change removed."""
    out = {}
    for k, (calls, usec) in after.items():
        c0, u0 = before.get(k, (0, 0))
        if calls > c0 and k != "info":
            out[k] = {"calls": (calls - c0) / jobs, "us": (usec - u0) / jobs}
    return out


# -- report ----------------------------------------------------------------------------------

COLUMNS = [  # key in a run's figures, heading, format
    ("rate", "jobs/s", "{:,.0f}"),
    ("of_ideal", "of ideal", "{:.1%}"),
    ("rss_per_job_mb", "RSS MB/concurrent job", "{:.3f}"),
    ("pss_per_job_mb", "PSS MB/concurrent job", "{:.3f}"),
    ("redis_cpu_us_per_job", "Redis CPU us/job", "{:.1f}"),
    ("redis_cmds_per_job", "Redis cmds/job", "{:.1f}"),
    ("redis_reads_per_job", "round trips/job", "{:.2f}"),
    ("seconds_incl_start", "drain s incl. start", "{:.2f}"),
]
RATIOS = [("rate", "jobs/s (higher is better)"), ("rss_per_job_mb", "RSS per concurrent job (lower is better)"),
          ("pss_per_job_mb", "PSS per concurrent job (lower is better)"),
          ("redis_cpu_us_per_job", "Redis CPU per job (lower is better)")]


def table(rows: list[list[str]], left: int) -> list[str]:
    """Columns padded to their widest cell: the first `left` to the left, the rest to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for i, row in enumerate(rows):
        out.append("  ".join(c.ljust(widths[j]) if j < left else c.rjust(widths[j])
                             for j, c in enumerate(row)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def report(a: argparse.Namespace, runs: list[dict[str, Any]], meta: dict[str, Any], errors: list[str]) -> str:
    lines = [f"taskrunner I/O-bound benchmark — {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"machine: {meta['machine']}",
             f"redis-server {meta['redis_version']} on a unix socket (appendonly no), one server for all systems; "
             "FLUSHALL between runs",
             "versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"jobs: {a.jobs:,} per run, each waits {SLEEP * 1000:.0f} ms (time.sleep in a sync task, asyncio.sleep in "
             "an async one) then appends a byte to a file; enqueued first, then the workers started",
             f"repeats: {a.repeat} (cells: median (min–max)); jobs/s over the last {1 - WARM:.0%} of the jobs; "
             "ideal = concurrency / 20 ms",
             "RSS: highest sum over the drain of the RSS of the worker processes and their children, / concurrency;",
             "  PSS the same with each shared page (a fork's copy-on-write) counted as each process's share",
             "Redis CPU: used_cpu_sys + used_cpu_user from the worker start to the last job, / jobs",
             "workers (C: the concurrency):"]
    lines += [f"  {s:20} {SYSTEMS[s].workers.format(per='C' if SYSTEMS[s].processes == 1 else 'C/2')}"
              for s in a.systems]
    for c in a.concurrency:
        lines += ["", f"{c}-way (ideal {c / SLEEP:,.0f} jobs/s)"]
        series = {s: {k: Series([r[k] for r in runs if r["system"] == s and r["concurrency"] == c])
                      for k, _, _ in COLUMNS} for s in a.systems}
        rows = [["system", *(h for _, h, _ in COLUMNS)]]
        for s in a.systems:
            failed = sum(1 for e in errors if e.startswith(f"{s} {c}-way"))
            rows.append([s, *(cell(series[s][k] if series[s][k].values else None, f, failed) for k, _, f in COLUMNS)])
        lines += table(rows, 1)
        peers = [s for s in a.systems if s not in TASKRUNNER and series[s]["rate"].values]
        modes = [s for s in a.systems if s in TASKRUNNER and series[s]["rate"].values]
        if peers and modes:
            lines += ["", f"ratios at {c}-way, taskrunner / peer (medians):"]
            rows = [["taskrunner", "metric", *peers]]
            for m in modes:
                for k, label in RATIOS:
                    mine = series[m][k].median
                    rows.append([m, label, *(f"{mine / series[p][k].median:.2f}x" if series[p][k].median else "-"
                                             for p in peers)])
            lines += ["  " + line for line in table(rows, 2)]
    lines += ["", "notes:",
              "  - worker processes: 2 (the machine's cores), C/2 concurrent jobs in each; arq 1 (its model, and",
              "    its best here: 2 workers race for the same job ids). The clock starts once 20% of the jobs are",
              "    done, so that start-up (imports, connections, forks) is left out; 'drain s incl. start' is the",
              "    whole drain from spawning the workers.",
              "  - taskrunner-processes: C children, each running one job at a time (its claims and finishes are",
              f"    for the few jobs that ended together); run up to {MAX_CHILDREN}-way only, '-' past it; so is rq",
              "    (C worker processes, one job at a time each: RQ's model).",
              "  - RSS counts a page shared between processes (fork's copy-on-write) once in each: taskrunner's",
              "    children and Dramatiq's are forked, Celery's and arq's processes are not; PSS splits it.",
              "  - taskrunner stores each job's result (its default), as arq does; Celery runs without a result",
              "    backend, Dramatiq without its results middleware.",
              "  - arq reads its queue every poll_delay seconds; its default (0.5 s) idles a worker between reads:",
              "    here 0.01 s (bench/tasks_arq.py).",
              f"  - the machine has {os.cpu_count()} cores and other work may run on it: figures are noisy."]
    if errors:
        lines += ["", "errors (failed runs are missing from the table):", *(f"  - {e}" for e in errors)]
    return "\n".join(lines) + "\n"


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2,000 jobs: a fast check")
    p.add_argument("--jobs", type=int, help="jobs per run (default 20000; --quick: 2000)")
    p.add_argument("--concurrency", default="64,256",
                   help=f"comma-separated concurrencies, each a multiple of {PROCESSES} (default 64,256)")
    p.add_argument("--only", help="comma-separated systems among " + ",".join(SYSTEMS))
    p.add_argument("--repeat", type=int, default=1, help="runs of each system at each concurrency (default 1)")
    p.add_argument("--json", help="also write every run's figures as JSON to this path")
    p.add_argument("--out", default=str(RESULTS / "io-latest.txt"), help="where the report is saved")
    p.add_argument("--logs", default=str(LOGS / "io"), help="folder for the workers' logs, one file a run")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each wait, seconds")
    p.add_argument("--max-time", type=float, default=1800.0, help="the whole run stops after this many seconds")
    a = p.parse_args(argv)
    a.jobs = a.jobs if a.jobs is not None else (2000 if a.quick else 20000)
    if a.jobs < 1 or a.repeat < 1:
        p.error("--jobs and --repeat must be at least 1")
    try:
        a.concurrency = [int(c) for c in a.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency {a.concurrency!r}: comma-separated integers, e.g. 64,256")
    if not a.concurrency or any(c < PROCESSES or c % PROCESSES for c in a.concurrency):
        p.error(f"--concurrency: each must be a positive multiple of {PROCESSES} (one share per worker process)")
    a.systems = [s.strip() for s in (a.only or ",".join(SYSTEMS)).split(",") if s.strip()]
    bad = set(a.systems) - set(SYSTEMS)
    if bad:
        p.error(f"unknown system(s) {', '.join(sorted(bad))}; choose among {', '.join(SYSTEMS)}")
    a.drivers = list(dict.fromkeys(SYSTEMS[s].driver for s in a.systems))  # taskrunner, and peers by their name
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.chdir(ROOT)
    logs = Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    try:
        with own_server(a.max_time, a.drivers) as (procs, socket):
            return run(a, Env(socket, procs, a.timeout), logs)
    except (BenchError, KeyboardInterrupt, subprocess.SubprocessError) as e:
        log(f"bench stopped: {type(e).__name__}: {e} (logs in {logs})")
        return 2


def run(a: argparse.Namespace, env: Env, logs: Path) -> int:
    r = redis.Redis(unix_socket_path=env.socket)
    meta = run_meta(r, a.drivers)
    log(f"redis-server at {env.socket}; systems {','.join(a.systems)}; logs in {logs}")
    runs: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        # Repeats outermost, systems innermost: drift (other load on the machine) spreads over all.
        for rep in range(a.repeat):
            for c in a.concurrency:
                log(f"repeat {rep + 1}/{a.repeat}: {c}-way, {a.jobs:,} jobs")
                for s in a.systems:
                    if SYSTEMS[s].processes == 0 and c > MAX_CHILDREN:
                        continue  # see MAX_CHILDREN; its cells say "-"
                    try:
                        runs.append(drain(env, r, SYSTEMS[s], c, a.jobs, logs / f"{s}-{c}-{rep}.log"))
                    except BenchError as e:
                        if "--max-time" in str(e):
                            raise
                        errors.append(f"{s} {c}-way #{rep + 1}: {e}")
                        log(f"  FAILED {errors[-1]}")
    except BenchError as e:  # --max-time: report what was measured
        errors.append(f"bench stopped early: {e}")
        log(f"bench stopped early: {e}")
    signal.alarm(0)
    save(report(a, runs, meta, errors), Path(a.out), a.json,
         lambda: {"meta": meta, "args": vars(a), "runs": runs, "errors": errors})
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
