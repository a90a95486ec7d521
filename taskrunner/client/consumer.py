"""Taking jobs without running a worker: a program or shell script claims jobs, does the
work itself, and acks (or fails) them. It heartbeats like a worker, so the dispatcher
requeues what it held if it dies; acks are fenced like a worker's finishes."""

from __future__ import annotations

import logging
import os
import socket
import time
from multiprocessing.connection import wait as wait_any
from typing import Any

import redis

from taskrunner.client import steps
from taskrunner.client.app import TaskRunner
from taskrunner.client.steps import REDIS_ERRORS
from taskrunner.protocol import codec, joins, scripts, shards
from taskrunner.protocol.blocking import Blocker, blockers_on, give_back, pop_any, slack
from taskrunner.protocol.claims import Delivery, claim_args, claim_keys, claim_rest
from taskrunner.protocol.connection import is_cluster
from taskrunner.protocol.holders import held, identity
from taskrunner.protocol.outcome import Ended, Outcome, finish_args

log = logging.getLogger("taskrunner.consumer")

#: A wait for a rate limit's token shorter than this is slept, not blocked on in Redis.
_SHORT = 1.0


class Consumer:
    def __init__(self, app: TaskRunner, queues: list[str], name: str | None = None):
        self.app, self.keys = app, app.keys
        self.served = shards.Served([codec.check_name("queue", q) for q in queues])
        self.queues = self.served.physical
        self._counts_at = 0.0  # when the shard counts are due to be read again (monotonic)
        self._wakes: list[Blocker] = []  # our BRPOPs on the wake lists of self.queues
        self.host = socket.gethostname()
        self.name = codec.check_name("worker", name or f"consumer.{self.host}.{os.getpid()}")
        #: (queue, id, attempt) of the deliveries claim() gave and no finish has reported yet.
        self._given: set[tuple[str, str, str]] = set()
        #: A claim call failed: it may have run, its answer lost, so that deliveries held
        #: under our name were never given to us. Alive, we are never found dead: the next
        #: claim hands them back (docs/PROTOCOL.md, Consumers that are not workers, 6).
        self._orphans = False

    def heartbeat(self, busy: int = 0) -> None:
        """Say we are alive (call more often than dead_after while holding jobs)."""
        info = {"name": self.name, "host": self.host, "ip": "127.0.0.1", "pid": os.getpid(),
                "queues": self.queues, "concurrency": 1, "busy": busy, "kind": "consumer", **identity()}
        scripts.HEARTBEAT(self.app.redis, [self.keys.g], [self.name, codec.dumps(info),
                                                         int(self.app.settings.dead_after * 3 + 60)])

    def claim(self, count: int = 1, block: float = 0) -> list[Delivery]:
        """Up to `count` jobs, queues in priority order; waits up to `block` seconds in
        Redis (BRPOP on the wake lists) when there is none. A claim cut short by a backlog of
        expired jobs is followed by the next at once, `block` 0 too (_token())."""
        self.heartbeat()
        if time.monotonic() >= self._counts_at:  # the shard counts, at most once per shards.KEEP seconds
            pipe = self.app.redis.pipeline(transaction=False)
            for q in self.served.queues:
                pipe.hget(self.keys.q(q) + "meta", "shards")
            self.served.update([shards.count(n) for n in pipe.execute()])
            if self.served.physical != self.queues or not self._wakes:
                for b in self._wakes:  # none armed: each claim ends with _settle()
                    b.reset()
                self._wakes = blockers_on(self.app.redis, [self.keys.q(q) + "wake" for q in self.served.physical],
                                          cancellable=is_cluster(self.app.redis))
            self.queues = self.served.physical
            self._counts_at = time.monotonic() + shards.KEEP
        if self._orphans:
            self._hand_back_orphans()
        try:
            out = self._claim(count, block)
        finally:
            self._settle()
        self._given.update((d.queue, d.id, d.attempt) for d in out)
        return out

    def _hand_back_orphans(self) -> None:
        """Finish with outcome `return` (next in line, nothing counted) every delivery the
        holding hashes give our name that claim() never gave: a claim whose answer was lost."""
        back = Outcome.returned(f"{self.name} never got it (a claim's answer was lost)")
        orphans = [(q, Ended(job_id, attempt, back)) for q, job_id, worker, attempt in held(self.app, self.queues)
                   if worker == self.name and (q, job_id, attempt) not in self._given]
        if orphans:
            self._finish(orphans)
        self._orphans = False

    def _claim(self, count: int, block: float) -> list[Delivery]:
        deadline = time.monotonic() + block
        argv = claim_args(self.app, self.name, self.host, "127.0.0.1", [os.getpid(), ""] * count)
        woken = None  # the queue whose wake token woke us: claimed from first
        while True:
            order = self.served.order(woken)
            try:
                raw = scripts.CLAIM(self.app.redis, claim_keys(self.app, [self.keys.q(q) for q in order]), argv)
            except REDIS_ERRORS:
                self._orphans = True
                raise
            out, wait = claim_rest(self.app, order, argv, raw)
            left = deadline - time.monotonic()
            if out:
                return out
            if left <= 0:
                # A claim cut short (it ended its most expired jobs: claim.lua, EXPIRED_MAX)
                # left a wake token for its claimer to claim on: one that may not wait takes
                # it at once, as a BRPOP would. Else `consume` (--timeout 0) said "no job" with
                # live jobs behind a backlog of expired ones. No token: the queues are empty.
                woken = None if wait is not None else self._token()
                if woken is None:
                    return out
                continue
            if wait is not None and wait < _SHORT:  # a rate limit's next token: Redis times a BRPOP out to 0.1 s
                time.sleep(min(wait, left))
            else:
                woken = self._woken(max(0.01, min(left, 5, wait or 5)))

    def _token(self) -> str | None:
        """Take a wake token without waiting, from the first of our queues' wake lists (in
        priority order) that has one: the queue it came on, or None."""
        for q in self.served.physical:
            if self.app.redis.rpop(self.keys.q(q) + "wake") is not None:
                return q
        return None

    def _woken(self, timeout: float) -> str | None:
        """Wait up to `timeout` s for a wake token: the queue it came on, or None. On a cluster
        (one BRPOP per list) the BRPOPs that did not answer stay armed: closing one could lose
        a token on its way. Tokens that come beside the one we take go back (give_back)."""
        for b in self._wakes:
            b.arm(timeout)
        waitables: list[Any] = list(self._wakes)  # each has a fileno(), as wait() needs
        ready: list[Any] = wait_any(waitables, timeout + slack(self._wakes[0].conn.socket_timeout))
        if not ready:
            late = [b for b in self._wakes if b.armed and time.monotonic() > b.due]
            for b in late:
                b.reset()
            if late:
                raise redis.TimeoutError(f"no answer from Redis to a {timeout:g}s BRPOP in time")
            return None
        woken = None
        for b in ready:
            reply = b.read()
            if reply and woken is None:
                woken = self.keys.queue_of(reply[0])
            elif reply:
                give_back(self.app.redis, reply[0])
        return woken

    def _settle(self) -> None:
        """End the BRPOPs still armed when a claim returns, without losing a token one took
        (Blocker.cancel), and give such a token back: no token waits in our socket for our
        next claim while another claimer sleeps."""
        for b in self._wakes:
            if b.armed:
                try:
                    reply = b.cancel()
                except REDIS_ERRORS:
                    continue  # its connection is gone (closed by cancel): so is what it held
                if reply:
                    give_back(self.app.redis, reply[0])

    def ack(self, deliveries: list[Delivery], results: list[Any] | None = None) -> list[bool]:
        """Mark jobs completed, all in one round trip; says which were really acked (a job
        requeued or killed meanwhile is not: its new owner's record stays)."""
        results = results if results is not None else [None] * len(deliveries)
        return self._finish([_ended(d, Outcome.completed(codec.dumps(r, "result").decode()))
                             for d, r in zip(deliveries, results)])

    def fail(self, delivery: Delivery, error_type: str, message: str, traceback: str = "",
             retry: bool = True) -> bool:
        """Mark a job failed; retried with backoff while its retries last (unless retry=False)."""
        outcome = (Outcome.error if retry else Outcome.failed)(error_type, message, traceback)
        return self._finish([_ended(delivery, outcome)])[0]

    def stopped(self, delivery: Delivery, reason: str) -> bool:
        """Record a job we stopped: `reason` "killed" (a kill request: ends killed) or
        "timeout" (past its max duration: TimeLimitExceeded, retried while retries last),
        as a worker does (docs/PROTOCOL.md, Kill)."""
        if reason == "timeout":
            outcome = Outcome.error("TimeLimitExceeded", "ran past its max duration; stopped")
        else:
            outcome = Outcome.killed("killed on request")
        return self._finish([_ended(delivery, outcome)])[0]

    def kill_request(self, delivery: Delivery, timeout: float) -> str | None:
        """Wait up to `timeout` seconds on our control list for a kill of `delivery`: its
        reason ("killed" or "timeout"), or None. Messages about other deliveries (one that
        ended) are dropped."""
        reply = pop_any(self.app.redis, [self.keys.control(self.name)], timeout)
        if reply is None:
            return None
        try:
            msg = codec.loads(reply[1])
            if str(msg["kill"]) != delivery.id or str(msg["attempt"]) != delivery.attempt:
                return None
        except (ValueError, KeyError, TypeError):
            return None
        return "timeout" if msg.get("reason") == "timeout" else "killed"

    def still_ours(self, delivery: Delivery) -> str | None:
        """What a holder reads at each beat (docs/PROTOCOL.md, Heartbeat): "killed" when a
        kill was requested (its control message may have been lost), "gone" when the
        delivery is ours no more (requeued by an operator, or its holder found dead
        meanwhile: another delivery's, or nobody's), None while it runs as ours."""
        p = self.keys.q(delivery.queue)
        pipe = self.app.redis.pipeline(transaction=False)
        pipe.hmget(p + "job:" + delivery.id, "attempts", "kill_requested")
        pipe.hexists(p + "running", delivery.id)
        (attempts, kill), running = pipe.execute()
        if attempts != delivery.attempt or not running:
            return "gone"
        return "killed" if kill else None

    def _finish(self, items: list[tuple[str, Ended]]) -> list[bool]:
        """Report (queue, ended) pairs, one finish.lua call per queue: which were applied."""
        by_queue: dict[str, list[Ended]] = {}
        order: list[tuple[str, int]] = []
        for q, e in items:
            ended = by_queue.setdefault(q, [])
            order.append((q, len(ended)))
            ended.append(e)
        batch = scripts.Batch(self.app.redis)
        for q, ended in by_queue.items():
            batch.call(scripts.FINISH, [self.keys.q(q)], finish_args(self.app.settings, ended, 0))
        answers, entries = {}, []
        for (q, ended), answer in zip(by_queue.items(), batch.execute()):
            answers[q], left = joins.split(answer, len(ended))
            entries += left
        self._given.difference_update((q, e.id, e.attempt) for q, e in items)  # reported: ours no more
        if entries:  # children in other slots of a Redis Cluster: tell them now, else the dispatcher will
            try:
                steps.run(self.app, steps.carry(self.app, entries))
            except (*REDIS_ERRORS, ValueError) as e:
                log.warning("consumer %s: could not tell %d children in other slots that their parents ended (%s); "
                            "the dispatcher will", self.name, len(entries), e)
        return [answers[q][i] == 1 for q, i in order]

    def close(self) -> None:
        """Leave cleanly: what we still hold goes back to its queue now, next in line (left
        to the dispatcher it would wait for its deadline: a holder that left is not dead),
        then we leave the list of workers."""
        self._settle()
        for b in self._wakes:
            b.reset()  # their idle connections
        back = Outcome.requeue(front=True, why=f"{self.name} left")
        mine = [(q, Ended(job_id, attempt, back)) for q, job_id, worker, attempt in held(self.app, self.queues)
                if worker == self.name]
        if mine:
            self._finish(mine)
        self.app.redis.zrem(self.keys.workers, self.name)
        self.app.redis.delete(self.keys.worker(self.name), self.keys.control(self.name))


def _ended(d: Delivery, outcome: Outcome) -> tuple[str, Ended]:
    return d.queue, Ended(d.id, d.attempt, outcome)
