"""bench/cluster.py runs end to end on a small scale, through `python -m bench.bench --cluster`
(which hands it the options that follow): one hot queue, sharded on a local cluster, against
one server; every job drained in both, and everything it started stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.test_bench_io import started_by


def test_cluster_bench_runs_and_reports(tmp_path):
    js = tmp_path / "cluster.json"
    cmd = [sys.executable, "-m", "bench.bench", "--cluster", "--jobs", "400", "--workers", "1", "--repeat", "1",
           "--shards", "3", "--json", str(js), "--max-time", "170"]
    mark = {"TEST_BENCH_CLUSTER_RUN": str(tmp_path)}  # inherited by every process the bench starts
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **mark, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=190)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    runs = json.loads(js.read_text())["runs"]
    assert [x["topology"] for x in runs] == ["one", "cluster"]
    for x in runs:
        assert x["jobs"] == 400 and x["rate"] > 0 and x["redis_cpu_us_per_job"] > 0 and x["workers_cpu_us_per_job"] > 0
    assert "cluster of 3, 3 shards" in r.stdout and "cluster / one server:" in r.stdout
    assert not started_by(mark)  # its workers and redis-servers were stopped
