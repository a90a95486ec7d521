"""The chaos harness (bench/chaos.py), small and seeded, through its real entry point:
2,000 jobs on a real stack while every kind of fault is injected; nothing may be lost.
Below it, what the harness found, reduced to a test each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.chaos import KINDS
from tests.conftest import ROOT


@pytest.mark.timeout(400)
def test_chaos_run_loses_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "bench.chaos", "--jobs", "2000", "--seed", "7", "--fsync", "always",
           "--window", "45", "--drain", "120", "--max-time", "360", "--json", str(out),
           "--workflows", "--chord", "200", "--chain", "30"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.strip().splitlines()[-1].startswith("chaos OK: ")
    (res,) = json.loads(out.read_text())["results"]
    assert res["enqueued"] == 2000
    assert res["lost"] == {} and res["lost_to_everysec"] == {}
    assert res["stuck"] == {} and res["cron"]["stuck"] == []
    assert res["inconsistent"] == {} and "unexplained" not in res["why"]
    assert res["completed"] + sum(res["failed_as_designed"].values()) + len(res["failed_otherwise"]) == 2000
    assert res["cron"]["ticks"] > 0
    wf = res["workflows"]  # a chord of 200 and a chain of 30 under faults of their own
    assert wf["ok"] and wf["members_completed"] == 200 and wf["chain_result"] == "30"
    assert wf["callback_runs"] >= 1 and wf["callback_runs_with_every_result_in_order"] == wf["callback_runs"]
    assert {k: res["faults"].get(k, 0) >= 1 for k in KINDS} == {k: True for k in KINDS}


@pytest.mark.timeout(300)
def test_chaos_run_on_a_sharded_queue_loses_nothing(tmp_path):
    """The same faults with queue default over 3 shards (issue 18): every shard's jobs are
    found, run and judged; nothing lost."""
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "bench.chaos", "--jobs", "800", "--seed", "11", "--fsync", "always",
           "--window", "30", "--drain", "90", "--max-time", "240", "--json", str(out), "--shards", "3"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    (res,) = json.loads(out.read_text())["results"]
    assert res["enqueued"] == 800 and res["lost"] == {} and res["lost_to_everysec"] == {}
    assert res["stuck"] == {} and res["inconsistent"] == {} and "unexplained" not in res["why"]
    assert res["completed"] + sum(res["failed_as_designed"].values()) + len(res["failed_otherwise"]) == 800
