"""The worker's side of job progress and log lines: what its children reported, kept
until the worker's next sync with Redis, which sends it with one progress.lua call per
queue (docs/PROTOCOL.md, Progress and logs). A task's progress() or log() thus costs a
pipe write, never a Redis round trip of its own; Redis hears of it within EVERY seconds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from taskrunner.worker.context import LINE_MAX, LOG_LINES

#: Seconds a reported progress or log line may wait for a sync that happens anyway.
EVERY = 0.5


@dataclass
class Pending:
    """One delivery's reports since the last sync: the latest progress ("" none), its
    note, the new log lines (at most LOG_LINES) and how many older ones were dropped."""

    progress: str = ""
    note: str = ""
    lines: list[bytes] = field(default_factory=list)
    dropped: int = 0

    def merge(self, newer: Pending) -> None:
        if newer.progress:
            self.progress, self.note = newer.progress, newer.note
        self.lines += newer.lines
        self.dropped += newer.dropped
        self._cap()

    def _cap(self) -> None:
        over = len(self.lines) - LOG_LINES
        if over > 0:
            del self.lines[:over]
            self.dropped += over


#: queue -> (job id, attempt) -> what it reported
Reports = dict[str, dict[tuple[str, str], Pending]]


class Notes:
    def __init__(self) -> None:
        self.pending: Reports = {}
        self.since = 0.0  # when the oldest pending report came (time.monotonic())

    def add(self, queue: str, job_id: str, attempt: str, message: dict[str, Any], now: float) -> bool:
        """Keep a child's report about a delivery it runs: {"progress": [id, attempt,
        fraction, note]} or {"log": [id, attempt, [time, attempt, text]]}. False when it is
        neither (the caller logs it)."""
        p = Pending()
        try:
            if "progress" in message:
                fraction, note = message["progress"][2:4]
                if not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                    return False
                p.progress, p.note = repr(float(fraction)), str(note)[:LINE_MAX]
            else:
                t, n, text = message["log"][2]
                p.lines.append(orjson.dumps([t, n, str(text)[:LINE_MAX]]))
        except (KeyError, TypeError, ValueError):
            return False
        if not self.pending:
            self.since = now
        self.pending.setdefault(queue, {}).setdefault((job_id, attempt), Pending()).merge(p)
        return True

    def due(self) -> float:
        return self.since + EVERY if self.pending else float("inf")

    def take(self) -> Reports:
        taken, self.pending = self.pending, {}
        return taken

    def put_back(self, older: Reports) -> None:
        """Reports a sync carried that Redis may not have applied (it failed): they go
        again, before what came since."""
        newer, self.pending = self.pending, older
        for q, jobs in newer.items():
            for key, p in jobs.items():
                self.pending.setdefault(q, {}).setdefault(key, Pending()).merge(p)


def progress_values(jobs: dict[tuple[str, str], Pending]) -> list[Any]:
    """progress.lua's arguments for one queue's reports."""
    values: list[Any] = [LOG_LINES]
    for (job_id, attempt), p in jobs.items():
        values += [job_id, attempt, p.progress, p.note, b"\n".join(p.lines), p.dropped]
    return values
