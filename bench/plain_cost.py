"""Redis work per job of a queue that uses no flow control (issue 17: pause, priorities,
unique jobs must cost such a queue nothing): the whole life of a plain job — enqueue, claim,
ack, and the consumer's heartbeat before its claim — counted on a redis-server of our own,
for one or more revisions side by side.

    python -m bench.plain_cost                                 # this tree
    python -m bench.plain_cost main=git:main mine=git:HEAD     # two revisions
    python -m bench.plain_cost main=git:main mine=. --jobs 5000 --rounds 5

Each argument is LABEL=SOURCE, SOURCE a directory holding a `taskrunner` package (`.`: this
tree) or git:REV (that revision's package, extracted with `git archive`). Per round and
revision, a child process run on that package (PYTHONPATH) enqueues --jobs jobs one per call
(`task.delay`), claims them one per call and acks them one per call (Consumer), with Redis's
statistics reset first; the parent reads INFO: commands (every command, those run inside
scripts included), microseconds of the script calls (FCALL, EVALSHA before; INFO
commandstats) and Redis CPU (used_cpu_user + used_cpu_sys), each per job. Rounds alternate
the revisions, so that a busy machine slows all alike; the table shows the median of the
rounds. Commands per job are exact and the same every round; the times vary with the machine
(the table gives their range). A second table splits them by phase (enqueue, heartbeat,
claim, ack): commands, script µs (FCALL or EVALSHA), the µs of the commands the scripts ran
(INFO commandstats counts them apart, and inside the call's) and the difference, the
scripts' Lua time outside commands. Figures: docs/PERFORMANCE.md.

--batch B claims and acks B jobs per call (a drain's batches) instead of one. --instructions
runs redis-server under valgrind's callgrind and counts the instructions Redis ran in each
phase (callgrind_control zeroes and dumps the counts around it; `hz 1`, so that little of the
count is the server's timer): the same count every round to within ~1-2% on a loaded machine,
where the times swing by 20%, so a change of a few percent shows. It runs ~50x slower:
--jobs 400 is plenty.

    python -m bench.plain_cost main=git:main new=. --instructions --jobs 400 --rounds 2 --batch 8

--finished N puts N old members in the queue's `completed` set before the acks (not
counted): a set of more than 128 (`zset-max-listpack-entries`) is a skiplist, as a real
queue's is; an empty one takes its first 128 members into a listpack, each insert parsing
every score before it (~30k instructions per job of this bench's ack that a queue in use
does not pay).

    python -m bench.plain_cost main=git:main new=. --instructions --jobs 400 --rounds 2 --batch 8 --finished 200"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from taskrunner.ops.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent

#: Run in the child, on the revision's package: the job's life, one call per step, in four
#: phases (the parent reads Redis's statistics before and after each): the enqueues, the
#: consumer's heartbeats (one before each claim, as `Consumer.claim` sends it), the claims,
#: the acks.
CHILD = """
import sys
from taskrunner import TaskRunner
from taskrunner.client.consumer import Consumer
url, n, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
app = TaskRunner("flowcost", redis_url=url, prefix="flowcost")
noop = app.task(lambda *a: None, name="flowcost.noop")
noop.delay(0)  # warm-up: scripts loaded, queue registered
c = Consumer(app, ["default"])
c.ack(c.claim(1))
def phase():
    print("ready", flush=True)
    sys.stdin.readline()
phase()
for i in range(n):
    noop.delay(i)
phase()
for _ in range(n):
    c.heartbeat()
phase()
c.heartbeat = lambda *a, **k: None  # its phase was the one before
ds = []
while len(ds) < n:
    ds += c.claim(min(b, n - len(ds)))
phase()
for i in range(0, n, b):
    assert c.ack(ds[i:i + b]) == [True] * len(ds[i:i + b])
c.close()
"""

#: The finished set of CHILD's queue (--finished).
COMPLETED = "flowcost:{default}:completed"

#: The phases of CHILD, in order.
PHASES = ("enqueue", "heartbeat", "claim", "ack")

#: Per job of a phase: commands (those run by scripts included), script call (FCALL or EVALSHA) µs,
#: µs of the commands the scripts ran (inside the calls'), Redis CPU µs; with --instructions, "instr":
#: thousands of instructions Redis ran.
Phase = dict[str, float]


def tree(label: str, spec: str, tmp: Path) -> Path:
    """The directory holding the `taskrunner` package that `spec` names."""
    if spec.startswith("git:"):
        out = tmp / label
        out.mkdir()
        archive = subprocess.run(["git", "archive", spec[4:], "taskrunner"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
        return out
    return Path(spec).resolve()


class Callgrind:
    """redis-server under valgrind's callgrind: the instructions it runs between zero() and
    count()."""

    def __init__(self, directory: Path, args: list[str]) -> None:
        self.dir = directory
        self.proc = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={directory}/cg.%p",
                                      "redis-server", *args, "--hz", "1"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def _control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.proc.pid)], check=True, capture_output=True)

    def zero(self) -> None:
        self._control("-z")

    def count(self) -> int:
        """Instructions since zero(), from the dump it writes now."""
        self._control("-d")
        dumps = sorted(self.dir.glob(f"cg.{self.proc.pid}.*"), key=lambda f: f.stat().st_mtime)
        total = re.search(r"^summary: (\d+)", dumps[-1].read_text(), re.M)
        for f in dumps:
            f.unlink()
        if total is None:
            raise SystemExit(f"no instruction count in {dumps[-1]}")
        return int(total[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)


def measure(r: redis.Redis, url: str, path: Path, n: int, batch: int = 1,
            grind: Callgrind | None = None, finished: int = 0) -> dict[str, Phase]:
    """Each phase of `n` jobs run on the package in `path`, per job (see Phase); `finished`
    old members put in the queue's completed set before the acks (--finished)."""
    r.flushall()
    env = {**os.environ, "PYTHONPATH": str(path)}
    # Run in `path`: `python -c` puts the working directory first on sys.path, before
    # PYTHONPATH, so that from this checkout every revision would run this tree's package.
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, str(n), str(batch)], env=env, cwd=path,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    phases: dict[str, Phase] = {}
    try:
        assert child.stdout is not None and child.stdin is not None
        cpu0 = 0.0
        for k, name in enumerate((*PHASES, None)):
            if name is None:
                if child.wait(600) != 0:
                    raise SystemExit(f"the run on {path} failed")
            else:
                assert child.stdout.readline().strip() == "ready"
            if k:
                instr = grind.count() / n / 1000 if grind else None
                phases[PHASES[k - 1]] = _phase(r, n, cpu0)
                if instr is not None:
                    phases[PHASES[k - 1]]["instr"] = instr
            if name is not None:
                if name == "ack" and finished:
                    r.zadd(COMPLETED, {f"old{i}": i for i in range(finished)})
                r.config_resetstat()
                cpu0 = _cpu(r)
                if grind:
                    grind.zero()
                child.stdin.write("go\n")
                child.stdin.flush()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return phases


def _phase(r: redis.Redis, n: int, cpu0: float) -> Phase:
    cpu = _cpu(r) - cpu0
    # The statistics' own commands (INFO, CONFIG RESETSTAT) are ours, not the job's.
    stats = {k: v for k, v in r.info("commandstats").items() if k not in ("cmdstat_info", "cmdstat_config")}
    calls = ("cmdstat_evalsha", "cmdstat_fcall")  # a revision's scripts: EVALSHA, or FCALL (Redis Functions)
    evalsha = sum(stats.get(k, {}).get("usec", 0) for k in calls)
    inside = sum(v["usec"] for k, v in stats.items() if k not in calls)
    return {"commands": sum(v["calls"] for v in stats.values()) / n, "evalsha": evalsha / n, "inside": inside / n,
            "cpu": cpu * 1e6 / n}


def wait_up(socket: Path, grind: Callgrind, timeout: float = 120.0) -> None:
    """Until the server under callgrind answers (it starts ~50x slower)."""
    deadline = time.monotonic() + timeout
    probe = redis.Redis(unix_socket_path=str(socket))
    try:
        while True:
            if grind.proc.poll() is not None:
                raise SystemExit(f"valgrind redis-server exited with {grind.proc.returncode}")
            try:
                probe.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"redis-server under valgrind did not answer within {timeout:.0f}s") from None
                time.sleep(0.2)
    finally:
        probe.close()


def _cpu(r: redis.Redis) -> float:
    i = r.info("cpu")
    return i["used_cpu_user"] + i["used_cpu_sys"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", default=["this tree=."],
                        help="LABEL=SOURCE, SOURCE a directory or git:REV (default: this tree)")
    parser.add_argument("--jobs", type=int, default=3000, help="jobs per round (default 3000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per revision (default 3)")
    parser.add_argument("--batch", type=int, default=1, help="jobs per claim and per ack call (default 1)")
    parser.add_argument("--finished", type=int, default=0,
                        help="old members put in the completed set before the acks (default 0; > 128: a skiplist)")
    parser.add_argument("--instructions", action="store_true",
                        help="count Redis's instructions per job under valgrind's callgrind (slow: use ~400 jobs)")
    opts = parser.parse_args()
    specs = dict(s.split("=", 1) for s in opts.trees)
    runs: dict[str, list[dict[str, Phase]]] = {label: [] for label in specs}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {label: tree(label, spec, Path(tmp)) for label, spec in specs.items()}
        server = RedisServer(Path(tmp), appendonly=False)
        grind = Callgrind(Path(tmp), server.args) if opts.instructions else None
        try:
            if grind is None:
                server.start()
            else:
                wait_up(server.socket, grind)
            r = redis.Redis.from_url(server.url)
            for _ in range(opts.rounds):
                for label, path in paths.items():
                    runs[label].append(measure(r, server.url, path, opts.jobs, opts.batch, grind,
                                                       opts.finished))
        finally:
            server.stop()
            if grind is not None:
                grind.stop()
    width = max(36 if opts.instructions else 28, *(len(label) for label in specs))
    calls = "one call each" if opts.batch == 1 else f"claim and ack {opts.batch} jobs a call"
    old = f"; {opts.finished} old members in completed" if opts.finished else ""
    print(f"per plain job (enqueue + heartbeat + claim + ack, {calls}; {opts.jobs} jobs{old}; median (min-max) "
          f"of {opts.rounds} rounds)")
    print(f"{'':16}" + "".join(f"{label:>{width + 2}}" for label in specs))
    rows = (("Redis commands", lambda ph: sum(x["commands"] for x in ph.values())),
            ("script us (FCALL/EVALSHA)", lambda ph: sum(x["evalsha"] for x in ph.values())),
            ("Redis CPU us", lambda ph: sum(x["cpu"] for x in ph.values())))
    if opts.instructions:
        rows += (("Redis instr. k", lambda ph: sum(x["instr"] for x in ph.values())),)
    for what, get in rows:
        print(f"{what:16}" + "".join(f"{_cell([get(ph) for ph in runs[label]]):>{width + 2}}" for label in specs))
    print("\nper phase, per job (medians): commands / script us / us in the scripts' commands / Lua outside them"
          + (" / thousands of instructions" if opts.instructions else ""))
    for name in PHASES:
        cells = []
        for label in specs:
            ph = [x[name] for x in runs[label]]
            med = {k: statistics.median(x[k] for x in ph) for k in ("commands", "evalsha", "inside")}
            cells.append(f"{med['commands']:.1f} / {med['evalsha']:.1f} / {med['inside']:.1f} / "
                         f"{med['evalsha'] - med['inside']:.1f}"
                         + (f" / {statistics.median(x['instr'] for x in ph):.1f}" if opts.instructions else ""))
        print(f"{name:16}" + "".join(f"  {c:>{width}}" for c in cells))


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.0f}-{max(xs):.0f})"


if __name__ == "__main__":
    main()
