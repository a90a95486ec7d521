"""The worker: one main process that claims jobs from Redis and runs each in one of N
long-lived child processes.

The main process never runs a job, so its heartbeats go on whatever a job does. It
waits on everything at once with one select: the children's pipes and exit sentinels,
the connection its syncs with Redis (finish, claim: one round trip) and its heartbeats are
in flight on (a slow Redis holds up no child's answer, no time limit, no kill), and
connections each with a BRPOP outstanding: its control list (kill requests) and, when a
child is idle and the queues were found empty, the queues' wake lists (one BRPOP on all;
on a Redis Cluster one per queue, as one command's keys must share a slot); and, once a
connection broke, a PING on a socket of its own, answered before any is opened again
(redis-py's handshake waits for its answers). No threads (the worker forks replacement
children) and no polling.

Its parts: the crew (crew.py: the children, what is sent to them and comes back, stopping
jobs), the outbox (outbox.py: what to tell Redis), the policy (policy.py: how many to
claim, when to sync, how long to wait). The worker itself holds the loop, the syncs with
Redis, signals and heartbeats."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil
import redis

from taskrunner.client import declarations, steps
from taskrunner.client.app import TaskRunner
from taskrunner.errors import NameInUse
from taskrunner.logs import Run, job_fields
from taskrunner.protocol import codec, scripts, shards
from taskrunner.protocol.blocking import Blocker, blockers_on, give_back_in
from taskrunner.protocol.claims import Delivery, claim_args, claim_keys, claim_rest
from taskrunner.protocol.connection import is_cluster, server_time
from taskrunner.protocol.holders import identity, lose_held
from taskrunner.protocol.links import Channel, ClusterChannel, Probe
from taskrunner.protocol.outages import Outage
from taskrunner.worker import policy
from taskrunner.worker.children import Child, wait_ready
from taskrunner.worker.crew import Crew
from taskrunner.worker.outbox import Load, Outbox

log = logging.getLogger("taskrunner.worker")
# Any Redis failure (down, OOM, READONLY after a failover, BUSY; a cluster with no node
# reachable, or a slot no node serves) means: back off, retry. Retrying is safe: finishes
# are idempotent and a claim without an answer is reconciled.
_REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


@dataclass
class Flight:
    """A batch sent to Redis whose answers have not come yet. A sync: what it reports (its
    load from the outbox), and what it claims for. A heartbeat (`beat`: the deliveries it
    asks Redis about, with their children). Chores (neither: declarations, a new shard's
    queue): only their errors count."""

    batch: scripts.Batch
    load: Load = field(default_factory=Load)
    slots: list[tuple[Child, float]] = field(default_factory=list)
    claim: list[Any] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # the physical queues claimed from, in the claim's order
    gifts: list[str] = field(default_factory=list)  # the wake lists it gives a token back to (Worker._give_back)
    beat: list[tuple[Child, Delivery]] | None = None
    sync: bool = True


def local_ip(client: redis.Redis | redis.cluster.RedisCluster) -> str:
    """The address this host uses to reach Redis (what others would see); through
    Sentinel, the current primary's; in a cluster, a node's."""
    try:
        if isinstance(client, redis.cluster.RedisCluster):
            node = client.get_default_node()
            host, port = node.host, node.port
        elif isinstance(client.connection_pool, redis.sentinel.SentinelConnectionPool):
            host, port = client.connection_pool.get_master_address()
        else:
            kwargs = client.connection_pool.connection_kwargs
            host, port = kwargs.get("host"), kwargs.get("port", 6379)
        if not host:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except (OSError, redis.ConnectionError):
        return "127.0.0.1"


class Worker:
    def __init__(self, app: TaskRunner, queues: list[str], concurrency: int = 2, name: str | None = None,
                 prefetch: int | None = None, max_jobs_per_child: int | None = None,
                 max_memory_per_child: float | None = None, threads: int = 1, async_slots: int = 100):
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.app, self.s, self.keys = app, app.settings, app.keys
        # The queues served, each as its shards' physical queues (a queue not sharded: itself),
        # whose counts are read when we start and at each heartbeat.
        self.served = shards.Served([codec.check_name("queue", q) for q in queues])
        self.woken: str | None = None  # the queue whose wake token woke us: claimed from first
        self.concurrency = concurrency
        self.prefetch = max(1, prefetch if prefetch is not None else self.s.prefetch)
        self.max_jobs_per_child, self.max_memory_per_child = max_jobs_per_child, max_memory_per_child
        if threads < 1 or async_slots < 0:
            raise ValueError("threads must be >= 1 and async_slots >= 0")
        # Coroutine slots only for an app with async def tasks: otherwise children stay classic.
        self.threads = threads
        self.async_slots = async_slots if any(inspect.iscoroutinefunction(t.fn) for t in app.tasks.values()) else 0
        # Classic children: each runs its jobs one at a time, in claim order. Its heartbeat says
        # so, and then a dead process's jobs behind its first in line do not count as lost.
        self.serial = threads == 1 and self.async_slots == 0
        self.host = socket.gethostname()
        self.name = codec.check_name("worker", name or f"{self.host}.{os.getpid()}")
        self.redis = app.redis
        self.ip = local_ip(self.redis)
        self.outbox = Outbox(app)  # what we have to tell Redis
        self.crew = Crew(app, self.outbox, self.name, self.host, concurrency, threads, self.async_slots,
                         max_jobs_per_child, max_memory_per_child)
        self.may_claim = True
        self.probing = False  # the last claim found the queues empty: the next asks one job per child
        self.passed = 0  # shards a busy worker's claims found short in a row, each followed by the next (_next_shard)
        # A rate limit held a job back (flow control): claim again at this time (monotonic)
        # at the latest, as if woken; None: only when woken.
        self.claim_at: float | None = None
        self.stopping = False
        self.stop_at = 0.0
        self.reconcile = True  # release what Redis says we hold but we do not run
        self.next_beat = 0.0
        self.stepped_at = time.monotonic()  # the loop's last round, for --health-port's liveness
        self.next_declare = 0.0  # when to put back declarations that went missing
        self.redis_ok_at = 0.0  # after a Redis error, talk to it again from this time
        self.backoff = 0.0
        self.outage = Outage(f"worker {self.name}", log)
        self.wakes: list[Blocker] = []
        self.gifts: list[str] = []  # wake lists owed a token back, by the next sync (_give_back)
        self._served(self.served.counts)
        self.ctl = Blocker(self.redis, [self.keys.control(self.name)])
        # Syncs and heartbeats go on a connection of our own (on a cluster, one per primary),
        # answered while we read our children, over TLS and through Sentinel too (else, as
        # with TLS through Sentinel, through redis-py, one at a time, waiting for each).
        self.channel: Channel | ClusterChannel | None = Channel.of(self.redis) or ClusterChannel.of(self.redis)
        self.flights: deque[Flight] = deque()  # oldest first
        # A connection of ours broke since Redis last answered: none is opened again before a
        # probe's PING is answered (_reachable). On one server only (a Channel, not a cluster's).
        self.unsure = False
        self.probe: Probe | None = None
        self.proc = psutil.Process()
        self.started_at = time.time()
        self.born = float("inf")  # the server's time as it starts (_check_name_free): what it claimed is after it

    def _served(self, counts: list[int]) -> None:
        """Serve the queues' shards as `counts` says: the physical queues and their wake lists."""
        self.served.update(counts)
        for b in self.wakes:
            b.reset()
        self.queues = self.served.physical
        self.prefixes = [self.keys.q(q) for q in self.queues]
        self.wakes = blockers_on(self.redis, [p + "wake" for p in self.prefixes])

    def _shard_counts(self, pipe: Any) -> None:
        """Ask, in `pipe`, for the shard count of each queue served (shards.count reads the answers)."""
        for q in self.served.queues:
            pipe.hget(self.keys.q(q) + "meta", "shards")

    # -- lifecycle ---------------------------------------------------------------------

    def run(self) -> int:
        backoff = 0.0
        while True:  # Redis may be down or still loading its AOF: wait for it, as later on
            try:
                self._check_name_free()
                break
            except _REDIS_ERRORS as e:
                backoff = min(max(backoff * 2, 0.2), 5.0)
                self.outage.failed(e, backoff)
                time.sleep(backoff)
        self.outage.ok()
        # Signals interrupt our select through this socket (select itself is restarted).
        self._wakeup, wakeup_w = socket.socketpair()
        for s in (self._wakeup, wakeup_w):
            s.setblocking(False)
        self._wakeup_w = wakeup_w  # kept open for the process's life
        signal.set_wakeup_fd(wakeup_w.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGQUIT, self._on_signal)
        self.crew.start()
        log.info("worker %s: queues %s, %d children (%d threads, %d async slots each), prefetch %d, pid %d",
                 self.name, ",".join(self.queues), self.concurrency, self.threads, self.async_slots, self.prefetch,
                 os.getpid())
        try:
            while not (self.stopping and self._drained()):
                if self.stopping and time.monotonic() >= self._give_up_at():
                    log.error("worker %s: could not report every job before exiting; the dispatcher "
                              "will requeue what is left", self.name)
                    break
                self._step()
        finally:
            self._shutdown()
        return 0

    def _give_up_at(self) -> float:
        """When a stopping worker exits even with jobs unreported (Redis unreachable): the
        dispatcher requeues them."""
        return self.stop_at + self.s.kill_grace + 10

    def _check_name_free(self) -> None:
        last = self.redis.zscore(self.keys.workers, self.name)
        now = server_time(self.app.redis)
        if last is not None and now - last < self.s.dead_after:
            raise NameInUse(f"worker name {self.name!r} is in use by a live worker (heartbeat "
                            f"{now - last:.1f}s ago); pick another with -n")
        self.born = now
        pipe = self.redis.pipeline(transaction=False)
        self._shard_counts(pipe)
        self._served([shards.count(n) for n in pipe.execute()])
        self.redis.sadd(self.keys.queues, *self.queues)
        declarations.publish(self.app, self.queues, self.name, now)
        self.next_declare = time.monotonic() + declarations.REFRESH

    def _on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM or SIGINT: stop claiming and let running jobs finish for shutdown_grace.
        Stop now (requeue them at once) on SIGINT while stopping (Ctrl-C twice) or SIGQUIT.
        A repeated SIGTERM changes nothing: platforms signal every process and supervisors
        (honcho, `timeout`, `taskrunner up`) pass it on as well, so one stop arrives several
        times, and cutting the grace short would rerun jobs that were about to finish."""
        now = time.monotonic()
        if not self.stopping:
            log.info("worker %s: stopping; running jobs have %.0fs to finish (SIGQUIT or Ctrl-C again: "
                     "requeue them now)", self.name, self.s.shutdown_grace)
            self.stopping = True
            self.stop_at = now + self.s.shutdown_grace
        elif signum in (signal.SIGQUIT, signal.SIGINT):
            log.warning("worker %s: stop now: requeueing running jobs", self.name)
            self.stop_at = min(self.stop_at, now)
        else:
            log.info("worker %s: SIGTERM again: already stopping, running jobs keep their grace", self.name)

    def _give_back_wake(self) -> None:
        """We may have taken a wake token we will not use: leave one for others, with the
        next sync (due at once, in flight; the goodbye's at the latest). A round trip of
        redis-py's here held the loop for socket_timeout at each try while Redis answered
        nothing, stopping no job at its max duration."""
        self.gifts += [p + "wake" for p in self.prefixes if p + "wake" not in self.gifts]

    def _drained(self) -> bool:
        """Nothing left to run or report, and no claim in flight: one sent just before the
        stop must land while the children still run (it would land after they were closed,
        the jobs left claimed by a worker that said goodbye)."""
        return not self.crew.busy() and self.outbox.empty() and not any(f.claim for f in self.flights)

    def _shutdown(self) -> None:
        signal.set_wakeup_fd(-1)
        for b in (self.ctl, *self.wakes):
            b.reset()
        self.crew.close()
        if self.backoff and self.stopping and time.monotonic() >= self._give_up_at():
            # Redis has been unreachable all along: trying again could hang for the client's
            # timeouts and retries. Our entry lapses after dead_after, and the dispatcher
            # requeues what we held.
            log.info("worker %s: stopped after %d jobs, without saying goodbye to Redis", self.name,
                     self.crew.processed)
            return
        try:
            self._sync(wait=True)
            # One call a line, one key a delete: a ClusterPipeline's delete() returns None (not
            # the pipeline) and refuses several keys.
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(self.keys.workers, self.name)
            pipe.delete(self.keys.worker(self.name))
            pipe.delete(self.keys.control(self.name))
            pipe.execute()
        except _REDIS_ERRORS as e:
            log.error("worker %s: could not say goodbye to Redis (%s); the dispatcher will requeue "
                      "anything left", self.name, e)
        log.info("worker %s: stopped after %d jobs", self.name, self.crew.processed)

    # -- the loop ----------------------------------------------------------------------

    def _step(self) -> None:
        self.stepped_at = time.monotonic()
        quiet = self._quiet()
        for c in quiet:
            self.crew.read(c)
        now = time.monotonic()
        if self.claim_at is not None and now >= self.claim_at:  # a rate limit's token is due
            self.may_claim, self.claim_at = True, None
        if self.stopping and any(b.armed for b in self.wakes):
            for b in self.wakes:
                b.reset()
            self._give_back_wake()
        self.crew.enforce(now, self.stopping, self.stop_at)
        for c in self.crew.children:
            if c.outgoing:
                c.flush()
        if now >= self.redis_ok_at:
            try:
                if self.flights and self.channel is not None and now >= self.channel.deadline():
                    raise redis.TimeoutError("no answer from Redis within socket_timeout")
                if self._reachable(now):
                    if now >= self._beat_due():
                        self._heartbeat()
                    if now >= self._sync_due(now):
                        self._sync()
                    self._arm()
                    if not self.flights:  # else Redis is fine once they are answered (_landed)
                        self._redis_answered()
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
        quiet = self._quiet()  # as things stand now
        waitables: list[Any] = [self._wakeup]
        if self.flights:
            waitables.append(self.channel)
        if self.probe is not None:
            waitables.append(self.probe)
        for c in self.crew.children:
            waitables += [c.proc.sentinel] if c in quiet or c.conn.closed else [c.conn, c.proc.sentinel]
        for b in (self.ctl, *self.wakes):
            if b.armed:
                waitables.append(b)
        timeout = self._timeout()
        writers: list[Any] = [c.conn for c in self.crew.children if c.outgoing]  # flushed by the next step
        if self.probe is not None and self.probe.connecting:
            writers.append(self.probe)
        for ready in wait_ready(waitables, min(timeout, policy.GLANCE) if quiet else timeout, writers):
            self._on_ready(ready)

    def _redis_failed(self, e: Exception) -> None:
        """Back off. What the syncs in flight reported goes again (finishes are idempotent)
        and what they claimed is reconciled, as any claim may have gone through unanswered."""
        # At most a heartbeat apart: once Redis is back, our heartbeat must land well within
        # the dead_after the dispatcher gives us after an outage.
        self.backoff = min(max(self.backoff * 2, 0.1), 5.0, self.s.heartbeat)
        self.redis_ok_at = time.monotonic() + self.backoff
        self.reconcile = True
        # The first thing to go once we try again (after a probe's answer): its answer says Redis is back.
        self.next_beat = 0.0
        if self.channel is not None:  # idle or not: a connection from before an outage fails at its next use
            self.channel.close()
        self._lost_touch()
        if self.flights:
            for f in self.flights:  # given back or not: again (a list holds one token at most)
                self.gifts += [w for w in f.gifts if w not in self.gifts]
            self.flights.clear()
            self.outbox.failed()
        for b in (self.ctl, *self.wakes):
            b.reset()
        self.outage.failed(e, self.backoff)

    def _lost_touch(self) -> None:
        """A connection of ours broke: open none again before a probe is answered (_reachable)."""
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        self.unsure = isinstance(self.channel, Channel)

    def _reachable(self, now: float) -> bool:
        """May the loop talk to Redis (send, arm its blocks)? Not while unsure: a connection
        broke since Redis last answered (an error, one of our blocks closed), and opening
        one again waits for redis-py's handshake (Probe), which held the loop for
        socket_timeout at each of redis-py's tries while Redis took connections and answered
        nothing (SIGSTOPped, a hung host), stopping no job at its max duration. A PING on a
        socket of its own goes first, its answer read in the loop's select (_on_ready); one
        unanswered within socket_timeout fails as a sync does."""
        if not self.unsure:
            return True
        if self.probe is None:
            self.probe = self.channel.probe()  # type: ignore[union-attr]  # unsure: a Channel
        elif now >= self.probe.deadline:
            raise redis.TimeoutError("no answer from Redis to a PING within socket_timeout")
        return False

    def _quiet(self) -> list[Child]:
        return policy.quiet(self.crew.children, self.crew.runtime, self._depth(), self.stopping)

    def _timeout(self) -> float:
        now = time.monotonic()
        answer_by = self.channel.deadline() if self.flights and self.channel else None
        if self.probe is not None:  # nothing else talks to Redis before its answer (_reachable)
            answer_by = min(answer_by or policy.INF, self.probe.deadline)
        return policy.wait_timeout(now, self.crew.children, redis_ok_at=self.redis_ok_at,
                                   next_beat=policy.INF if self.unsure else self._beat_due(),
                                   sync_at=policy.INF if self.unsure else min(self._sync_due(now),
                                                                              self.claim_at or policy.INF),
                                   answer_by=answer_by,
                                   stopping=self.stopping, stop_at=self.stop_at, give_up_at=self._give_up_at())

    def _sync_due(self, now: float) -> float:
        """When to sync (policy.sync_due). After a Redis failure, not before Redis has
        answered again (our heartbeat, sent first, lands: backoff is 0 again): the sync
        that reconciles waits for its answers and for lose_held's round trips, which, sent
        to a Redis that still takes no writes (a CLIENT PAUSE, a stalled primary), held the
        loop for socket_timeout at each try."""
        if self.reconcile and self.backoff:
            return policy.INF
        return policy.sync_due(now, self.crew.children, self._depth(), flights=sum(f.sync for f in self.flights),
                               urgent=bool(self.outbox.load.marks or self.gifts) or self.reconcile,
                               outbox_since=self.outbox.outcomes_since, notes_due=self.outbox.notes.due(),
                               can_claim=self._can_claim(),
                               stopping=self.stopping, spare=self._spare())

    def _can_claim(self) -> bool:
        """May a sync claim now? Not while stopping, nor after the queues were found empty
        (until a wake token comes), nor while a claim is in flight: jobs it brings go to
        children before the next claim counts their room and the work queued ahead."""
        return self.may_claim and not self.stopping and not any(f.slots for f in self.flights)

    def _on_ready(self, ready: Any) -> None:
        if ready is self._wakeup:
            try:
                self._wakeup.recv(512)
            except BlockingIOError:
                pass
            return
        if ready is self.channel:
            try:
                self._land()
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
            return
        if ready is self.probe:
            try:
                if self.probe.step():
                    self.probe, self.unsure = None, False
            except _REDIS_ERRORS as e:
                self._redis_failed(e)
            return
        if isinstance(ready, Blocker):
            if not ready.armed:
                return
            try:
                reply = ready.read()
            except _REDIS_ERRORS:
                self._lost_touch()  # re-armed by a later step, once Redis answers
                return
            if ready is not self.ctl:  # a wake list
                if reply and (self.may_claim or not policy.listening(self.crew.children)):
                    self._give_back(reply[0])  # woken already (a cluster's other list), or no room: another's
                else:
                    self.may_claim, self.claim_at = True, None
                    if reply:
                        self.woken = self.keys.queue_of(reply[0])
            elif reply:
                self._on_control(reply[1])
            return
        for c in self.crew.children:
            if ready is c.conn:
                self.crew.read(c)
                return
            if ready == c.proc.sentinel:
                self.crew.exited(c, replace=not self.stopping)
                return

    def _give_back(self, wake: str) -> None:
        """A token that came on one of a cluster's wake lists (one BRPOP each) once another
        had woken us, or once our children had no room left: put it back for another idle
        worker, as one BRPOP on every list would have left it. The BRPOPs still out are left
        to answer, not cancelled: closing one whose token was on its way lost the token, and
        idle workers slept while that shard had jobs (a sharded queue drained at 62 jobs/s
        against 3,800 unsharded). It goes back with the next sync, due at once (a round trip
        of its own each, through redis-py's cluster pipeline, cost ~10% of a busy worker's
        CPU on 12 shards); a sync that fails gives it back again (_redis_failed())."""
        if wake not in self.gifts:
            self.gifts.append(wake)

    def _arm(self) -> None:
        self.ctl.arm(self.s.idle_block)
        if not self.stopping and not self.may_claim and policy.listening(self.crew.children):
            for b in self.wakes:
                b.arm(self.s.idle_block)

    # -- children ----------------------------------------------------------------------

    def _depth(self) -> int:
        return policy.depth(self.crew.runtime, self.prefetch)

    def _spare(self) -> int:
        return policy.spare(self.crew.runtime, max((c.capacity for c in self.crew.children), default=1),
                            self.prefetch)

    def _stop(self, at_once: bool, why: str) -> None:
        """Stop as SIGTERM does (running jobs have shutdown_grace to finish), or at once
        (requeue them now, as a second SIGINT or SIGQUIT while stopping)."""
        now = time.monotonic()
        log.warning("worker %s: %s: %s", self.name, why, "stop now: requeueing running jobs" if at_once else
                    f"stopping; running jobs have {self.s.shutdown_grace:.0f}s to finish")
        if not self.stopping:
            self.stopping = True
            self.stop_at = now + self.s.shutdown_grace
        if at_once:
            self.stop_at = min(self.stop_at, now)

    def _on_control(self, raw: str) -> None:
        """A kill request for a job ({"kill", "attempt", "reason"}), or an operator's stop
        ({"stop": "graceful" | "now", "who"}, the dashboard's worker page)."""
        try:
            msg = codec.loads(raw)
            if isinstance(msg, dict) and msg.get("stop") in ("graceful", "now"):
                self._stop(msg["stop"] == "now", f"stop requested by {str(msg.get('who'))[:200]}")
                return
            job_id, attempt = str(msg["kill"]), str(msg["attempt"])
            reason = "timeout" if msg.get("reason") == "timeout" else "killed"
        except (ValueError, KeyError, TypeError):
            log.warning("worker %s: ignoring malformed control message %r", self.name, raw[:200])
            return
        if self.crew.kill_request(job_id, attempt, reason) or self.outbox.holds(job_id):
            return  # it just ended; its result is on its way
        # Not ours to run, yet Redis may say we hold it (a claim whose answer was lost):
        # release it, fenced by our name and its delivery.
        self.reconcile = True

    # -- Redis -------------------------------------------------------------------------

    def _sync(self, wait: bool = False) -> None:
        """Report finished jobs, mark stuck ones and, once a child is hungry, claim for every
        child with room (policy.claim_slots): one round trip, whose answers _land() takes
        when they come. We wait for them when the channel cannot keep it in flight, to
        reconcile (what we hold must be known) and with `wait`: for every flight, a
        heartbeat's too (a goodbye must come after our last heartbeat, or that one would
        put us back among the live workers)."""
        if self.reconcile:
            self._land(block=True)
        batch = scripts.Batch(self.redis)
        now = time.monotonic()
        load = self.outbox.put_into(batch, now)
        slots = policy.claim_slots(self.crew.children, self._depth(), now, self._spare(),
                                   self.probing) if self._can_claim() else []
        claim: list[Any] = []
        order: list[str] = []
        gifts, self.gifts = self.gifts, []
        for wake in gifts:
            give_back_in(batch.pipe, wake)
        if slots:
            pairs = [v for c, ahead in slots for v in (c.pid, f"{ahead:.3f}")]
            claim = claim_args(self.app, self.name, self.host, self.ip, pairs)
            order, self.woken = self.served.order(self.woken), None
            batch.call(scripts.CLAIM, claim_keys(self.app, [self.keys.q(q) for q in order]), claim)
        if len(batch):
            self._send(Flight(batch, load, slots, claim, order, gifts))
        if wait or self.reconcile:
            self._land(block=True)
        if self.reconcile:
            self._release_orphans()

    def _send(self, f: Flight) -> None:
        """Send a flight's batch on the channel: its answers are acted on once they come
        (_land). Without a channel (TLS through Sentinel), it runs now, the usual way, waiting."""
        self.flights.append(f)
        if self.channel is None:
            self._land(block=True)
        else:
            self.channel.send(f.batch.commands())

    def _land(self, block: bool = False) -> None:
        """Act on the answers to the flights that have come (block: wait for all). A flight
        leaves self.flights only once its answers are taken: one that fails is among those
        _redis_failed() gives up."""
        if self.channel is None:  # each runs now, the usual way
            while self.flights:
                results = self.flights[0].batch.execute()
                self._landed(self.flights.popleft(), results)
            return
        for answers in self.channel.take(block):
            results = self.flights[0].batch.settle(answers)
            self._landed(self.flights.popleft(), results)

    def _redis_answered(self) -> None:
        self.backoff = 0.0
        self.outage.ok()

    def _landed(self, f: Flight, results: list[Any]) -> None:
        self._redis_answered()
        if f.beat is not None:
            self._beaten(f.beat, results)
        if not f.sync:
            return
        for q, e, ack in self.outbox.answered(f.load, results):
            if ack == 0:
                log.warning("worker %s: job %s was requeued and taken by another worker while it ran "
                            "here; this result was discarded", self.name, e.id,
                            extra=job_fields(Run(e.id, e.task, q, e.attempt), self.name))
        if self.outbox.to_carry:
            self._carry()
        if f.slots:
            claimed, wait = claim_rest(self.app, f.order, f.claim, results[-1])
            self.crew.deliver(f.slots, claimed)
            short = len(claimed) < len(f.slots)
            after = self._next_shard(f) if short and wait is None else None
            self.passed = self.passed + 1 if after else 0
            self.woken = after or self.woken
            self.probing = short and not after
            if self.probing:
                # Found nothing more: wait for a wake token, or for the token of a rate limit
                # that held a job back (a timer of our own: Redis times a BRPOP out to 0.1 s).
                self.may_claim = False
                self.claim_at = None if wait is None else time.monotonic() + wait

    def _next_shard(self, f: Flight) -> str | None:
        """The shard a busy worker claims from next, at once, when its claim found the shard
        it asked short (on a cluster a claim asks one shard of a sharded queue: claim_rest()),
        rather than waiting on every shard's wake list as an idle worker does: with shards
        drained unevenly, every other claim went to an empty shard, and each cost an idle round
        (a BRPOP per shard, their tokens given back, a claim; 12 shards: 0.1 Redis reads per
        job). At most each other shard once in a row; a probe (the queues were found empty
        before: a lone job's claim; `probing` is still what the claim was sent with, one claim
        being in flight at a time) or a rate limit's wait goes idle as before."""
        if self.probing or not is_cluster(self.redis) or self.passed + 1 >= self.served.shards_of(f.order[0]):
            return None
        return self.served.after(f.order[0])

    def _carry(self) -> None:
        """Carry the outbox entries our finishes left (jobs with children in other slots of a
        Redis Cluster) to join.lua now: two round trips, only for such jobs. One we could not
        carry stays in its outbox, and the dispatcher's next pass carries it."""
        entries, self.outbox.to_carry = self.outbox.to_carry, []
        try:
            steps.run(self.app, steps.carry(self.app, entries))
        except (*_REDIS_ERRORS, ValueError) as e:
            log.warning("worker %s: could not tell %d children in other slots that their parents ended (%s); the "
                        "dispatcher will", self.name, len(entries), e)

    def _release_orphans(self) -> None:
        """Deliveries the holding lists give to us that no child of ours has (a claim whose
        answer never came, or a previous life under the same name): requeue them."""
        mine = self.crew.deliveries() | self.outbox.waiting()
        # What our children hold is known to be in line; a previous life's processes are not,
        # though their PIDs may be our children's again (a container's): claimed before we began.
        children = {c.pid for c in self.crew.children} if self.serial else set()
        acted = lose_held(self.app, self.queues,
                          lambda e: e.holding.worker == self.name and (e.id, str(e.holding.attempt)) not in mine,
                          "worker {} no longer ran it",
                          lambda h: h.worker == self.name and h.pid in children and h.started_at >= self.born)
        if acted:
            log.warning("worker %s: released %d orphaned deliveries: %s", self.name, len(acted),
                        ", ".join(f"{x.id} in {x.queue} -> {x.state}" for x in acted))
        self.reconcile = False

    def _beat_due(self) -> float:
        """When to send the next heartbeat: one at a time (not while one is in flight)."""
        return policy.INF if any(f.beat is not None for f in self.flights) else self.next_beat

    def _heartbeat(self) -> None:
        """Say we are alive, with what we run (info()), and ask Redis about the deliveries
        we hold (still ours? a kill requested?) and the queues' shard counts. It goes in
        flight as a sync does, its answers acted on when they come (_beaten()), not waited
        for: while Redis is slow (a CLIENT PAUSE, a stalled primary) the loop still reads
        what children answer and stops jobs at their max duration or on a kill (a blocking
        round trip sat out socket_timeout). A Redis that does not answer it within
        socket_timeout fails it as it fails a sync (the channel's deadline()). The next is
        due a heartbeat interval after this one goes (and after its answer has come), not
        held back behind syncs (FLIGHTS counts syncs only)."""
        if self.flights:
            # Answers come already count, should this send find the connection closed (a
            # CLIENT KILL, a restart: it closes the channel, and what came with it); and
            # what a claim brought is among the deliveries asked about.
            self._land()
        held = self.crew.held()
        batch = scripts.Batch(self.redis)
        batch.call(scripts.HEARTBEAT, [self.keys.g], [self.name, codec.dumps(self.info()),
                                                      int(self.s.dead_after * 3 + 60)])
        for _, d in held:
            batch.pipe.hmget(self.keys.job(d.queue, d.id), "attempts", "kill_requested", f"end:{d.attempt}")
            batch.pipe.hexists(self.keys.q(d.queue) + "running", d.id)
        self._shard_counts(batch.pipe)
        self._send(Flight(batch, beat=held, sync=False))
        self.next_beat = time.monotonic() + self.s.heartbeat

    def _beaten(self, held: list[tuple[Child, Delivery]], results: list[Any]) -> None:
        """Act on a heartbeat's answers: new shard counts; deliveries no longer ours, or
        with a kill requested (each still running here: the answers may come late). What
        it writes then (a new shard's queue, declarations that went missing) goes as chores
        in flight too."""
        chores = scripts.Batch(self.redis)
        counts = [shards.count(n) for n in results[len(results) - len(self.served.queues):]]
        refresh = time.monotonic() + self.s.heartbeat >= self.next_declare
        if counts != self.served.counts:
            log.info("worker %s: shards now %s", self.name, ", ".join(
                f"{q}: {n}" for q, n in zip(self.served.queues, counts)))
            self._served(counts)
            self.may_claim = True
            chores.pipe.sadd(self.keys.queues, *self.queues)
        if refresh or len(chores):  # new shards need the declarations enqueue.lua reads in their slots
            declarations.publish_in(chores.pipe, self.app, self.queues, self.name, float(results[0]),
                                    overwrite=False)
        if refresh:
            self.next_declare = time.monotonic() + self.s.heartbeat + declarations.REFRESH
        if len(chores):
            self._send(Flight(chores, sync=False))
        for i, (c, d) in enumerate(held):
            (attempts, kill_requested, ended), mine = results[1 + 2 * i], results[2 + 2 * i]
            lost = attempts != d.attempt or not mine
            if d not in c.jobs or c.kill_reason or d.stop_reason or not (lost or kill_requested):
                continue
            stopped = self.crew.stop(c, d, "lost" if lost else "killed")
            if lost:  # how the record says the delivery ended ("<time> requeued by ops@host"), if it does
                why = ended.partition(" ")[2] if ended else "its record is gone" if attempts is None else "requeued"
                log.warning("worker %s: job %s is no longer ours (%s); %s", self.name, d.id, why,
                            "stopping it" if stopped else f"its thread, which cannot be stopped, runs on in child "
                            f"{c.pid} beside the others, its outcome not reported", extra=job_fields(d, self.name))

    def info(self) -> dict[str, Any]:
        rss, cpu, child_rss = self.crew.usage()
        try:
            rss += self.proc.memory_info().rss
            cpu += self.proc.cpu_percent(None)
        except psutil.Error:
            pass
        return {"name": self.name, "host": self.host, "ip": self.ip, "pid": os.getpid(),
                "create_time": self.proc.create_time(), **identity(),
                "children": [c.pid for c in self.crew.children],
                "children_rss": {str(pid): n for pid, n in child_rss.items()},
                "queues": self.queues, "concurrency": self.concurrency, "prefetch": self.prefetch,
                "threads": self.threads, "async_slots": self.async_slots, "serial": self.serial,
                "busy": self.crew.busy(),
                "processed": self.crew.processed, "rss": rss, "cpu": round(cpu, 1), "started_at": self.started_at,
                # the deliveries it holds: its dashboard page reads these jobs, not every running one
                # (nor one that runs on here no longer ours: Crew.stop)
                "running": [[d.queue, d.id] for _, d in self.crew.held() if d.stop_reason != "lost"]}
