"""Redis CPU per enqueued job of enqueue.lua: what each job costs the Redis server itself,
the one resource every producer and worker shares.

    python -m bench.enqueue_cost                              # this tree's enqueue.lua
    python -m bench.enqueue_cost main=git:main mine=git:HEAD  # two revisions, side by side
    python -m bench.enqueue_cost old=/tmp/old.lua new=taskrunner/protocol/scripts/enqueue.lua

Each argument is LABEL=SOURCE, SOURCE a file (run with this tree's _lib.lua) or git:REV
(that revision's enqueue.lua and _lib.lua). Starts its own redis-server (unix socket, no
persistence) and times, from INFO commandstats (usec of EVALSHA, reset before each run), four
cases: the Python producer (every setting sent, so no declaration is read) with 1 job per
call and with 1000; a foreign producer sending only task, queue, args and kwargs of a task
declared in `P:{Q}:tasks`, with 1 and 1000 jobs per call. Prints the median of --reps runs
(cases and scripts interleaved, so that a busy machine slows all of them alike), in
microseconds of Redis CPU per job. A script that does not read KEYS[2] (before the queue
registry) gets KEYS[1] alone and no payload limit, as its producers called it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import redis

from taskrunner.ops.redis_server import RedisServer
from taskrunner.protocol.codec import new_id

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = "taskrunner/protocol/scripts"
PREFIX = "tr:{default}:"
ARGS, KWARGS = json.dumps([1, "two", {"three": 3}]), json.dumps({"k": "v"})
#: What taskrunner's Python producer sends for a task declared in the producing process.
PYTHON = ["task", "bench.noop", "queue", "default", "args", ARGS, "kwargs", KWARGS,
          "max_duration", 300.0, "retries", 0, "retry_backoff", 1.0, "timeout_policy", "kill", "max_lost", 5,
          "producer", "host:1234:5678"]
#: A foreign producer's job: the settings come from the declaration below.
FOREIGN = ["task", "bench.declared", "queue", "default", "args", ARGS, "kwargs", KWARGS]
DECLARATION = {"queue": "default", "max_duration": 10, "retries": 3, "retry_backoff": 0.05,
               "timeout_policy": "flag", "max_lost": 2}
#: label -> (fields, jobs per call, calls): about 10,000 jobs each.
CASES = {"python, 1 job/call": (PYTHON, 1, 10_000), "python, 1000 jobs/call": (PYTHON, 1000, 10),
         "foreign, 1 job/call": (FOREIGN, 1, 10_000), "foreign, 1000 jobs/call": (FOREIGN, 1000, 10)}


def source(spec: str) -> str:
    """The full script (_lib.lua + enqueue.lua) that `spec`, a path or git:REV, names."""
    if spec.startswith("git:"):
        rev = spec[4:]
        show = lambda name: subprocess.run(["git", "show", f"{rev}:{SCRIPTS}/{name}"], cwd=ROOT, check=True,  # noqa: E731
                                           capture_output=True, text=True).stdout
        return show("_lib.lua") + "\n" + show("enqueue.lua")
    return (ROOT / SCRIPTS / "_lib.lua").read_text() + "\n" + Path(spec).read_text()


def reset(r: redis.Redis) -> None:
    r.flushdb()
    r.hset(PREFIX + "tasks", "bench.declared", json.dumps(DECLARATION))
    r.config_resetstat()


def cost(r: redis.Redis, sha: str, registry: bool, fields: list, per_call: int, calls: int) -> float:
    """Microseconds of Redis CPU per job over `calls` calls of `per_call` jobs each."""
    keys = [PREFIX, "tr:{_}:queues"] if registry else [PREFIX]
    reset(r)
    for _ in range(calls):
        argv: list = [per_call]
        for _ in range(per_call):
            argv += [new_id(), 0, len(fields) // 2, *fields]
        if registry:
            argv.append(1048576)
        answer = r.evalsha(sha, len(keys), *keys, *argv)
        assert answer == [1] * per_call, answer
    return r.info("commandstats")["cmdstat_evalsha"]["usec"] / (calls * per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", nargs="*", default=[f"this tree={SCRIPTS}/enqueue.lua"],
                        help="LABEL=SOURCE, SOURCE a file or git:REV (default: this tree's script)")
    parser.add_argument("--reps", type=int, default=5, help="runs of each case and script (default 5)")
    opts = parser.parse_args()
    scripts = dict(s.split("=", 1) for s in opts.scripts)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp), appendonly=False).start()
        try:
            r = redis.Redis.from_url(server.url)
            loaded = {}
            for label, spec in scripts.items():
                text = source(spec)
                loaded[label] = (r.script_load(text), "KEYS[2]" in text)
            runs: dict[tuple[str, str], list[float]] = {}
            for _ in range(opts.reps):
                for case, (fields, per_call, calls) in CASES.items():
                    for label, (sha, registry) in loaded.items():
                        runs.setdefault((case, label), []).append(cost(r, sha, registry, fields, per_call, calls))
        finally:
            server.stop()
    width = max(12, *(len(label) for label in scripts))
    print(f"Redis CPU per job, us (median of {opts.reps})")
    print(f"{'case':25}" + "".join(f"{label:>{width + 2}}" for label in scripts))
    for case in CASES:
        print(f"{case:25}" + "".join(f"{statistics.median(runs[case, label]):>{width + 2}.2f}" for label in scripts))


if __name__ == "__main__":
    main()
