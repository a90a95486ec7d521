"""How a delivery ended: the one type that a child, the worker, a Consumer and eager mode
build, and the 8 values per job that finish.lua takes (docs/PROTOCOL.md, Finish).

Before this type each of them wrote positional lists ["error", kind, message, tb, jitter]
by hand, in thirteen places; a field in the wrong slot was a silent misrecord."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from taskrunner.protocol import codec

if TYPE_CHECKING:
    from taskrunner.config import Settings

#: finish.lua's outcomes: completed, failed, killed end the job; error is retried while its
#: retries last; requeue, lost and return put it back.
KINDS = frozenset({"completed", "failed", "error", "killed", "requeue", "lost", "return"})


class Outcome(NamedTuple):
    """One delivery's end, in finish.lua's terms: `kind` and its four values (their
    meaning depends on the kind; build one with the class methods). A named tuple: the
    worker makes one per job it hears of, and a frozen dataclass cost it 6% of its CPU."""

    kind: str
    v1: str = ""
    v2: str = ""
    v3: str = ""
    v4: str = ""

    @classmethod
    def completed(cls, result_json: str) -> Outcome:
        return cls("completed", result_json)

    @classmethod
    def failed(cls, error_type: str, message: str, traceback: str = "") -> Outcome:
        """Failed for good: not retried whatever retries are left."""
        return cls("failed", error_type, message, traceback)

    @classmethod
    def error(cls, error_type: str, message: str, traceback: str = "", jitter: float = 1.0) -> Outcome:
        """Failed; retried after its backoff times `jitter` (0.5..1) while retries last."""
        return cls("error", error_type, message, traceback, str(jitter))

    @classmethod
    def killed(cls, reason: str) -> Outcome:
        return cls("killed", "", reason)

    @classmethod
    def requeue(cls, delay: float = 0.0, front: bool = False, why: str = "") -> Outcome:
        """Back to its queue after `delay` seconds (a Retry), or next in line (front: the
        worker stopped it); nothing is counted as failed."""
        return cls("requeue", str(delay), "front" if front else "", why)

    @classmethod
    def retry(cls, delay: float = 0.0) -> Outcome:
        """The task raised Retry: back to its queue after `delay` seconds, counted against
        its max_retries (past them finish.lua fails it with MaxRetriesExceeded)."""
        return cls("requeue", str(delay), "", "", "retry")

    @classmethod
    def lost(cls, why: str) -> Outcome:
        """Its process died while it ran: requeued, or WorkerLost after max_lost."""
        return cls("lost", why)

    @classmethod
    def returned(cls, why: str) -> Outcome:
        """It never began (sent ahead, then handed back): next in line, nothing counted."""
        return cls("return", why)

    @classmethod
    def from_wire(cls, values: list[Any]) -> Outcome:
        """From the child's reply: [kind, v1, v2, v3, v4]; ValueError if it is not one."""
        if len(values) != 5 or values[0] not in KINDS or any(type(v) is not str for v in values[1:]):
            raise ValueError(f"not an outcome: {values!r:.200}")
        return cls(*values)

    def wire(self) -> list[str]:
        return [self.kind, self.v1, self.v2, self.v3, self.v4]

    def will_retry(self, retries_left: int, retry_requests_left: int) -> bool:
        """Will finish.lua run the job again after this outcome? finish.lua's rule, in the
        one place the child decides it (middleware's on_retry or on_failure): an error while
        retries are left (the record's retries - failures), a Retry while the task may still
        ask (max_retries - retry_requests), any other requeue."""
        if self.kind == "error":
            return retries_left > 0
        if self.kind == "requeue":
            return self.v4 != "retry" or retry_requests_left > 0
        return False

    @property
    def error_type(self) -> str:
        """The exception's type for failed and error, "Killed" for killed, else ""."""
        return self.v1 if self.kind in ("failed", "error") else "Killed" if self.kind == "killed" else ""

    @property
    def message(self) -> str:
        """The error message, the kill reason, or why it was put back; "" when completed."""
        if self.kind in ("failed", "error", "killed"):
            return self.v2
        return self.v3 if self.kind == "requeue" else "" if self.kind == "completed" else self.v1

    @property
    def result(self) -> Any:
        """The task's return value (completed only; None otherwise)."""
        return codec.loads(self.v1) if self.kind == "completed" else None


class Ended(NamedTuple):
    """A delivery's outcome waiting to be reported: `began` is when it began to run
    (time.monotonic()), None when unknown (finish.lua keeps the claim's start); `ended`
    when it ended (None: at the report, as a kill's or a loss's); `task` names the job in
    the worker's log (when its result is discarded)."""

    id: str
    attempt: str
    outcome: Outcome
    began: float | None = None
    task: str = ""
    ended: float | None = None


def finish_args(settings: Settings, ended: list[Ended], now: float) -> list[Any]:
    """finish.lua's ARGV: the settings it applies to records without their own (result
    TTL, backoff cap, failed TTL), then finish_values."""
    return [settings.result_ttl, settings.retry_backoff_max, settings.failed_ttl, *finish_values(ended, now)]


#: A result that waited longer than this (seconds) before its finish (an outage, a Redis that
#: stopped answering) keeps its start exact rather than its runtime: see finish_values().
HELD = 1.0


def finish_values(ended: list[Ended], now: float) -> list[str]:
    """The 8 values per job that finish.lua takes, `now` being time.monotonic(). finish.lua
    takes its own time for a job's end (finished_at) and sets started_at `began` seconds
    before it. A result that waited a little to go with others (policy.FLUSH_AFTER, ~10 ms)
    gives its runtime (counted to when it ended, not to now): its runtime is exact, its start
    and end that much later (its queue wait counts it). One that waited longer than HELD (an
    outage) gives the time since it began: its start stays exact, its runtime counts the wait
    (a job's start moved by minutes would read, in its timeline, as having run after the outage)."""
    values: list[str] = []
    for e in ended:
        o = e.outcome
        end = now if e.ended is None or now - e.ended > HELD else e.ended
        began = "" if e.began is None else f"{max(0.0, end - e.began):.6f}"
        values += [e.id, e.attempt, o.kind, began, o.v1, o.v2, o.v3, o.v4]
    return values
