"""The dispatcher: requeues the jobs of dead processes, flags (and has killed) jobs past
their max duration, promotes delayed jobs and fires cron schedules.

Every action is a fenced script, so several dispatchers may run side by side, and one
killed at any moment leaves nothing half done: the next pass sees the same due buckets
and dead workers again. Cron ticks are enqueued under a job id made of the schedule and
the tick, so each tick exists once however many dispatchers fire it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from datetime import datetime, timezone
from typing import Any

import redis

from taskrunner.client import arguments, steps
from taskrunner.client.app import Schedule, TaskRunner, cron_job_id
from taskrunner.errors import MissingExtra, NameInUse, TaskRunnerError
from taskrunner.logs import Run, job_fields
from taskrunner.ops import compact, schedules
from taskrunner.ops.history import CAP, WARN_BACKLOG, Archiver, backlog, cap
from taskrunner.ops.listing import DISPATCHER_FORGET
from taskrunner.protocol import codec, joins, scripts
from taskrunner.protocol.connection import is_cluster, server_time
from taskrunner.protocol.holders import (
    Held,
    Holding,
    Lost,
    boot_id,
    lose,
    lose_held,
    may_have_begun,
    pid_namespace,
    process_gone,
    serial_by_heartbeat,
)
from taskrunner.protocol.outages import Outage

log = logging.getLogger("taskrunner.dispatcher")
# Back off and retry (every action is fenced); on a cluster also when no node is reachable.
_REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)
#: Dead workers stay listed (as dead) this long.
DEAD_KEPT = 3600
#: With missed="skip", a tick this late still fires.
SKIP_GRACE = 60.0
#: Seconds between the history cap's passes when history is not archived (history_interval 0).
CAP_EVERY = 5.0
#: Seconds between the passes that trim the finished-job sets (sweep.lua's step 3) and, on
#: one server, read the outboxes: what only tidies costs an idle queue 6 commands a pass,
#: which at a pass every 0.5 s made ~90% of an idle dispatcher's Redis work; promotions and
#: deadlines stay at every pass.
TIDY_EVERY = 10.0


class Dispatcher:
    def __init__(self, app: TaskRunner, name: str | None = None):
        self.app, self.s, self.keys = app, app.settings, app.keys
        self.redis = app.redis
        self.host = socket.gethostname()
        self.pidns, self.boot_id = pid_namespace(), boot_id()
        self.name = name or f"{self.host}.{os.getpid()}"
        self.stop_event = threading.Event()
        self._hosts: dict[str, dict[str, Any]] = {}  # worker name -> info (host, pid, ...)
        self.passes = 0
        self.next_archive = 0.0
        self.archiving = True  # False once Archiver() said pyarrow is missing
        self.next_forget = 0.0
        self.next_compact = 0.0
        self.next_tidy = 0.0
        self.compacting: threading.Thread | None = None
        self.history_backlog: dict[str, int] = {}
        self.refused: dict[str, str] = {}  # schedule name -> why its tick did not fire, as logged
        # Redis time of our first pass since we last failed to reach Redis (None: not yet).
        # Heartbeats are counted from then at the earliest: after a Redis outage no worker
        # could heartbeat, and each gets dead_after to do so before it is dead.
        self.heard_since: float | None = None
        self.looped_at = time.monotonic()  # the loop's last round, for --health-port's liveness

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        log.info("dispatcher %s: every %.2fs, %d schedules", self.name, self.s.dispatch_interval,
                 len(self.app.schedules))
        backoff = 0.0
        outage = Outage(f"dispatcher {self.name}", log)
        published = False  # Redis may be down or still loading its AOF: wait for it, as later on
        while not self.stop_event.is_set():
            started = self.looped_at = time.monotonic()
            try:
                if not published:
                    self.publish_schedules()
                    published = True
                self.run_once()
                backoff = 0.0
                outage.ok()
            except NameInUse:
                raise
            except _REDIS_ERRORS as e:
                self.heard_since = None
                backoff = min(max(backoff * 2, 0.2), 5.0)
                outage.failed(e, backoff)
            except Exception:  # a record no check foresaw must not stop requeueing for every queue
                backoff = min(max(backoff * 2, 0.2), 5.0)
                log.exception("dispatcher %s: pass failed; retrying in %.1fs", self.name, backoff)
            self.stop_event.wait(max(backoff, self.s.dispatch_interval - (time.monotonic() - started)))
        try:  # a clean stop: off the dashboard at once, where a silent entry would show "late"
            self.redis.hdel(self.keys.dispatchers, self.name)
        except _REDIS_ERRORS as e:
            log.warning("dispatcher %s: could not say goodbye (%s); the dashboard shows it late", self.name, e)
        log.info("dispatcher %s: stopped after %d passes", self.name, self.passes)
        return 0

    def publish_schedules(self) -> None:
        """Let the dashboard and CLI see the schedules this dispatcher fires. Its entry, which
        lists them, goes first: a dispatcher dropping the schedules none declares
        (drop_undeclared) then never takes one just published for stale. A name a live
        dispatcher holds is refused (NameInUse), as a worker's: two processes writing one
        entry would each list their own code's schedules in turn, and the other's would be
        dropped and published again at each of their passes. Live: a pass within dead_after,
        as a worker's heartbeat (a named dispatcher that crashed is taken over that soon, by
        its restart under a supervisor)."""
        now = server_time(self.app.redis)
        held = _info(self.redis.hget(self.keys.dispatchers, self.name))
        last = held.get("last_pass")
        if (held.get("pid"), held.get("host")) != (os.getpid(), self.host) and isinstance(last, (int, float)) \
                and now - last < self.s.dead_after:
            raise NameInUse(f"dispatcher name {self.name!r} is in use by a live dispatcher (pid {held.get('pid')} "
                            f"on {held.get('host')}, last pass {now - last:.1f}s ago); pick another with -n")
        self.announce(now)
        pipe = self.redis.pipeline(transaction=False)
        for s in self.app.schedules.values():
            pipe.sadd(self.keys.queues, s.queue)
            pipe.hsetnx(self.keys.schedules, s.name, "{}")
        pipe.execute()

    def announce(self, now: float) -> None:
        """This dispatcher's entry in `g dispatchers` (the dashboard's, /readyz's): its last
        pass, and the schedules its code declares (schedules.declarers())."""
        self.redis.hset(self.keys.dispatchers, self.name, codec.dumps({
            "name": self.name, "host": self.host, "pid": os.getpid(), "last_pass": now,
            "lag": round(time.time() - now, 3), "passes": self.passes,
            "history_backlog": {q: n for q, n in self.history_backlog.items() if n >= WARN_BACKLOG},
            "schedules": sorted(self.app.schedules)}))

    def drop_undeclared(self) -> None:
        """Drop the published schedules that nothing fires any more (removed from the code
        of every dispatcher: schedules.undeclared()), as `schedule delete` would."""
        gone = schedules.undeclared(self.app)
        if gone:
            schedules.forget(self.app, gone, unpause=False)
            log.info("dispatcher %s: dropped schedule %s: no dispatcher declares it any more, none added it at "
                     "runtime", self.name, ", ".join(gone))

    def run_once(self) -> dict[str, int]:
        """One pass; returns what it did (for logs and tests)."""
        now = server_time(self.app.redis)
        if self.heard_since is None:
            self.heard_since = now
        alive, dead = self.liveness(now)
        queues = sorted(self.redis.smembers(self.keys.queues))
        stats = {"promoted": 0, "requeued": 0, "failed": 0, "killed": 0, "stuck": 0, "fired": 0, "carried": 0}
        batch = scripts.Batch(self.redis)
        tidy = time.monotonic() >= self.next_tidy  # trim the finished sets this pass (TIDY_EVERY)
        if tidy:
            self.next_tidy = time.monotonic() + TIDY_EVERY
        # With a sweep, the queue's outbox entries older than CARRY_AFTER: what the workers that
        # left them did not carry (joins.py). Each pass on a Redis Cluster; elsewhere the
        # outboxes stay empty, looked at when tidying.
        outboxes = tidy or is_cluster(self.redis)
        older = int((now - joins.CARRY_AFTER) * 1000)
        for q in queues:
            batch.call(scripts.SWEEP, [self.keys.q(q)],
                       [1000, 100, self.s.result_ttl, self.s.failed_ttl, "1" if tidy else "0"])
            if outboxes:
                batch.pipe.xrange(joins.outbox(self.app, q), "-", older, 1000)
        results = batch.execute()
        sweeps, found = (results[0::2], results[1::2]) if outboxes else (results, [])
        corrupt: dict[str, list[Any]] = {q: [] for q in queues}  # lose.lua's values per queue
        gone: list[Held] = []  # the due deliveries of holders that are not alive
        for q, res in zip(queues, sweeps):
            stats["promoted"] += int(res[0])
            for job_id, raw in zip(res[1::2], res[2::2]):
                holder = Holding.parse(raw)
                if holder is None:
                    # Nobody can be told to stop it: requeue it (fenced by the record's attempt).
                    log.error("dispatcher: corrupt holding entry for job %s in %s: %r", job_id, q, raw[:200])
                    attempt = self.redis.hget(self.keys.job(q, job_id), "attempts") or ""
                    corrupt[q] += [job_id, attempt, f"its holding entry was corrupt: {raw[:200]!r}", "", "1"]
                elif holder.worker not in alive:
                    gone.append(Held(q, job_id, holder))
                else:
                    self._stuck(q, job_id, str(holder.attempt), stats)
        self._lose_due(queues, corrupt, gone, stats)
        left = [e for entries in found for e in joins.parse(entries)]
        if left:  # after the deadlines: a slot unreachable now must not hold up requeueing
            try:
                stats["carried"] = steps.run(self.app, steps.carry(self.app, left))
            except (*_REDIS_ERRORS, ValueError) as e:
                log.warning("dispatcher %s: could not carry %d workflow outbox entries (%s); next pass",
                            self.name, len(left), e)
        if dead:
            self._reap(queues, dead, now, stats)
        stats["fired"] = self.fire_schedules(now)
        if time.monotonic() >= self.next_archive:
            if self.s.history_interval:
                stats["archived"] = self.archive_history(queues)
            else:  # not archived: the cap still holds
                self.next_archive = time.monotonic() + CAP_EVERY
                self.cap_history(queues, archived=False)
        if self.s.history_interval and time.monotonic() >= self.next_compact:
            self.compact_history(now)
        self.passes += 1
        self.announce(now)
        if time.monotonic() >= self.next_forget:
            self.forget_gone(now)
            self.drop_undeclared()
        if any(stats.values()):
            log.info("dispatcher %s: %s", self.name, " ".join(f"{k}={v}" for k, v in stats.items() if v))
        return stats

    def _lose_due(self, queues: list[str], values: dict[str, list[Any]], gone: list[Held],
                  stats: dict[str, int]) -> None:
        """Lose the due deliveries of holders that are not alive (with `values`, the corrupt
        entries' lose.lua values per queue). Of those a dead worker's process held, only the
        first in line among them counts towards max_lost (may_have_begun()). Judged among the
        due ones only: the one that ran is first among any of its process's that include it,
        so this errs only towards counting (_reap sees a dead worker's entries whole)."""
        holders: dict[str, list[str]] = {q: [""] * (len(v) // 5) for q, v in values.items()}  # for the log
        if gone:
            serial = serial_by_heartbeat(self.app, {e.holding.worker for e in gone})
            for e, began in zip(gone, may_have_begun(gone, gone, serial)):
                values[e.queue] += [e.id, str(e.holding.attempt), f"worker {e.holding.worker} is dead", "",
                                    "1" if began else "0"]
                holders[e.queue].append(e.holding.worker)
        for q in queues:
            self._tally(lose(self.app, q, values[q], holders[q]), stats)

    def forget_gone(self, now: float) -> None:
        """Take dispatchers silent for DISPATCHER_FORGET off the list (a SIGKILLed one
        never says goodbye); once a minute."""
        self.next_forget = time.monotonic() + 60
        gone = []
        for name, raw in self.redis.hgetall(self.keys.dispatchers).items():
            last = _info(raw).get("last_pass")
            if not isinstance(last, (int, float)) or now - last >= DISPATCHER_FORGET:  # or not one at all
                gone.append(name)
        if gone:
            self.redis.hdel(self.keys.dispatchers, *gone)
            log.info("dispatcher %s: forgot %s, silent for over %.0f s", self.name, ", ".join(gone), DISPATCHER_FORGET)

    def archive_history(self, queues: list[str]) -> int:
        """Move job history to Parquet (a few batches a pass); keep each stream within CAP
        records (history.cap(): an entry may hold a finish call's many, which XADD's own cap
        counts as one), archived or not; warn loudly when a stream fills up faster than it
        is archived, before its cap could drop anything."""
        self.next_archive = time.monotonic() + self.s.history_interval
        n = 0
        if self.archiving:
            try:
                archiver = Archiver(self.app)
            except MissingExtra as e:  # a core install: said once, and history stays in Redis
                log.warning("dispatcher: job history is not archived, each queue's last %d records stay in Redis: %s",
                            CAP, e)
                self.archiving = False
            else:
                try:
                    n = archiver.archive(queues, max_batches=5)
                except OSError as e:
                    log.error("dispatcher: archiving job history to %s failed: %s", archiver.directory, e)
        held = self.cap_history(queues, archived=self.archiving)
        if not self.archiving:  # history stays in Redis, capped: nothing to warn of
            return n
        self.history_backlog = held
        for q, waiting in self.history_backlog.items():
            if waiting >= WARN_BACKLOG:
                log.error("dispatcher: %d history records of queue %s wait to be archived; the stream keeps at "
                          "most %d: archive faster (taskrunner history archive) or records will be lost",
                          waiting, q, CAP)
        return n

    def cap_history(self, queues: list[str], archived: bool) -> dict[str, int]:
        """Keep each queue's history stream within CAP records (history.cap()); the records
        each holds then. Records dropped that should have been archived are an error."""
        held = backlog(self.app, queues)
        for q, trimmed in cap(self.app, held, self.name).items():
            held[q] -= trimmed
            if archived:
                log.error("dispatcher: %d history records of queue %s dropped unarchived: its stream held "
                          "more than %d", trimmed, q, CAP)
        return held

    def compact_history(self, now: float) -> threading.Thread | None:
        """Once a day after midnight UTC, the archive's compaction (compact.daily: one
        dispatcher does it, under a lock, and records the day, so the others skip it), in
        a thread: merging a day may take minutes, and a pass must not. Checked once a minute
        (one GET); returns the thread started, if one was."""
        self.next_compact = time.monotonic() + 60
        today = datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d")
        if (self.compacting is not None and self.compacting.is_alive()) or \
                compact.done(self.redis.get(self.keys.g + "history:compacted"), today):
            return None
        self.compacting = threading.Thread(target=self._compact, args=(today,), name="compact", daemon=True)
        self.compacting.start()
        return self.compacting

    def _compact(self, today: str) -> None:
        try:
            done = compact.daily(self.app, today)
        except MissingExtra:  # archive_history says so, once
            self.next_compact = float("inf")
            return
        except Exception:  # a disk or Redis error: logged, and tried again in a minute
            log.exception("dispatcher: compacting the job history failed")
            return
        if done:
            days, stats = done
            span = f"{len(days)} days, {days[0]} to {days[-1]}" if len(days) > 1 else days[0] if days else "none"
            log.info("dispatcher %s: history compacted up to %s (days compacted: %s): %s", self.name,
                     compact.yesterday(today), span, " ".join(f"{k}={v}" for k, v in stats.items()))

    def liveness(self, now: float) -> tuple[set[str], set[str]]:
        """Workers whose heartbeat is fresh, and the others. A worker on this machine (same
        boot and PID namespace) whose process is gone is dead at once. A heartbeat's age
        counts from heard_since at the earliest: after a Redis outage longer than dead_after
        every heartbeat is old, and declaring their workers dead would kill and rerun every
        running job."""
        beats = dict(self.redis.zrange(self.keys.workers, 0, -1, withscores=True))
        unknown = [n for n in beats if n not in self._hosts]
        if unknown:
            for n, raw in zip(unknown, self.redis.mget([self.keys.worker(n) for n in unknown])):
                self._hosts[n] = _info(raw)
        alive, dead = set(), set()
        for n, last in beats.items():
            if now - max(last, self.heard_since or last) >= self.s.dead_after:
                dead.add(n)
            elif self._process_alive(self._hosts[n]):
                alive.add(n)
            else:  # its info may be older than its process (a consumer restarted under its name)
                self._hosts[n] = _info(self.redis.get(self.keys.worker(n)))
                (alive if self._process_alive(self._hosts[n]) else dead).add(n)
        return alive, dead

    def _process_alive(self, info: dict[str, Any]) -> bool:
        """False only when this machine shows that the process that sent `info` is gone (no
        process has its PID). Anything it cannot check here (another machine or namespace,
        a field missing or of the wrong type) is left to the heartbeat; other fields, such
        as create_time, are never compared: a live consumer is never dead by a guess."""
        if not self.pidns or not self.boot_id or info.get("pidns") != self.pidns or info.get("boot_id") != self.boot_id:
            return True
        pid = info.get("pid")
        return isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0 or not process_gone(pid)

    def harvest(self, queues: list[str]) -> dict[str, int]:
        """Return the running jobs of every worker that is not alive to their queues now
        (rfq's harvester), without waiting for their deadlines."""
        alive, _ = self.liveness(server_time(self.app.redis))
        stats = {"requeued": 0, "failed": 0, "killed": 0}
        self._tally(lose_held(self.app, queues, lambda e: e.holding.worker not in alive,
                              "harvested: worker {} is not alive"), stats)
        return stats

    def _stuck(self, queue: str, job_id: str, attempt: str, stats: dict[str, int]) -> None:
        res = scripts.STUCK(self.redis, [self.keys.q(queue)],
                            [job_id, attempt, time.time() + self.s.stuck_recheck, self.s.bucket_width, "check"])
        if not res:
            return
        worker, policy, first = res
        stats["stuck"] += first  # flagged now; a job left running is looked at again every stuck_recheck
        if first:
            log.warning("dispatcher: job %s in %s passed its max duration on %s", job_id, queue, worker,
                        extra=self._fields([(queue, job_id, attempt, worker)])[0])
        if policy == "kill":
            self.app.send_control(worker, {"kill": job_id, "attempt": int(attempt), "reason": "timeout"})

    def _tally(self, acted: list[Lost], stats: dict[str, int]) -> None:
        for lost, fields in zip(acted, self._fields([(x.queue, x.id, x.attempt, x.worker) for x in acted])):
            stats["requeued" if lost.state == "pending" else lost.state] += 1
            how = "lost its process" if lost.began else "waited for a process that died (had not begun: not lost)"
            log.warning("dispatcher: job %s in %s %s -> %s", lost.id, lost.queue, how, lost.state, extra=fields)

    def _fields(self, runs: list[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
        """The log fields of each run (queue, id, attempt, worker; "": unknown) the
        dispatcher acted on, with its task from the job's record: one round trip, only for
        the rare job lost or stuck."""
        if not runs:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for queue, job_id, _, _ in runs:
            pipe.hget(self.keys.job(queue, job_id), "task")
        try:
            tasks = pipe.execute()
        except _REDIS_ERRORS:  # what was done is done: logged without the task names
            tasks = [None] * len(runs)
        return [job_fields(Run(job_id, task or "", queue, attempt), worker or None)
                for (queue, job_id, attempt, worker), task in zip(runs, tasks)]

    def _reap(self, queues: list[str], dead: set[str], now: float, stats: dict[str, int]) -> None:
        """Requeue every job the dead workers held, then list them as dead."""
        self._tally(lose_held(self.app, queues, lambda e: e.holding.worker in dead, "worker {} is dead"), stats)
        pipe = self.redis.pipeline(transaction=False)
        for n in dead:
            log.warning("dispatcher: worker %s is dead", n, extra={"worker": n})
            pipe.zrem(self.keys.workers, n).zadd(self.keys.workers_dead, {n: now})
            self._hosts.pop(n, None)
        pipe.zremrangebyscore(self.keys.workers_dead, "-inf", now - DEAD_KEPT).execute()

    def fire_schedules(self, now: float) -> int:
        """Enqueue each schedule's due tick once (see Schedule.missed for downtime, and
        taskrunner/ops/schedules.py for time zones, jitter and overlap)."""
        found, paused = schedules.effective(self.app)
        if not found:
            return 0
        states = self.redis.hmget(self.keys.schedules, [s.name for s in found])
        fired = 0
        for s, raw in zip(found, states):
            try:
                fired += self._fire(s, raw, now, s.name in paused)
                self.refused.pop(s.name, None)
            except (TaskRunnerError, ValueError) as e:  # e.g. its queue closed or full, no tick left
                # Tried again at each pass (the tick fires once its queue takes it), said once.
                if self.refused.get(s.name) != str(e):
                    self.refused[s.name] = str(e)
                    log.error("dispatcher: schedule %s (%s) did not fire: %s (retried at each pass, not logged "
                              "again until it fires)", s.name, s.cron or f"every {s.every}s", e)
        return fired

    def _fire(self, s: Schedule, raw: str | None, now: float, paused: bool) -> int:
        """Fire one schedule's due tick (if any) and record its state; 1 if it fired. A
        paused schedule's ticks pass unfired (resumed, it fires from the next one)."""
        try:
            state = codec.loads(raw) if raw else {}
        except ValueError:
            state = {}
        last = state.get("last") if isinstance(state, dict) else None
        if not isinstance(last, (int, float)):
            state, last = {}, None  # corrupt: as if seen for the first time
        latest, nxt = schedules.ticks(s, now)
        if last is None or latest <= last or paused:
            tick = None  # first sight: start from now, fire nothing past
        elif s.missed == "skip" and now - latest > SKIP_GRACE:
            tick = None
        else:
            tick = latest
        fired, skipped = 0, state.get("skipped", 0)
        last_job, last_queue = state.get("last_job"), state.get("last_queue") or s.queue
        if tick is not None and s.overlap == "skip" and self._still_running(last_queue, last_job):
            log.info("dispatcher: %s skipped its tick: job %s of the one before has not ended", s.name, last_job)
            tick, skipped = None, skipped + 1
        if tick is not None:
            with arguments.unchecked():  # checked when the schedule was added
                job = self.app.enqueue(s.task, s.args, s.kwargs, queue=s.queue, job_id=cron_job_id(s.name, tick),
                                       delay=schedules.jitter_of(s, tick) or None, block_timeout=0,
                                       expires=s.expires)
            fired, last_job, last_queue = int(job.created), job.id, job.queue
            if job.created:
                log.info("dispatcher: fired %s for %s (job %s)", s.name,
                         datetime.fromtimestamp(tick, timezone.utc).isoformat(), job.id,
                         extra={**job_fields(Run(job.id, s.task, job.queue, 0)), "schedule": s.name})
        new = {"name": s.name, "cron": s.cron, "every": s.every, "tz": s.tz, "task": s.task, "queue": s.queue,
               "args": s.args, "kwargs": s.kwargs, "expires": s.expires, "source": s.source,
               "last": max(latest, last or 0), "next": nxt,
               "last_fired_at": now if tick is not None else state.get("last_fired_at"), "last_job": last_job,
               "last_queue": last_queue, "skipped": skipped}
        self.redis.hset(self.keys.schedules, s.name, codec.dumps(new))
        return fired

    def _still_running(self, queue: Any, job_id: Any) -> bool:
        """The job of a schedule's previous tick has not ended (pending, delayed, running).
        `queue`: where it went, its shard on a sharded queue (the shard of its id's hash)."""
        if not isinstance(job_id, str) or not isinstance(queue, str):
            return False
        state = self.redis.hget(self.keys.job(queue, job_id), "state")
        return state in ("pending", "delayed", "running")


def _info(raw: str | None) -> dict[str, Any]:
    """A worker's heartbeat info, or a dispatcher's entry; {} when there is none or it is not a JSON object."""
    try:
        info = codec.loads(raw) if raw else {}
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}
