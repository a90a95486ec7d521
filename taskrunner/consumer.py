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

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "queue": self.queue, "attempt": int(self.attempt), "task": self.task,
                "args": self.args, "kwargs": self.kwargs, "max_duration": self.max_duration}


def claim_args(app: TaskRunner, name: str, host: str, ip: str, slots: list[Any]) -> list[Any]:
    """ARGV of claim.lua for a claimer; `slots`: a (PID, seconds ahead) pair per job wanted."""
    head = codec.dumps({"worker": name, "host": host, "ip": ip}).decode()[:-1]
    return [head, name, host, ip, app.settings.bucket_width, app.settings.max_duration, *slots]


class Consumer:
    def __init__(self, app: TaskRunner, queues: list[str], name: str | None = None):
        self.app, self.keys = app, app.keys
        self.queues = [codec.check_name("queue", q) for q in queues]
        self.host = socket.gethostname()
        self.name = codec.check_name("worker", name or f"consumer.{self.host}.{os.getpid()}")

    def heartbeat(self, busy: int = 0) -> None:
        """Say we are alive (call more often than dead_after while holding jobs)."""
        info = {"name": self.name, "host": self.host, "ip": "127.0.0.1", "pid": os.getpid(),
                "queues": self.queues, "concurrency": 1, "busy": busy, "kind": "consumer"}
        scripts.HEARTBEAT(self.app.redis, [self.keys.g], [self.name, codec.dumps(info),
                                                         int(self.app.settings.dead_after * 3 + 60)])

    def claim(self, count: int = 1, block: float = 0) -> list[Delivery]:
        """Up to `count` jobs, queues in priority order; waits up to `block` seconds in
        Redis (BRPOP on the wake lists) when there is none."""
        self.heartbeat()
        deadline = time.monotonic() + block
        while True:
            raw = scripts.CLAIM(self.app.redis, [self.keys.q(q) for q in self.queues],
                                claim_args(self.app, self.name, self.host, "127.0.0.1", [os.getpid(), ""] * count))
            out = []
            for i in range(0, len(raw), 8):
                qi, job_id, attempt, task, args, kwargs, md, _ = raw[i:i + 8]
                try:
                    a, k = codec.loads(args), codec.loads(kwargs)
                except ValueError:
                    a, k = args, kwargs  # the consumer sees the record as it is
                out.append(Delivery(job_id, self.queues[int(qi) - 1], str(attempt), task, a, k, float(md)))
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            self.app.redis.brpop([self.keys.q(q) + "wake" for q in self.queues], timeout=max(0.01, min(left, 5)))

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
        """Leave cleanly (what we still hold is requeued by the dispatcher)."""
        self.app.redis.zrem(self.keys.workers, self.name)
