"""Prometheus metrics, read from Redis when scraped: the truth every worker and dispatcher
writes there, so that a figure neither vanishes with a process nor multiplies with the
number of workers (Flower's and Dramatiq's exporters scrape each process). Served at the
dashboard's GET /metrics and printed by `taskrunner metrics`; reading them changes no job.

Series (every one a gauge unless it says total or histogram):
- per task, queue and outcome: taskrunner_jobs_total (deliveries that ended, or went back in
  line: outcome completed, failed, killed, requeued; and workflow steps canceled by a failed
  parent, which never ran: outcome canceled), and per task and queue the histograms
  taskrunner_job_runtime_seconds (deliveries that ended) and taskrunner_job_queue_wait_seconds
  (first deliveries: enqueued to started). Counted from each queue's history stream by
  tally.lua when metrics are read, exactly once per record whoever reads; while someone reads
  them (the last hour), the archiver counts a batch before it trims it. Exact as long as a
  queue's stream is read (scraped or archived) before it holds 500,000 records (its cap).
- per queue: taskrunner_queue_{waiting,pending,delayed,running,stuck}, the age of its oldest pending
  job (taskrunner_queue_oldest_pending_age_seconds, 0 when none), the finished jobs still
  listed (taskrunner_queue_{completed,failed,killed,canceled}: kept for the result and failed TTLs),
  taskrunner_queue_enqueued_total and taskrunner_queue_claimed_total (counters the enqueue and
  claim scripts keep in the queue's meta hash), and its settings taskrunner_queue_closed (1
  or 0), taskrunner_queue_paused (1 or 0) and taskrunner_queue_bound (0: none); per queue and
  task, taskrunner_queue_duplicates_total: unique jobs not added because a job held their key;
- taskrunner_workers{state} (alive, dead: kept an hour), taskrunner_worker_slots (the jobs
  alive workers can run at once) and taskrunner_worker_slots_busy;
- per dispatcher: taskrunner_dispatcher_last_pass_age_seconds; taskrunner_dispatchers_alive.
A scrape costs a few pipelined reads per queue; the stuck count reads the holding lists
(as the overview does)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from taskrunner.client.job import typed
from taskrunner.ops import listing
from taskrunner.ops.queue import pending_keys
from taskrunner.protocol import scripts
from taskrunner.protocol.holders import number

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

#: The buckets (seconds) of the run time and queue wait histograms: tally.lua's BOUNDS.
BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
#: History records counted per tally.lua call (at most one entry's more: it counts whole entries).
TALLY_CHUNK = 5000
#: Seconds after a read of the metrics during which the archiver counts what it trims.
METRICS_ON = 3600

#: The exposition's content type (text format 0.0.4), for an HTTP answer.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_QUEUE_GAUGES = (
    ("waiting", "Workflow steps waiting for their parents."),
    ("pending", "Jobs waiting to run."),
    ("delayed", "Jobs due later (a delay, a retry's backoff)."),
    ("running", "Jobs held by a worker (claimed and not ended)."),
    ("stuck", "Running jobs past their max duration or held by a dead worker."),
    ("completed", "Completed jobs still listed (kept for the result TTL)."),
    ("failed", "Failed jobs still listed (kept for the failed TTL)."),
    ("killed", "Killed jobs still listed (kept for the failed TTL)."),
    ("canceled", "Workflow steps canceled by a failed parent, still listed (kept for the failed TTL)."),
)


class RedisCollector:
    """A prometheus_client collector that reads an app's Redis at each collect()."""

    def __init__(self, app: TaskRunner) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        o = listing.overview(self.app)
        now, queues = o["now"], o["queues"]
        yield from self._queues(queues, now)
        yield from self._jobs([q["name"] for q in queues])
        yield from self._workers(o["workers"])
        alive = GaugeMetricFamily("taskrunner_dispatchers_alive", "Dispatchers that made a pass lately.")
        age = GaugeMetricFamily("taskrunner_dispatcher_last_pass_age_seconds",
                                "Seconds since each dispatcher's last pass.", labels=["dispatcher"])
        for d in o["dispatchers"]:
            age.add_metric([str(d.get("name", "?"))], d["age"])
        alive.add_metric([], sum(1 for d in o["dispatchers"] if d["healthy"]))
        yield alive
        yield age

    def _queues(self, queues: list[dict[str, Any]], now: float) -> Iterator[Metric]:
        gauges = {f: GaugeMetricFamily(f"taskrunner_queue_{f}", doc, labels=["queue"]) for f, doc in _QUEUE_GAUGES}
        oldest = GaugeMetricFamily("taskrunner_queue_oldest_pending_age_seconds",
                                   "Seconds the oldest pending job has waited (0: none pending).", labels=["queue"])
        enqueued = CounterMetricFamily("taskrunner_queue_enqueued", "Jobs enqueued, ever (the queue's meta hash).",
                                       labels=["queue"])
        claimed = CounterMetricFamily("taskrunner_queue_claimed", "Deliveries claimed, ever (the queue's meta hash).",
                                      labels=["queue"])
        closed = GaugeMetricFamily("taskrunner_queue_closed", "1 when the queue refuses new jobs.", labels=["queue"])
        bound = GaugeMetricFamily("taskrunner_queue_bound", "The queue's bound as given (0: none): the most jobs it "
                                  "holds pending, or, sharded, each of its N shards ceil(bound/N).", labels=["queue"])
        paused = GaugeMetricFamily("taskrunner_queue_paused", "1 when workers claim nothing from the queue.",
                                   labels=["queue"])
        duplicates = CounterMetricFamily("taskrunner_queue_duplicates", "Unique jobs not added: a job held their key.",
                                         labels=["queue", "task"])
        pipe = self.app.redis.pipeline(transaction=False)
        lists = [pending_keys(self.app.keys.q(q["name"]), "".join(map(str, q["priorities"]))) for q in queues]
        for keys in lists:  # the oldest of each priority's list
            for key in keys:
                pipe.lindex(key, -1)
        heads = iter(pipe.execute() if queues else [])
        pipe = self.app.redis.pipeline(transaction=False)
        for q, keys in zip(queues, lists):
            for head in [next(heads) for _ in keys]:
                pipe.hget(self.app.keys.job(q["name"], head), "enqueued_at") if head else pipe.echo("")
        enqueued_at = iter(pipe.execute() if queues else [])
        for q, keys in zip(queues, lists):
            name = [q["name"]]
            for f, family in gauges.items():
                family.add_metric(name, q.get(f) or 0)
            # not a number in a foreign producer's record: none
            times = [t for t in (typed("enqueued_at", next(enqueued_at)) for _ in keys) if isinstance(t, float)]
            oldest.add_metric(name, max(0.0, now - min(times)) if times else 0.0)
            enqueued.add_metric(name, q["produced_messages"])
            claimed.add_metric(name, q["consumed_messages"])
            closed.add_metric(name, 1 if q.get("closed") else 0)
            bound.add_metric(name, q.get("bound") or 0)
            paused.add_metric(name, 1 if q.get("paused") else 0)
            for task, n in sorted(q.get("duplicates", {}).items()):
                duplicates.add_metric([q["name"], task], n)
        yield from gauges.values()
        yield from (oldest, enqueued, claimed, closed, bound, paused, duplicates)

    def _jobs(self, queues: list[str]) -> Iterator[Metric]:
        app = self.app
        app.redis.set(app.keys.g + "metrics:on", "1", ex=METRICS_ON)
        pipe = app.redis.pipeline(transaction=False)
        for q in queues:
            tally(app, q)
            pipe.hgetall(app.keys.q(q) + "stats")
        jobs = CounterMetricFamily("taskrunner_jobs", "Deliveries by how they ended (requeued: back in line; "
                                   "canceled: a workflow step that never ran).", labels=["task", "queue", "outcome"])
        runtime = HistogramMetricFamily("taskrunner_job_runtime_seconds", "Run time of deliveries that ended.",
                                        labels=["task", "queue"])
        wait = HistogramMetricFamily("taskrunner_job_queue_wait_seconds",
                                     "From enqueued to started, of first deliveries.", labels=["task", "queue"])
        for q, stats in zip(queues, pipe.execute() if queues else []):
            hist: dict[tuple[str, str], list[float]] = {}
            for field, value in stats.items():
                kind, _, rest = field.partition("|")
                if kind == "jobs":
                    task, _, outcome = rest.rpartition("|")
                    jobs.add_metric([task, q, outcome], float(value))
                elif kind in ("run", "wait"):
                    task, _, i = rest.rpartition("|")
                    hist.setdefault((kind, task), [0.0] * (len(BOUNDS) + 1))[int(i) - 1] += float(value)
            for (kind, task), counts in sorted(hist.items()):
                cumulative, buckets = 0.0, []
                for bound, n in zip([*map(str, BOUNDS), "+Inf"], counts):
                    cumulative += n
                    buckets.append((bound, cumulative))
                family = runtime if kind == "run" else wait
                family.add_metric([task, q], buckets, float(stats.get(f"{kind}_sum|{task}", 0)))
        yield from (jobs, runtime, wait)

    def _workers(self, workers: list[dict[str, Any]]) -> Iterator[Metric]:
        counts = GaugeMetricFamily("taskrunner_workers", "Workers by state (dead ones are kept an hour).",
                                   labels=["state"])
        live = [w for w in workers if w["state"] == "alive"]
        counts.add_metric(["alive"], len(live))
        counts.add_metric(["dead"], len(workers) - len(live))
        slots = GaugeMetricFamily("taskrunner_worker_slots", "Jobs the alive workers can run at once.")
        busy = GaugeMetricFamily("taskrunner_worker_slots_busy", "Jobs the alive workers run now.")
        slots.add_metric([], sum(number(w.get("concurrency")) or 0 for w in live))
        busy.add_metric([], sum(number(w.get("busy")) or 0 for w in live))
        yield from (counts, slots, busy)


def tally(app: TaskRunner, queue: str, chunks: int = 20) -> int:
    """Count a queue's new history records into its stats (tally.lua), up to `chunks` calls
    of TALLY_CHUNK records (a long backlog is caught up over several reads, each call short
    for Redis); returns how many were counted."""
    done = 0
    for _ in range(chunks):
        n = scripts.TALLY(app.redis, [app.keys.q(queue)], [TALLY_CHUNK])
        done += n
        if n < TALLY_CHUNK:
            break
    return done


def exposition(app: TaskRunner) -> bytes:
    """The metrics in Prometheus's text format, read from Redis now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(app))  # type: ignore[arg-type]
    return generate_latest(registry)
