"""What a workflow's join costs Redis: the same number of no-op jobs drained as plain jobs
and as 2-step chains (the second step made pending by the first one's finish), on a
redis-server of our own, one worker -c 2 --prefetch 1 (a job per claim, as real jobs that
take time are claimed: both kinds are claimed alike, and the difference is the join's);
Redis CPU (used_cpu_sys + used_cpu_user) and commands per job from the worker's start to the
last job, rounds alternating.

    python -m bench.workflow_cost                 # 4,000 jobs, 3 rounds
    python -m bench.workflow_cost --jobs 10000 --rounds 5

The difference per job, doubled, is the join's cost per step that has a parent. (With
batched claims the chains would also pay for smaller batches: their second steps become
pending one by one.)"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import redis

from taskrunner.ops.redis_server import RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drain(url: str, kind: str, n: int) -> tuple[float, float]:
    from bench import tasks_taskrunner as t
    from taskrunner import chain

    r = redis.Redis.from_url(url)
    r.flushall()
    t.app.configure(redis_url=url, prefix="wfcost")
    if kind == "plain":
        t.app.enqueue_many([{"task": "bench.step"} for _ in range(n)])
    else:
        for _ in range(n // 2):
            chain(t.step.s(), t.step.s()).delay()

    def cpu() -> float:
        i = r.info("cpu")
        return i["used_cpu_user"] + i["used_cpu_sys"]

    def calls() -> int:
        return sum(v["calls"] for v in r.info("commandstats").values())

    c0, k0 = cpu(), calls()
    env = {**os.environ, "REDIS_URL": url, "TASKRUNNER_PREFIX": "wfcost", "PYTHONPATH": ROOT}
    w = subprocess.Popen([sys.executable, "-m", "taskrunner", "worker", "-A", "bench.tasks_taskrunner", "-c", "2",
                          "--prefetch", "1"],
                         env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        done = t.app.keys.q("default") + "completed"
        while r.zcard(done) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{kind}: not drained in 300 s")
            time.sleep(0.05)
        return (cpu() - c0) / n * 1e6, (calls() - k0) / n
    finally:
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(d, appendonly=False).start()
        os.environ["REDIS_URL"] = server.url  # for bench.tasks_taskrunner's app
        try:
            for n in range(a.rounds):
                got = {kind: drain(server.url, kind, a.jobs) for kind in ("plain", "chain")}
                (pu, pc), (cu, cc) = got["plain"], got["chain"]
                print(f"round {n + 1}: plain {pu:5.1f} us {pc:4.1f} cmds/job; 2-step chains {cu:5.1f} us {cc:4.1f} "
                      f"cmds/job; join per step with a parent ~{2 * (cu - pu):5.1f} us, {2 * (cc - pc):4.1f} cmds",
                      flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
