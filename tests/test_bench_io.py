"""The I/O-bound benchmark (bench/io_bound.py) through its real entry point, taskrunner's
part only (the peers need bench/.venv-peers): a few jobs per mode on a real stack, every
figure present and every process stopped. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from bench.io_bound import parse_args
from tests.conftest import ROOT


@pytest.mark.timeout(200)
def test_taskrunner_part_runs_and_reports(tmp_path):
    out, js = tmp_path / "io.txt", tmp_path / "io.json"
    cmd = [sys.executable, "-m", "bench.io_bound", "--only", "taskrunner-async,taskrunner-threads,taskrunner-processes",
           "--jobs", "60", "--concurrency", "4,8", "--out", str(out), "--json", str(js),
           "--logs", str(tmp_path / "logs"), "--max-time", "170"]
    mark = {"TEST_BENCH_IO_RUN": str(tmp_path)}  # inherited by every process the bench starts
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **mark}, capture_output=True, text=True, timeout=190)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    runs = json.loads(js.read_text())["runs"]
    assert sorted((x["system"], x["concurrency"]) for x in runs) == [
        ("taskrunner-async", 4), ("taskrunner-async", 8), ("taskrunner-processes", 4), ("taskrunner-processes", 8),
        ("taskrunner-threads", 4), ("taskrunner-threads", 8)]
    for x in runs:
        assert x["jobs"] == 60 and x["rate"] > 0 and 0 < x["of_ideal"] and x["rss_per_job_mb"] > 0
        assert x["redis_cpu_us_per_job"] > 0 and x["redis_cmds_per_job"] > 0 and x["redis_reads_per_job"] > 0
    text = out.read_text()
    assert r.stdout == text
    assert "4-way (ideal 200 jobs/s)" in text and "8-way (ideal 400 jobs/s)" in text
    assert "taskrunner worker -c 2 --async-slots C/2" in text and "--threads C/2 --async-slots 0" in text
    assert "taskrunner worker -c C --async-slots 0" in text
    assert not started_by(mark)  # its workers and redis-server were stopped


def started_by(mark: dict[str, str]) -> list[psutil.Process]:
    """The live processes whose environment has `mark`."""
    (key, value), = mark.items()
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(key) == value:
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "63"], "multiple of 2"),
    (["--concurrency", "x"], "comma-separated integers"),
    (["--only", "huey"], "unknown system(s) huey"),
    (["--jobs", "0"], "at least 1"),
])
def test_bad_arguments_get_one_clear_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err
