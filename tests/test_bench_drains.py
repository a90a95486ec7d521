"""bench/bench.py's drains beside the no-op one, through its real entry point, taskrunner's
part only (the peers need bench/.venv-peers), a few jobs each: the drain whose jobs make one
Redis round trip (rt) and 20 ms jobs run unbatched (io), their rows next to the no-op drain's
in one report, every process stopped. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.bench import IO_SYSTEMS, SYSTEMS, parse_args
from bench.io_bound import SYSTEMS as IO_BOUND
from tests.conftest import ROOT
from tests.test_bench_io import started_by


@pytest.mark.timeout(200)
def test_round_trip_and_unbatched_drains_are_reported_beside_the_no_op_drain(tmp_path):
    js = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "bench.bench", "--only", "taskrunner", "--metrics", "drain,rt,io", "--jobs", "200",
           "--io-jobs", "60", "--io-concurrency", "4", "--repeat", "1", "--json", str(js), "--max-time", "170"]
    mark = {"TEST_BENCH_DRAINS_RUN": str(tmp_path)}  # inherited by every process the bench starts
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **mark}, capture_output=True, text=True,
                       timeout=190)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    res = json.loads(js.read_text())["results"]
    for key in ("drain_rate", "redis_cpu_per_1000", "rt_drain_rate", "rt_redis_cpu_per_1000", "io_rate",
                "io_redis_cpu_per_1000"):
        assert res[key]["taskrunner"]["median"] > 0, key
    rows = [line.strip().split("  ")[0] for line in r.stdout.splitlines()]
    cpu = rows.index("Redis CPU per 1000 jobs (drain)")
    assert rows[cpu + 1:cpu + 3] == ["Redis CPU per 1000 jobs (drain, 1 round trip/job)",
                                     "Redis CPU per 1000 jobs (4-way, 20 ms jobs, unbatched)"]
    assert "drain throughput, each job one Redis round trip (INCR)" in rows
    details = json.loads(js.read_text())["details"]
    assert sorted(d["round_trip"] for d in details["drain"]) == [False, True]
    assert [d["system"] for d in details["io"]] == ["taskrunner-processes"] and details["io"][0]["jobs"] == 60
    assert not started_by(mark)  # its workers and redis-server were stopped


def test_every_system_has_an_unbatched_counterpart():
    assert sorted(IO_SYSTEMS) == sorted(SYSTEMS) and set(IO_SYSTEMS.values()) <= set(IO_BOUND)


@pytest.mark.parametrize("args, message", [
    (["--io-concurrency", "3"], "--io-concurrency: an even number from 2 to 64"),
    (["--io-concurrency", "128"], "--io-concurrency: an even number from 2 to 64"),
    (["--metrics", "drain,bogus"], "unknown metric(s) bogus"),
])
def test_bad_arguments_get_one_clear_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_run_from_a_checkout_not_installed_says_so_in_its_versions(monkeypatch):
    """A bare machine (the 16-core one) runs the bench from the checkout on PYTHONPATH, with
    no taskrunner distribution installed: the results' versions say so, rather than the run
    ending in PackageNotFoundError before its first measurement."""
    import importlib.metadata

    from bench.bench import versions

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "taskrunner":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    got = versions(["taskrunner"])
    assert got["taskrunner"].startswith("not installed (git ") and got["redis-py"] == real("redis")
