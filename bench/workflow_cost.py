"""What a workflow's join costs Redis: the finish of a job that has a waiting child (the
first step of a 2-step chain, whose finish makes the second pending) against the finish of a
plain job, one finish.lua call per job, on a redis-server of our own.

    python -m bench.workflow_cost                 # 4,000 jobs of each kind, 3 rounds
    python -m bench.workflow_cost --jobs 10000 --rounds 5

Per round and kind: the jobs are enqueued and claimed (taskrunner.client.consumer.Consumer),
then acked one per call, and Redis CPU (used_cpu_sys + used_cpu_user) and commands are
counted over the acks alone; the difference per job is the join's cost per step that has a
parent. Rounds alternate the kinds."""

from __future__ import annotations

import argparse
import os
import tempfile

import redis

from taskrunner import TaskRunner, chain
from taskrunner.client.consumer import Consumer
from taskrunner.ops.redis_server import RedisServer


def finishes(url: str, kind: str, n: int) -> tuple[float, float]:
    """(Redis CPU µs, commands) per finish of `n` jobs of `kind`: plain, or parent."""
    r = redis.Redis.from_url(url)
    r.flushall()
    app = TaskRunner("wfcost", redis_url=url, prefix="wfcost")
    step = app.task(lambda *_: None, name="wfcost.step")
    if kind == "plain":
        app.enqueue_many([{"task": "wfcost.step"} for _ in range(n)])
    else:
        for _ in range(n):
            chain(step.s(), step.s()).delay()
    consumer = Consumer(app, ["default"])
    held = []
    while len(held) < n:
        held += consumer.claim(min(500, n - len(held)))
    info = r.info

    def cpu() -> float:
        i = info("cpu")
        return i["used_cpu_user"] + i["used_cpu_sys"]

    def calls() -> int:
        return sum(v["calls"] for v in info("commandstats").values())

    c0, k0 = cpu(), calls()
    for d in held:
        assert consumer.ack([d], [1]) == [True]
    c1, k1 = cpu(), calls()
    if kind == "parent":  # every second step was made pending by its parent's finish
        assert r.llen(app.keys.q("default") + "pending") == n
    return (c1 - c0) / n * 1e6, (k1 - k0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(d, appendonly=False).start()
        try:
            for n in range(a.rounds):
                (pu, pc), (cu, cc) = (finishes(server.url, kind, a.jobs) for kind in ("plain", "parent"))
                print(f"round {n + 1}: finish of a plain job {pu:5.1f} us {pc:4.1f} cmds; of a step with a waiting "
                      f"child {cu:5.1f} us {cc:4.1f} cmds; the join {cu - pu:5.1f} us, {cc - pc:4.1f} cmds",
                      flush=True)
        finally:
            server.stop()
            os.environ.pop("REDIS_URL", None)


if __name__ == "__main__":
    main()
