"""The claim protocol's client side, shared by workers and consumers: the arguments of
claim.lua, its answer decoded into records, and the per-queue calls a Redis Cluster needs
(docs/PROTOCOL.md, Claim and Answers)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from taskrunner.protocol import codec, scripts, shards
from taskrunner.protocol.connection import is_cluster

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

#: Values per job in claim.lua's answer.
STRIDE = 10


@dataclass(eq=False)
class Delivery:
    """One claimed job: what claim.lua answered for it (docs/PROTOCOL.md, Answers) and, in
    a worker, what became of it in the child it was sent to. args_json, kwargs_json and
    headers_json are the JSON text stored ("" headers: none): a worker passes it to its
    child undecoded; a consumer reads args, kwargs and headers. Two deliveries of one job
    are two objects (eq is identity)."""

    queue: str
    id: str
    attempt: str  # the fencing token finish.lua needs
    task: str
    args_json: str
    kwargs_json: str
    max_duration: float
    timeout_policy: str = "kill"
    headers_json: str = ""
    soft_limit: str = ""  # seconds, as the record has it ("": none)
    began: float | None = None  # worker: monotonic; when its child began it (None: still queued there)
    stuck: bool = False  # worker: flagged stuck (past its max duration)
    seq: int = 0  # worker: its number among the jobs sent to its child
    stop_reason: str | None = None  # worker: why it was asked to stop in a loop child (cancel)
    stop_at: float | None = None  # worker: then its child is stopped if it has not answered

    @property
    def deadline(self) -> float:
        return self.began + self.max_duration if self.began is not None else float("inf")

    @cached_property
    def _payload(self) -> tuple[Any, Any]:
        try:
            return codec.loads(self.args_json), codec.loads(self.kwargs_json)
        except ValueError:
            return self.args_json, self.kwargs_json  # the consumer sees the record as it is

    @property
    def args(self) -> Any:
        return self._payload[0]

    @property
    def kwargs(self) -> Any:
        return self._payload[1]

    @property
    def headers(self) -> Any:
        """The headers as a dict ({} when none); their text when it is not JSON."""
        try:
            return codec.loads(self.headers_json) if self.headers_json else {}
        except ValueError:
            return self.headers_json

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "queue": self.queue, "attempt": int(self.attempt), "task": self.task,
                "args": self.args, "kwargs": self.kwargs, "max_duration": self.max_duration,
                "timeout_policy": self.timeout_policy, "headers": self.headers}


def decode(answer: list[Any], queues: list[str]) -> tuple[list[Delivery], float | None]:
    """claim.lua's answer, STRIDE values per job, as records; `queues`: the call's queues in
    KEYS order (the answer numbers them from 1). And the value after the jobs, when there
    is one: the seconds until a rate limit that held a job back has a token again (None:
    none did, docs/PROTOCOL.md, Flow control)."""
    jobs = len(answer) - len(answer) % STRIDE
    return ([Delivery(queues[int(answer[i]) - 1], answer[i + 1], str(answer[i + 2]), answer[i + 3], answer[i + 4],
                      answer[i + 5], float(answer[i + 6]), answer[i + 7], answer[i + 8], answer[i + 9])
             for i in range(0, jobs, STRIDE)],
            float(answer[jobs]) if jobs < len(answer) else None)


def sooner(a: float | None, b: float | None) -> float | None:
    """The sooner of two waits for a token (None: no wait)."""
    return b if a is None else a if b is None else min(a, b)


def claim_args(app: TaskRunner, name: str, host: str, ip: str, slots: list[Any]) -> list[Any]:
    """ARGV of claim.lua for a claimer; `slots`: a (PID, seconds ahead) pair per job wanted."""
    head = codec.dumps({"worker": name, "host": host, "ip": ip}).decode()[:-1]
    return [head, name, host, ip, app.settings.bucket_width, app.settings.max_duration, *slots]


def claim_keys(app: TaskRunner, prefixes: list[str]) -> list[str]:
    """KEYS of the first claim.lua call: every queue, in priority order; on a Redis Cluster,
    whose scripts must touch one slot, the first queue alone (claim_rest() goes on)."""
    return prefixes[:1] if is_cluster(app.redis) else prefixes


def claim_rest(app: TaskRunner, queues: list[str], args: list[Any],
               answer: list[Any]) -> tuple[list[Delivery], float | None]:
    """The jobs claimed, from the first call's `answer` (KEYS: claim_keys()); on a cluster
    the later queues go on, one call each, in priority order, while jobs are still wanted
    (strict priority, as in one call), each pair's seconds ahead counting the jobs claimed
    for its process before. Job k went to pair k. With them, the seconds until a rate
    limit that held a job back has a token again (None: none did). Of a sharded queue
    (shards.py) a cluster's claim asks the first shard in `queues` alone: no round trip
    per empty shard; a claimer that got fewer jobs than it wanted waits on every shard's
    wake list, and a shard with jobs left has a token there; a busy worker first claims
    from the next shard (Worker._next_shard; docs/PROTOCOL.md, Sharded queues)."""
    claimed, wait = decode(answer, queues)
    if not is_cluster(app.redis):
        return claimed, wait
    head, pairs = args[:6], args[6:]
    asked = {shards.logical(queues[0])}
    for queue in queues[1:]:
        n = len(claimed)
        if 2 * n == len(pairs):
            break
        if shards.logical(queue) in asked:
            continue
        asked.add(shards.logical(queue))
        ahead: dict[Any, float] = {}  # pid -> max durations of the jobs claimed for it so far
        for pid, c in zip(pairs[0:2 * n:2], claimed):
            ahead[pid] = ahead.get(pid, 0.0) + c.max_duration
        rest: list[Any] = []
        for pid, base in zip(pairs[2 * n::2], pairs[2 * n + 1::2]):
            rest += [pid, base if base == "" else f"{float(base) + ahead.get(pid, 0.0):.3f}"]
        more, later = decode(scripts.CLAIM(app.redis, [app.keys.q(queue)], head + rest), [queue])
        claimed += more
        wait = sooner(wait, later)
    return claimed, wait
