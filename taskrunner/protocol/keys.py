"""Key names. Per-queue keys share the hash tag {queue}, so every script acting on a
queue touches one Redis Cluster slot; global keys share the tag {_} (no queue name can
be "_": names start with a letter or digit). docs/PROTOCOL.md describes each key."""

from __future__ import annotations


class Keys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.g = f"{prefix}:{{_}}:"
        self.queues = self.g + "queues"
        self.workers = self.g + "workers"
        self.workers_dead = self.g + "workers:dead"
        self.schedules = self.g + "schedules"
        self.dispatchers = self.g + "dispatchers"
        self.tasks = self.g + "tasks"

    def q(self, queue: str) -> str:
        """The key prefix of a queue: every key of the queue starts with it."""
        return f"{self.prefix}:{{{queue}}}:"

    def queue_of(self, key: str) -> str:
        """The queue whose key `key` is (the name in its hash tag)."""
        return key[len(self.prefix) + 2:].partition("}")[0]

    def job(self, queue: str, job_id: str) -> str:
        return f"{self.q(queue)}job:{job_id}"

    def worker(self, name: str) -> str:
        return f"{self.g}worker:{name}"

    def control(self, name: str) -> str:
        return f"{self.g}control:{name}"
