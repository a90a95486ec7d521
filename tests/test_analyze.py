"""The PySpark analysis on a real local SparkSession, checked figure by figure against a
plain-Python computation over the same records."""

from __future__ import annotations

import json
import os
import random
from collections import Counter, defaultdict
from datetime import datetime, timezone

import pytest

if not os.environ.get("CI"):  # CI installs PySpark and Java: there a missing one fails
    pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'taskrunner[spark]')")

from taskrunner.ops import analyze  # noqa: E402
from taskrunner.ops.history import Archiver  # noqa: E402

NOW = 1_800_000_000.0
STATES = ["completed"] * 7 + ["failed", "killed", "requeued", "canceled"]


@pytest.fixture(scope="module")
def spark():
    session = analyze.spark_session("local[2]")
    yield session
    session.stop()


def generate(app, n: int, seed: int = 7, days: float = 3) -> list[dict]:
    """n history records across tasks, queues, hosts and hours (finished over the `days`
    before NOW), written to the streams, for the real archiver."""
    rnd = random.Random(seed)
    records = []
    pipe = app.redis.pipeline(transaction=False)
    for i in range(n):
        queue = rnd.choice(["q1", "q2"])
        state = rnd.choice(STATES)
        finished = NOW - rnd.uniform(0, days * 86400)
        runtime = rnd.lognormvariate(-2, 1) if i % 97 else 0.0  # and some of 0 s
        wait = rnd.expovariate(5) if i % 89 else -rnd.expovariate(500)  # some negative: clocks skewed
        rec = {"id": f"j{i}", "task": rnd.choice(["a.send", "b.resize", "c.report"]), "queue": queue,
               "state": state, "attempt": str(rnd.randint(1, 3)), "enqueued_at": f"{finished - runtime - wait:.6f}",
               "started_at": f"{finished - runtime:.6f}", "finished_at": f"{finished:.6f}",
               "runtime": f"{runtime:.6f}", "wait": f"{wait:.6f}", "worker": rnd.choice(["w1", "w2", "w3"]),
               "host": rnd.choice(["h1", "h2"]), "pid": "100",
               "error_type": rnd.choice(["ValueError", "Timeout", "KeyError"]) if state in ("failed", "killed") else ""}
        if state == "canceled":  # never started: no runtime, no wait
            rec.update(started_at="", runtime="", wait="")
        pipe.xadd(app.keys.q(queue) + "history", rec)
        records.append(rec)
    pipe.execute()
    app.redis.sadd(app.keys.queues, "q1", "q2")
    return records


def percentile_ok(values: list[float], got: float | None, p: int) -> bool:
    """Is `got` the p-th percentile of `values` (nearest rank: the ceil(p/100 * n)-th
    smallest, exact integer arithmetic) within analyze's stated bound: PRECISION of it,
    relative, or MIN_VALUE absolute for a value under MIN_VALUE (reported as 0)?"""
    if not values:
        return got is None
    values = sorted(values)
    exact = values[max(1, -(-p * len(values) // 100)) - 1]
    if abs(exact) < analyze.MIN_VALUE:
        return got == 0
    return abs(got - exact) <= analyze.PRECISION * abs(exact) * (1 + 1e-9)


def expected(records: list[dict], key: str, since: float) -> dict[str, dict]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        finished = float(r["finished_at"])
        if finished < NOW - since:
            continue
        k = r[key] if key != "hour" else datetime.fromtimestamp(finished, timezone.utc).strftime("%Y-%m-%dT%H:00Z")
        groups[k].append(r)
    return groups


def check_figures(summary: dict, records: list[dict], since: float) -> None:
    """Every figure of `summary` against a plain-Python computation over `records`."""
    in_window = [r for r in records if float(r["finished_at"]) >= NOW - since]
    assert summary["records"] == len(in_window)
    for name, key in analyze.GROUPS.items():
        want = expected(records, key, since)
        got = {row[key]: row for row in summary[name]}
        assert set(got) == set(want), name
        for k, rows in want.items():
            row = got[k]
            states = Counter(r["state"] for r in rows)
            assert row["count"] == len(rows)
            for s in ("completed", "failed", "killed", "requeued", "canceled"):
                assert row[s] == states[s] and row[f"{s}_rate"] == pytest.approx(states[s] / len(rows), abs=1e-6)
            runtimes = [float(r["runtime"]) for r in rows if r["runtime"]]
            waits = [float(r["wait"]) for r in rows if r["wait"]]
            for p in (50, 95, 99):
                assert percentile_ok(runtimes, row[f"runtime_p{p}"], p), (name, k, p, row)
            for p in (50, 95):
                assert percentile_ok(waits, row[f"wait_p{p}"], p), (name, k, p, row)
            errors = Counter(r["error_type"] for r in rows if r["error_type"])
            assert {e["error_type"]: e["count"] for e in row["top_errors"]} == dict(errors.most_common(5))
    all_errors = Counter(r["error_type"] for r in in_window if r["error_type"])
    assert {e["error_type"]: e["count"] for e in summary["errors"]} == dict(all_errors)


@pytest.mark.parametrize("since", [7 * 86400, 86400])
def test_every_figure_matches_plain_python(app, tmp_path, spark, since):
    records = generate(app, 3000)
    assert Archiver(app, str(tmp_path), batch=1000).archive() == 3000
    summary = analyze.analyze(str(tmp_path), since, now=NOW, spark=spark)
    check_figures(summary, records, since)
    assert (tmp_path / "_analysis" / "tasks").is_dir()


def test_since_reads_only_the_partitions_of_its_window(app, tmp_path, spark):
    """An archive of 40 days; --since 3d reads the last days' partitions (4: today and the 3
    before), their files and no others, and its figures are exact."""
    records = generate(app, 4000, seed=3, days=40)
    assert Archiver(app, str(tmp_path), batch=250).archive() == 4000
    days = sorted(p.name[5:] for p in tmp_path.glob("date=*"))
    assert len(days) == 41
    recent = [d for d in days if d >= datetime.fromtimestamp(NOW - 3 * 86400, timezone.utc).strftime("%Y-%m-%d")]
    files = [f for d in recent for f in (tmp_path / f"date={d}").rglob("*.parquet")]
    archived = list(tmp_path.glob("date=*/queue=*/*.parquet"))
    assert len(recent) == 4 and len(files) < len(archived) / 5
    summary = analyze.analyze(str(tmp_path), 3 * 86400, now=NOW, spark=spark)
    assert summary["read"] == {"partitions": 4, "partitions_total": 41, "files": len(files),
                               "bytes": sum(f.stat().st_size for f in files)}
    check_figures(summary, records, 3 * 86400)
    whole = analyze.analyze(str(tmp_path), 50 * 86400, now=NOW, spark=spark)
    assert whole["read"]["partitions"] == 41 and whole["read"]["files"] == len(archived)
    check_figures(whole, records, 50 * 86400)


def test_files_compacted_away_while_listed_are_read_again(app, tmp_path, spark, monkeypatch):
    """A compaction may delete the files analyze listed (merged into one) before Spark reads
    them: analyze lists again and reads the merged file, each record once."""
    from taskrunner.ops.compact import Compactor
    from taskrunner.ops.history import dates, open_dir

    records = generate(app, 1500, seed=5)
    assert Archiver(app, str(tmp_path), batch=100).archive() == 1500
    stale = analyze.plan(str(tmp_path), NOW - 7 * 86400)
    Compactor(app, str(tmp_path)).run(dates(*open_dir(str(tmp_path))))
    listings, real = [stale], analyze.plan  # the first listing: taken before the compaction
    monkeypatch.setattr(analyze, "plan", lambda *a: listings.pop() if listings else real(*a))
    said: list[str] = []
    summary = analyze.analyze(str(tmp_path), 7 * 86400, now=NOW, spark=spark, progress=said.append)
    assert "a file was compacted away while read: reading again" in said
    assert summary["read"]["files"] < stale[1]["files"]
    check_figures(summary, records, 7 * 86400)


def test_cli_analyze_json_and_dashboard_history(app, stack, tmp_path, spark):
    generate(app, 500)
    Archiver(app, str(tmp_path)).archive()
    summary = analyze.analyze(str(tmp_path), 10 * 86400, now=NOW, spark=spark)
    analyze.publish(app, summary)
    for t in summary["tasks"]:
        for k in ("task", "count", "completed", "failed", "killed", "requeued", "runtime_p50", "runtime_p95",
                  "runtime_p99", "wait_p95"):
            assert k in t
    from dashboard import create_app

    page = create_app(app).test_client().get("/history").get_data(as_text=True)
    assert "<svg" in page and "a.send" in page and "Throughput per hour" in page
    api = create_app(app).test_client().get("/api/history").get_json()
    assert api["records"] == 500
    stack.env["TASKRUNNER_SPARK_CONF"] = "spark.driver.memory=600m, spark.sql.shuffle.partitions=5"
    r = stack.cli("analyze", "--since", "3650d", "--history-dir", str(tmp_path), "--json",
                  "--conf", "spark.sql.shuffle.partitions=3", timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["records"] == 500 and {t["task"] for t in out["tasks"]} == {"a.send", "b.resize", "c.report"}
    assert "analyze: starting Spark" in r.stderr
    # --conf over TASKRUNNER_SPARK_CONF over the defaults, as the session has them
    assert out["spark"]["conf"] == {**analyze.DEFAULT_CONF, "spark.driver.memory": "600m",
                                    "spark.sql.shuffle.partitions": "3"}


def test_spark_conf_defaults_env_and_flags(monkeypatch):
    monkeypatch.delenv("TASKRUNNER_SPARK_CONF", raising=False)
    assert analyze.spark_conf() == analyze.DEFAULT_CONF
    assert analyze.DEFAULT_CONF["spark.sql.shuffle.partitions"] == "4"
    assert analyze.DEFAULT_CONF["spark.driver.memory"] == "1g"
    monkeypatch.setenv("TASKRUNNER_SPARK_CONF", "spark.sql.shuffle.partitions=8,spark.driver.memory=2g,")
    conf = analyze.spark_conf(["spark.driver.memory=3g", "spark.executor.extraJavaOptions=-Da=b=c"])
    assert conf["spark.sql.shuffle.partitions"] == "8" and conf["spark.driver.memory"] == "3g"
    assert conf["spark.executor.extraJavaOptions"] == "-Da=b=c" and conf["spark.ui.enabled"] == "false"


@pytest.mark.parametrize("args, env, line", [
    (["--conf", "spark.driver.memory"], "", "Error: bad --conf entry 'spark.driver.memory': use key=value, e.g. "
                                            "spark.driver.memory=2g\n"),
    ([], "spark.a=1,oops", "Error: bad TASKRUNNER_SPARK_CONF entry 'oops': use key=value, e.g. "
                           "spark.driver.memory=2g\n")])
def test_cli_analyze_bad_conf_is_a_usage_error(app, stack, tmp_path, args, env, line):
    stack.env["TASKRUNNER_SPARK_CONF"] = env
    r = stack.cli("analyze", "--history-dir", str(tmp_path), *args)
    assert r.returncode == 2 and r.stdout == "" and r.stderr == line, r


def test_analysis_as_a_periodic_job(app, tmp_path, spark, monkeypatch):
    from taskrunner import TaskRunner

    monkeypatch.setenv("TASKRUNNER_HISTORY_DIR", str(tmp_path))
    t = TaskRunner("self", redis_url=app.settings.redis_url, prefix=app.settings.prefix, analyze_cron="0 * * * *")
    assert t.schedules["taskrunner.analyze"].cron == "0 * * * *"
    generate(t, 200)
    Archiver(t, str(tmp_path)).archive()
    assert t.tasks["taskrunner.analyze"](since="3650d") == {"records": 200, "seconds": pytest.approx(0, abs=600)}
    assert analyze.latest(t)["records"] == 200


@pytest.mark.timeout(600)  # and the cluster's start, when it is the first to ask (1-3 min on 2 busy cores)
def test_same_figures_on_a_standalone_cluster(app, stack, tmp_path, spark, spark_cluster):
    """The CLI runs the same job on a standalone cluster (the tests' master and worker, on
    loopback) and must agree with local mode."""
    generate(app, 400, seed=11)
    archive = tmp_path / "history"
    Archiver(app, str(archive)).archive()
    local = analyze.analyze(str(archive), 3650 * 86400, spark=spark)
    r = stack.cli("analyze", "--since", "3650d", "--history-dir", str(archive), "--master", spark_cluster.master,
                  "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    remote = json.loads(r.stdout)
    for name in analyze.GROUPS:
        assert remote[name] == local[name], name
    assert remote["records"] == 400
    assert remote["spark"]["master"] == spark_cluster.master


def test_local_spark_runs_our_python(tmp_path):
    """In local mode Spark's Python workers run the interpreter of the process that started
    it (the virtualenv's), not the first python3 on PATH. They ran /usr/bin/python3."""
    import subprocess
    import sys

    code = ("from taskrunner.ops import analyze; s = analyze.spark_session('local[1]'); "
            "print(s.sparkContext.parallelize([0], 1).map(lambda _: __import__('sys').executable).collect()[0]); "
            "s.stop()")
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_PYTHON"}
    here = os.path.dirname(sys.executable)  # as when a venv's command runs without activating it
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != here)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == sys.executable


def test_cli_analyze_of_no_archive_says_so_and_publishes_nothing(app, stack, tmp_path):
    """A --history-dir that does not exist (a typo, another directory than the
    dispatcher's): one line, exit 1, before Spark starts, and the dashboard's last analysis
    stays. It said "0 records" and replaced that analysis with an empty one."""
    analyze.publish(app, {"records": 5, "tasks": []})
    r = stack.cli("analyze", "--history-dir", str(tmp_path / "typo"), timeout=300)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr == f"Error: no job history at {tmp_path / 'typo'}: the dispatcher archives finished jobs " \
                       "into ./var/history of its directory (or TASKRUNNER_HISTORY_DIR) every 5 s; `taskrunner " \
                       "history archive` does it now; or give --history-dir\n", r.stderr
    assert analyze.latest(app)["records"] == 5
