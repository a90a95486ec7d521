"""Taking jobs without running a worker: a program or shell script claims jobs, does the
work itself, and acks (or fails) them. It heartbeats like a worker, so the dispatcher
requeues what it held if it dies; acks are fenced like a worker's finishes."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from . import codec, scripts
from .app import TaskRunner
from .connection import is_cluster, pop_any
from .holders import held, identity


@dataclass
class Delivery:
    """One claimed job: what a consumer needs to do it and to ack it."""

    id: str
    queue: str
    attempt: str
    task: str
    args: list
    kwargs: dict
    max_duration: float
    timeout_policy: str = "kill"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "queue": self.queue, "attempt": int(self.attempt), "task": self.task,
                "args": self.args, "kwargs": self.kwargs, "max_duration": self.max_duration,
                "timeout_policy": self.timeout_policy}


def claim_args(app: TaskRunner, name: str, host: str, ip: str, slots: list[Any]) -> list[Any]:
    """ARGV of claim.lua for a claimer; `slots`: a (PID, seconds ahead) pair per job wanted."""
    head = codec.dumps({"worker": name, "host": host, "ip": ip}).decode()[:-1]
    return [head, name, host, ip, app.settings.bucket_width, app.settings.max_duration, *slots]


def claim_keys(app: TaskRunner, prefixes: list[str]) -> list[str]:
    """KEYS of the first claim.lua call: every queue, in priority order; on a Redis Cluster,
    whose scripts must touch one slot, the first queue alone (claim_rest() goes on)."""
    return prefixes[:1] if is_cluster(app.redis) else prefixes


def claim_rest(app: TaskRunner, prefixes: list[str], args: list[Any], claimed: list[Any]) -> list[Any]:
    """The claim after the first call's answer `claimed`: on a cluster, the later queues
    one call each, in priority order, while jobs are still wanted (strict priority, as in
    one call); answers as one call over every queue gives them (queue numbers, and the
    seconds ahead of each process's jobs, counting the jobs claimed for it before)."""
    if not is_cluster(app.redis):
        return claimed
    head, pairs = args[:6], args[6:]
    claimed = list(claimed)
    for qi, prefix in enumerate(prefixes[1:], 2):
        n = len(claimed) // 8  # job k went to pair k
        if 2 * n == len(pairs):
            break
        ahead: dict[Any, float] = {}  # pid -> max durations of the jobs claimed for it so far
        for pid, md in zip(pairs[0:2 * n:2], claimed[6::8]):
            ahead[pid] = ahead.get(pid, 0.0) + float(md)
        rest: list[Any] = []
        for pid, base in zip(pairs[2 * n::2], pairs[2 * n + 1::2]):
            rest += [pid, base if base == "" else f"{float(base) + ahead.get(pid, 0.0):.3f}"]
        got = scripts.CLAIM(app.redis, [prefix], head + rest)
        got[0::8] = [qi] * (len(got) // 8)
        claimed += got
    return claimed


class Consumer:
    def __init__(self, app: TaskRunner, queues: list[str], name: str | None = None):
        self.app, self.keys = app, app.keys
        self.queues = [codec.check_name("queue", q) for q in queues]
        self.host = socket.gethostname()
        self.name = codec.check_name("worker", name or f"consumer.{self.host}.{os.getpid()}")

    def heartbeat(self, busy: int = 0) -> None:
        """Say we are alive (call more often than dead_after while holding jobs)."""
        info = {"name": self.name, "host": self.host, "ip": "127.0.0.1", "pid": os.getpid(),
                "queues": self.queues, "concurrency": 1, "busy": busy, "kind": "consumer", **identity()}
        scripts.HEARTBEAT(self.app.redis, [self.keys.g], [self.name, codec.dumps(info),
                                                         int(self.app.settings.dead_after * 3 + 60)])

    def claim(self, count: int = 1, block: float = 0) -> list[Delivery]:
        """Up to `count` jobs, queues in priority order; waits up to `block` seconds in
        Redis (BRPOP on the wake lists) when there is none."""
        self.heartbeat()
        deadline = time.monotonic() + block
        prefixes = [self.keys.q(q) for q in self.queues]
        argv = claim_args(self.app, self.name, self.host, "127.0.0.1", [os.getpid(), ""] * count)
        while True:
            raw = scripts.CLAIM(self.app.redis, claim_keys(self.app, prefixes), argv)
            raw = claim_rest(self.app, prefixes, argv, raw)
            out = []
            for i in range(0, len(raw), 8):
                qi, job_id, attempt, task, args, kwargs, md, policy = raw[i:i + 8]
                try:
                    a, k = codec.loads(args), codec.loads(kwargs)
                except ValueError:
                    a, k = args, kwargs  # the consumer sees the record as it is
                out.append(Delivery(job_id, self.queues[int(qi) - 1], str(attempt), task, a, k, float(md), policy))
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            pop_any(self.app.redis, [p + "wake" for p in prefixes], max(0.01, min(left, 5)))

    def ack(self, deliveries: list[Delivery], results: list[Any] | None = None) -> list[bool]:
        """Mark jobs completed, all in one round trip; says which were really acked (a job
        requeued or killed meanwhile is not: its new owner's record stays)."""
        results = results if results is not None else [None] * len(deliveries)
        return self._finish([(d, ["completed", codec.dumps(r, "result").decode(), "", "", ""])
                             for d, r in zip(deliveries, results)])

    def fail(self, delivery: Delivery, error_type: str, message: str, traceback: str = "",
             retry: bool = True) -> bool:
        """Mark a job failed; retried with backoff while its retries last (unless retry=False)."""
        outcome = ["error" if retry else "failed", error_type, message, traceback, "1"]
        return self._finish([(delivery, outcome)])[0]

    def stopped(self, delivery: Delivery, reason: str) -> bool:
        """Record a job we stopped: `reason` "killed" (a kill request: ends killed) or
        "timeout" (past its max duration: TimeLimitExceeded, retried while retries last),
        as a worker does (docs/PROTOCOL.md, Kill)."""
        if reason == "timeout":
            outcome = ["error", "TimeLimitExceeded", "ran past its max duration; stopped", "", "1"]
        else:
            outcome = ["killed", "", "killed on request", "", ""]
        return self._finish([(delivery, outcome)])[0]

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

    def _finish(self, items: list[tuple[Delivery, list[Any]]]) -> list[bool]:
        by_queue: dict[str, list[Any]] = {}
        order: list[tuple[str, int]] = []
        for d, outcome in items:
            values = by_queue.setdefault(d.queue, [])
            order.append((d.queue, len(values) // 8))
            values += [d.id, d.attempt, outcome[0], "", *outcome[1:]]
        batch = scripts.Batch(self.app.redis)
        s = self.app.settings
        for q, values in by_queue.items():
            batch.call(scripts.FINISH, [self.keys.q(q)], [s.result_ttl, s.retry_backoff_max, *values])
        answers = dict(zip(by_queue, batch.execute()))
        return [answers[q][i] == 1 for q, i in order]

    def close(self) -> None:
        """Leave cleanly: what we still hold goes back to its queue now, next in line (left
        to the dispatcher it would wait for its deadline: a holder that left is not dead),
        then we leave the list of workers."""
        batch = scripts.Batch(self.app.redis)
        for q, job_id, worker, attempt in held(self.app, self.queues):
            if worker == self.name:
                batch.call(scripts.FINISH, [self.keys.q(q)], [self.app.settings.result_ttl, 0, job_id, attempt,
                                                             "requeue", "", "0", "front", f"{self.name} left", ""])
        batch.execute()
        self.app.redis.zrem(self.keys.workers, self.name)
        self.app.redis.delete(self.keys.worker(self.name), self.keys.control(self.name))
