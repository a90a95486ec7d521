"""What a worker has to tell Redis about the deliveries it holds: how they ended
(finish.lua), which ran past their max duration (stuck.lua), and what the running ones
reported (progress.lua). Kept here until a sync loads it into a batch; the load travels
with that sync until Redis answers, and comes back here if the sync failed: every call is
idempotent (fenced by delivery), so sending it again is safe."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from taskrunner.protocol import joins, scripts
from taskrunner.protocol.claims import Delivery
from taskrunner.protocol.outcome import Ended, Outcome, finish_args
from taskrunner.worker.notes import Notes, Reports, progress_values


@dataclass(eq=False)
class Load:
    """What one sync carries: outcomes and stuck marks per queue, progress reports."""

    ended: dict[str, list[Ended]] = field(default_factory=dict)
    marks: list[tuple[str, str, str]] = field(default_factory=list)  # (queue, id, attempt)
    notes: Reports = field(default_factory=dict)


class Outbox:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.load = Load()
        self.since = 0.0  # when the oldest outcome waiting came (time.monotonic())
        self.notes = Notes()
        self.on_the_way: list[Load] = []  # loaded into syncs not answered yet, oldest first
        self.to_carry: list[joins.Entry] = []  # outbox entries our finishes left, for the worker to carry

    def report(self, d: Delivery, outcome: Outcome, began: float | None = None, ended: float | None = None) -> None:
        """How a delivery ended; `began` and `ended` (time.monotonic()) as Ended has them."""
        if not self.load.ended:
            self.since = time.monotonic()
        self.load.ended.setdefault(d.queue, []).append(Ended(d.id, d.attempt, outcome, began, d.task, ended))

    def mark_stuck(self, d: Delivery) -> None:
        self.load.marks.append((d.queue, d.id, d.attempt))

    def note(self, d: Delivery, message: dict[str, Any], now: float) -> bool:
        """A running job's progress or log line (notes.Notes.add)."""
        return self.notes.add(d.queue, d.id, d.attempt, message, now)

    @property
    def outcomes_since(self) -> float | None:
        """When the oldest outcome waiting came; None when none waits."""
        return self.since if self.load.ended else None

    def empty(self) -> bool:
        """Nothing waiting and nothing on its way."""
        return not (self.load.ended or self.load.marks or self.notes.pending or self.on_the_way)

    def holds(self, job_id: str) -> bool:
        """Is the job's outcome waiting here, or on its way?"""
        return any(e.id == job_id for load in (self.load, *self.on_the_way) for ended in load.ended.values()
                   for e in ended)

    def waiting(self) -> set[tuple[str, str]]:
        """The deliveries (id, attempt) whose outcome waits to be reported."""
        return {(e.id, e.attempt) for ended in self.load.ended.values() for e in ended}

    def put_into(self, batch: scripts.Batch, now: float) -> Load:
        """Load everything waiting into the batch (progress first: a job's last lines are
        recorded while it still holds the job; then outcomes, then stuck marks)."""
        load, self.load = self.load, Load()
        load.notes = self.notes.take()
        keys, s = self.app.keys, self.app.settings
        for q, jobs in load.notes.items():
            batch.call(scripts.PROGRESS, [keys.q(q)], progress_values(jobs))
        for q, ended in load.ended.items():
            batch.call(scripts.FINISH, [keys.q(q)], finish_args(s, ended, now))
        for q, job_id, attempt in load.marks:
            batch.call(scripts.STUCK, [keys.q(q)], [job_id, attempt, time.time() + s.stuck_recheck, s.bucket_width])
        if load.ended or load.marks or load.notes:
            self.on_the_way.append(load)
        return load

    def answered(self, load: Load, results: list[Any]) -> list[tuple[str, Ended, int]]:
        """Redis ran the load's calls (`results`: their answers, first in the batch): each
        outcome with its queue and finish.lua's answer (0: another delivery holds the job).
        The outbox entries the finishes left (children in other slots) go to `to_carry`."""
        self.on_the_way = [x for x in self.on_the_way if x is not load]
        acks = results[len(load.notes):]
        out = []
        for (q, ended), answers in zip(load.ended.items(), acks):
            answers, entries = joins.split(answers, len(ended))
            self.to_carry += entries
            out += [(q, e, ack) for e, ack in zip(ended, answers)]
        return out

    def failed(self) -> None:
        """The syncs on their way failed: what they carried waits here again, before what
        came since, to go with the next sync."""
        merged = Load()
        for load in (*self.on_the_way, self.load):
            for q, ended in load.ended.items():
                merged.ended.setdefault(q, []).extend(ended)
            merged.marks += load.marks
        for load in reversed(self.on_the_way):
            self.notes.put_back(load.notes)
        self.on_the_way.clear()
        self.load = merged
        if merged.ended:
            self.since = time.monotonic()
