"""bench/cluster.py runs end to end on a small scale, through `python -m bench.bench --cluster`
(which hands it the options that follow): one hot queue, sharded on a local cluster, against
one server; every job drained in both, and everything it started stopped. And
bench/worker_cost.py, which says what one worker spends per job on such a cluster."""

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
        # the measured window's own figures (the whole drain's when it ended between two looks)
        assert x["measured_redis_cpu_us_per_job"] > 0 and x["measured_busiest_node_cores"] > 0
        # every job was claimed and finished by a script call, in round trips that each carried
        # several (a sync), on every node a job was placed on
        assert 1 < x["jobs_per_script_call"] <= 400 and 0 < x["redis_reads_per_job"] < 1
        assert len(x["nodes"]) == (3 if x["topology"] == "cluster" else 1)
        assert all(n["calls"] > 0 and n["reads"] > 0 and n["writes"] > 0 for n in x["nodes"])
    assert "cluster of 3, 3 shards" in r.stdout and "cluster / one server:" in r.stdout
    assert "each repeat's: " in r.stdout
    assert not started_by(mark)  # its workers and redis-servers were stopped


def test_worker_cost_bench_reports_where_a_cluster_workers_cpu_goes(tmp_path):
    """bench/worker_cost.py: one worker drains a queue sharded over a local cluster; every figure
    is measured (not zero), the jobs per script call say the syncs batched, and nothing it
    started is left. 4000 jobs: a forked child's CPU counts from its fork, in ticks of 10 ms,
    and 600 no-op jobs over two children (~5 ms each) read 0.0 now and then (CI)."""
    js = tmp_path / "w.json"
    cmd = [sys.executable, "-m", "bench.worker_cost", "--jobs", "4000", "--shards", "3", "--json", str(js),
           "--max-time", "170"]
    mark = {"TEST_BENCH_WORKER_COST_RUN": str(tmp_path)}
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **mark, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=190)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    res = json.loads(js.read_text())
    assert res["topology"] == "cluster of 3, 3 shards" and res["jobs"] == 4000 and res["rate"] > 0
    assert res["main_cpu_us_per_job"] > 0 and res["children_cpu_us_per_job"] > 0 and res["redis_cpu_us_per_job"] > 0
    assert res["jobs_per_script_call"] > 1 and 0 < res["reads_per_job"] < 1
    assert "cluster of 3, 3 shards: 4,000 no-op jobs, one worker -c 2:" in r.stdout
    assert not started_by(mark)
