"""What flow control (rate limits, concurrency keys: docs/PROTOCOL.md, Flow control) costs
Redis per job, and that a queue without it pays nothing: each job claimed alone (one
claim.lua call) and finished alone (one finish.lua call), Redis's own time for those calls
(INFO commandstats: usec of FCALL, or of EVALSHA before, which includes the commands the scripts run) and the
commands per job, on a redis-server of our own.

    python -m bench.flow_cost                        # 4,000 jobs of each kind, 3 rounds
    PYTHONPATH=/path/to/older/checkout python bench/flow_cost.py --kinds plain   # before

Kinds: `plain` (a queue with no flow control: what every queue paid before), `capped` (a
task with max_concurrency, never reached), `rate` (a queue rate limit never reached). Rounds
alternate the kinds."""

from __future__ import annotations

import argparse
import os
import tempfile

import redis

from taskrunner import TaskRunner
from taskrunner.ops.redis_server import RedisServer
from taskrunner.protocol import scripts
from taskrunner.protocol.claims import claim_args
from taskrunner.protocol.outcome import Ended, Outcome, finish_args

KINDS = ("plain", "capped", "rate")


def cost(url: str, kind: str, n: int) -> tuple[float, float]:
    """(Redis µs, commands) per job of `kind`, claimed and finished one per call."""
    r = redis.Redis.from_url(url)
    r.flushall()
    app = TaskRunner("flowcost", redis_url=url, prefix="flowcost")
    options = {"max_concurrency": 1_000_000} if kind == "capped" else {}
    app.task(lambda: None, name="flowcost.step", **options)
    p = app.keys.q("default")
    if kind == "rate":
        r.hset(p + "meta", "rate", "999999999/s")
    app.enqueue_many([{"task": "flowcost.step"} for _ in range(n)])
    argv = claim_args(app, "bench", "h", "127.0.0.1", [os.getpid(), ""])
    r.config_resetstat()
    for _ in range(n):
        answer = scripts.CLAIM(app.redis, [p], argv)
        ended = Ended(answer[1], str(answer[2]), Outcome.completed("null"))
        assert scripts.FINISH(app.redis, [p], finish_args(app.settings, [ended], 0)) == [1]
    stats = r.info("commandstats")
    assert r.llen(p + "pending") == 0 and r.hlen(p + "running") == 0
    calls = sum(v["calls"] for k, v in stats.items() if not k.startswith(("cmdstat_config", "cmdstat_info")))
    script = [stats.get(k, {"usec": 0, "calls": 0}) for k in ("cmdstat_fcall", "cmdstat_evalsha")]  # FCALL: since fcall
    return sum(s["usec"] for s in script) / n, (calls - sum(s["calls"] for s in script)) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    a = p.parse_args()
    kinds = a.kinds.split(",")
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(d, appendonly=False).start()
        try:
            for n in range(a.rounds):
                line = "  ".join(f"{k}: {us:5.1f} us {cmds:4.1f} cmds" for k in kinds
                                 for us, cmds in [cost(server.url, k, a.jobs)])
                print(f"round {n + 1} (claim + finish, per job): {line}", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
