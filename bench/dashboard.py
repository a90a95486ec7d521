"""Dashboard render times at scale: `python -m bench.dashboard [--pending N] [--running N] [--failed N]`.

Fills a redis-server of its own with N pending jobs and M running ones (held by a live
worker), and F failed ones (queue `failing`, 4 tasks x 5 error types, failed through the
claim and finish scripts as a worker's), then renders each page through the Flask app
in-process (no network) and prints median and p95 times, the rows an HTML page listed and
the Redis commands one request sent (INFO's total_commands_processed: load-independent).
A page reads only what it shows, so times should barely move with N pending or F failed."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import click

from dashboard import create_app
from taskrunner import TaskRunner
from taskrunner.ops.redis_server import RedisServer
from taskrunner.protocol import codec, scripts
from taskrunner.protocol.claims import STRIDE

PAGES = ["/", "/running", "/api/jobs?state=running", "/stuck", "/queues/default", "/queues/default?page=10000",
         "/api/queues", "/api/workers",
         # issue 21: the workers pages (a worker holding every running job), a workflow, the
         # live pages' polls (dashboard/watch.py)
         "/workers", "/workers/bench-worker", "/workflows/{workflow}", "/api/version/queues/default",
         "/api/version/queues/default?page=10000", "/api/version/workers", "/api/version/workers/bench-worker",
         "/api/version/workflows/{workflow}"]
#: The Failed page's filters and the search (issue 21); {id} is a failed job's id.
FAILED_PAGES = ["/failed", "/failed?page=1000", "/failed?error=E3", "/failed?queue=failing&task=bench.t1",
                "/failed?task=bench.t2&error=E4", "/failed?task=bench.t2&error=E4&page=500",
                "/api/failed?error=E1", "/search?q={id}", "/search?q=needle", "/api/search?q=needle&state=failed",
                "/queues/failing?state=failed", "/queues/failing?state=failed&page=1000",
                "/api/version/failed?since=0:0", "/api/version/failed?task=bench.t2&error=E4&since=0:0",
                "/api/version/search?q=needle"]
TASKS, ERRORS = 4, 5


def fill(app: TaskRunner, pending: int, running: int) -> list[list[str]]:
    """Enqueue `pending` + `running` jobs and claim `running` of them as worker bench-worker;
    the [queue, id] pairs it holds."""
    fields = app._fields("bench.noop", [1, "two", {"three": 3}], {"k": "v"}, *app._job_spec("bench.noop", {}))
    batch = 1000
    with click.progressbar(length=pending + running, label="enqueueing", file=sys.stderr) as bar:
        for start in range(0, pending + running, batch):
            n = min(batch, pending + running - start)
            app._enqueue_batch("default", [(codec.new_id(), 0, fields) for _ in range(n)])
            bar.update(n)
    worker = "bench-worker"
    head = codec.dumps({"worker": worker, "host": "bench", "ip": "127.0.0.1"}).decode()[:-1]
    # The oldest jobs get claimed: claim from the right end, 500 at a time (a (pid, ahead) pair each).
    held = []
    for start in range(0, running, 500):
        n = min(500, running - start)
        out = scripts.CLAIM(app.redis, [app.keys.q("default")],
                            [head, worker, "bench", "127.0.0.1", 1, 3600, *claim_slots(10000 + start, n)])
        held += [["default", out[j + 1]] for j in range(0, len(out), STRIDE)]
    return held


def heartbeat(app: TaskRunner, held: list[list[str]]) -> None:
    """bench-worker's heartbeat, listing what it holds as a worker's does (its page reads
    those jobs): sent before each page is timed, so that it is alive then."""
    scripts.HEARTBEAT(app.redis, [app.keys.g], ["bench-worker", codec.dumps(
        {"name": "bench-worker", "host": "bench", "pid": 1, "queues": ["default"], "concurrency": len(held),
         "running": held}), 3600])


def fill_workflow(app: TaskRunner, width: int = 50) -> str:
    """A chord of `width` jobs and its callback in queue `flows`; the callback's id."""
    from taskrunner import chord

    return chord([app.signature("bench.noop", [i], queue="flows") for i in range(width)],
                 app.signature("bench.noop", [], queue="flows")).delay().id


def claim_slots(first_pid: int, n: int) -> list[Any]:
    return [v for pid in range(first_pid, first_pid + n) for v in (pid, "")]


def fill_failed(app: TaskRunner, failed: int) -> str:
    """`failed` jobs of queue `failing` that ran and failed: task bench.t<i % TASKS>, error
    type E<i % ERRORS>; returns one's id."""
    worker = "bench-failer"
    head = codec.dumps({"worker": worker, "host": "bench", "ip": "127.0.0.1"}).decode()[:-1]
    p = app.keys.q("failing")
    last = ""
    with click.progressbar(length=failed, label="failing", file=sys.stderr) as bar:
        for start in range(0, failed, 500):
            n = min(500, failed - start)
            batch = []
            for i in range(start, start + n):
                task = f"bench.t{i % TASKS}"
                fields = app._fields(task, [i, "hay"], {}, *app._job_spec(task, {"queue": "failing"}))
                batch.append((codec.new_id(), 0, fields))
            app._enqueue_batch("failing", batch)
            out = scripts.CLAIM(app.redis, [p], [head, worker, "bench", "127.0.0.1", 1, 3600, *claim_slots(20000, n)])
            args: list[Any] = [3600, 600, 86400]
            for k, j in enumerate(range(0, len(out), STRIDE)):
                last = out[j + 1]
                args += [last, out[j + 2], "error", "", f"E{(start + k) % ERRORS}", "it broke", "Traceback", ""]
            scripts.FINISH(app.redis, [p], args)
            bar.update(n)
    return last


def reindex(app: TaskRunner) -> None:
    """Drop queue `failing`'s failure indexes (as before they existed), build them again with
    failures.reindex, and check they are the same."""
    from taskrunner.ops import failures

    p = app.keys.q("failing") + "failed:"
    keys = sorted(app.redis.scan_iter(p + "*", count=1000))
    before = {k: app.redis.zcard(k) for k in keys if not k.endswith(":facets")}
    app.redis.delete(*keys)
    t = time.monotonic()
    out = failures.reindex(app, "failing")
    took = time.monotonic() - t
    assert {k: app.redis.zcard(k) for k in before} == before, "reindex built other indexes"
    n = out["failing"]["failed"]["indexed"]
    print(f"failures reindex: {n:,} failed jobs of queue failing indexed in {took:.1f} s ({n / took:,.0f} jobs/s)")


def commands(app: TaskRunner, client: Any, path: str) -> int:
    """The Redis commands one GET of `path` sends (each of a pipeline or a script's own calls
    counted): what a page reads, whatever the machine's load."""
    before = app.redis.info("stats")["total_commands_processed"]
    client.get(path)
    return int(app.redis.info("stats")["total_commands_processed"]) - int(before) - 1  # less the INFO


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--running", type=int, default=2_000)
    parser.add_argument("--failed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--reindex", action="store_true", help="Drop queue failing's failure indexes and time "
                        "`taskrunner failures reindex` building them again (before the pages).")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp, appendonly=False) as server:
        app = TaskRunner("bench", redis_url=server.url, prefix="trdash")
        t0 = time.monotonic()
        held = fill(app, a.pending, a.running)
        failed_id = fill_failed(app, a.failed) if a.failed else ""
        workflow = fill_workflow(app)
        print(f"filled {a.pending:,} pending + {a.running:,} running + {a.failed:,} failed in "
              f"{time.monotonic() - t0:.0f} s; "
              f"Redis used_memory {app.redis.info('memory')['used_memory_human']}")
        if a.reindex and a.failed:
            reindex(app)
        client = create_app(app, password="", token="").test_client()
        print(f"\n{'page':44} {'median ms':>10} {'p95 ms':>8} {'bytes':>9} {'rows':>5} {'cmds':>6}")
        for path in [p.format(workflow=workflow) for p in PAGES] + (
                [p.format(id=failed_id) for p in FAILED_PAGES] if a.failed else []):
            times, size, rows = [], 0, 0
            heartbeat(app, held)  # alive for each page, however long the pages before took
            cmds = commands(app, client, path)
            for _ in range(a.repeat):
                t = time.perf_counter()
                r = client.get(path)
                times.append((time.perf_counter() - t) * 1000)
                size, rows = len(r.data), r.data.count(b'data-job="')
                assert r.status_code in (200, 302), (path, r.status_code)
            times.sort()
            p95 = times[min(len(times) - 1, int(len(times) * 0.95))]
            print(f"{path[:44]:44} {statistics.median(times):>10.1f} {p95:>8.1f} {size:>9,} {rows:>5} {cmds:>6,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
