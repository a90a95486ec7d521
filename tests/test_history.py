"""Job history: captured atomically with each state change, archived to Parquet exactly
once whatever dies when."""

from __future__ import annotations

import json
import logging
import os
import signal

import pyarrow.parquet as pq
import pytest
import redis

from taskrunner import JobFailed
from taskrunner.client.consumer import Consumer
from taskrunner.ops import history
from taskrunner.ops.dispatcher import Dispatcher
from taskrunner.ops.history import Archiver, _next_id
from taskrunner.protocol import scripts
from tests import apps
from tests.conftest import free_port, wait_for


def stream(app, queue="default"):
    """The queue's history records, each's fields by name (whichever shape: history.read)."""
    return history.read(app.redis.xrange(app.keys.q(queue) + "history"), queue)


def archived(directory) -> list[dict]:
    files = sorted(p for p in directory.rglob("*.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def test_every_end_and_requeue_is_recorded(app, stack):
    stack.worker(concurrency=1)
    ok = apps.add.delay(1, 2)
    bad = apps.boom.delay("no")
    retried = apps.flaky.delay("h1", 2)  # fails once, then completes
    ok.wait(30)
    with pytest.raises(JobFailed):
        bad.wait(30)
    stack.dispatcher()
    retried.wait(30)
    killed = apps.add.apply_async([1, 1], delay=100)
    killed.kill()
    rows = [f for _, f in stream(app)]
    by_job = {}
    for f in rows:
        by_job.setdefault(f["id"], []).append(f["state"])
    assert by_job[ok.id] == ["completed"] and by_job[bad.id] == ["failed"] and by_job[killed.id] == ["killed"]
    assert by_job[retried.id] == ["requeued", "completed"]
    [done] = [f for f in rows if f["id"] == ok.id]
    assert done["task"] == "tests.apps.add" and done["queue"] == "default" and done["attempt"] == "1"
    assert float(done["finished_at"]) >= float(done["started_at"]) >= float(done["enqueued_at"])
    assert done["worker"] and done["pid"] and "runtime" not in done  # the archiver derives it
    assert [f["error_type"] for f in rows if f["id"] == bad.id] == ["ValueError"]


def fill(app, n: int, queue: str = "default", per_ack: int = 500) -> set[str]:
    """n completed deliveries through the real scripts, quickly (a consumer acks them,
    `per_ack` a finish call: a history entry each)."""
    app.enqueue_many([{"task": "tests.apps.add", "args": [i, 1], "queue": queue} for i in range(n)])
    c = Consumer(app, [queue])
    ids = set()
    while True:
        got = c.claim(per_ack)
        if not got:
            return ids
        assert all(c.ack(got))
        ids.update(d.id for d in got)


def test_history_status_counts_the_records_of_batch_entries(app, stack):
    """An entry holds a finish call's records (here 500 and a last 37): `history status`
    counts records, not entries; the dispatcher's estimate is exact on so few entries."""
    fill(app, 1537)
    assert app.redis.xlen(app.keys.q("default") + "history") == 4
    assert history.backlog(app) == {"default": 1537}
    assert stack.cli("history", "status", check=True).stdout.split() == ["default", "1537", "waiting"]


def test_history_status_says_so_when_there_is_nothing_to_show_or_no_redis(app, stack):
    """No queue: one line, not a blank output (`--json`: an empty object); a queue whose
    stream is empty: its row; Redis down: one line, exit 3."""
    r = stack.cli("history", "status", check=True)
    assert (r.stdout, r.stderr) == ("no queues: no job history to archive\n", "")
    assert json.loads(stack.cli("history", "status", "--json", check=True).stdout) == {}
    stack.cli("queue", "create", "quiet", check=True)
    assert stack.cli("history", "status", check=True).stdout.split() == ["quiet", "0", "waiting"]
    for how in ([], ["--json"]):
        r = stack.cli("history", "status", *how, "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
        assert r.returncode == 3 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("Error: cannot reach Redis at redis://127.0.0.1:"), r.stderr


def test_archive_writes_each_record_once_partitioned_by_date(app, tmp_path):
    ids = fill(app, 2500)
    n = Archiver(app, str(tmp_path), batch=1000).archive()
    assert n == 2500 and stream(app) == []
    rows = archived(tmp_path)
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert {r["state"] for r in rows} == {"completed"}
    for r in rows:  # derived from the times
        assert r["runtime"] == pytest.approx((r["finished_at"] - r["started_at"]).total_seconds(), abs=2e-6)
        assert r["wait"] == pytest.approx((r["started_at"] - r["enqueued_at"]).total_seconds(), abs=2e-6)
        assert r["runtime"] >= 0 and r["wait"] >= 0
    parts = {p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.parquet")}
    assert all(p.startswith("date=") and p.endswith("/queue=default") for p in parts)
    assert len(list(tmp_path.rglob("*.parquet"))) == 3


class DiesBeforeTrim(Archiver):
    """Writes its files, then 'dies' before it can trim the stream."""

    def _write(self, *args):
        super()._write(*args)
        raise KeyboardInterrupt("killed after writing")


def test_death_after_writing_duplicates_nothing(app, tmp_path):
    ids = fill(app, 1200)
    with pytest.raises(KeyboardInterrupt):
        DiesBeforeTrim(app, str(tmp_path), batch=500).archive()
    fill(app, 300)  # more history arrives meanwhile
    Archiver(app, str(tmp_path), batch=700).archive()  # another batch size: the recorded range still wins
    rows = archived(tmp_path)
    assert len(rows) == 1500 and len({r["stream_id"] for r in rows}) == 1500
    assert ids <= {r["id"] for r in rows}


def test_death_between_the_trim_and_forgetting_the_batch_loses_and_duplicates_nothing(app, tmp_path):
    """The trim and the forgetting of a batch are two commands (no MULTI: redis-py before 6.1
    has none on a cluster). An archiver that dies between them leaves a recorded batch that
    is gone from the stream: the next one goes on with the rest."""
    ids = fill(app, 1200)
    with pytest.raises(KeyboardInterrupt):
        DiesBeforeTrim(app, str(tmp_path), batch=500).archive()
    key = app.keys.q("default") + "history"
    _, last = app.redis.get(key + ":batch").split()
    app.redis.xtrim(key, minid=_next_id(last), approximate=False)  # the dead archiver's trim, not its DEL
    assert Archiver(app, str(tmp_path), batch=700).archive() == 700 and stream(app) == []
    rows = archived(tmp_path)
    assert len(rows) == 1200 and len({r["stream_id"] for r in rows}) == 1200 and {r["id"] for r in rows} == ids


def test_sigkilled_archiver_loses_and_duplicates_nothing(app, stack, tmp_path):
    key = app.keys.q("default") + "history"
    pipe = app.redis.pipeline(transaction=False)
    for i in range(60_000):
        pipe.xadd(key, {"id": f"j{i}", "task": "t", "queue": "default", "state": "completed", "attempt": "1",
                        "finished_at": "1800000000.5", "runtime": "0.1"})
    pipe.execute()
    app.redis.sadd(app.keys.queues, "default")
    p = stack.spawn("history", "archive", "--batch", "2000", "--history-dir", str(tmp_path))
    wait_for(lambda: len(list(tmp_path.rglob("*.parquet"))) >= 3, what="a few batches written")
    os.killpg(p.pid, signal.SIGKILL)  # mid-run: maybe mid-batch, maybe between batches
    p.wait()
    app.redis.delete(app.keys.q("default") + "history:lock")  # its lock would expire after 300 s
    r = stack.cli("history", "archive", "--batch", "3000", "--history-dir", str(tmp_path), check=True)
    assert "records archived" in r.stdout
    rows = archived(tmp_path)
    assert len(rows) == 60_000 and len({r["id"] for r in rows}) == 60_000
    assert app.redis.xlen(key) == 0


def test_dispatcher_archives_and_warns_when_behind(app, tmp_path, monkeypatch, caplog):
    fill(app, 50)
    monkeypatch.setenv("TASKRUNNER_HISTORY_DIR", str(tmp_path))
    monkeypatch.setattr(history, "WARN_BACKLOG", 10)
    monkeypatch.setattr("taskrunner.ops.dispatcher.WARN_BACKLOG", 10)
    d = Dispatcher(app)
    assert d.archive_history(["default"]) == 50
    fill(app, 20)
    app.redis.set(app.keys.q("default") + "history:lock", "someone else", ex=60)  # an archiver is stuck
    with caplog.at_level(logging.ERROR, logger="taskrunner.dispatcher"):
        assert d.archive_history(["default"]) == 0
    assert "20 history records of queue default wait" in caplog.text
    d.run_once()
    from dashboard import create_app

    page = create_app(app).test_client().get("/").get_data(as_text=True)
    assert "Job history of queue default is not archived fast enough" in page


def records_in(app, queue="default") -> int:
    """The records of the queue's stream, counted by reading it whole."""
    return sum(history.count(f) for _, f in app.redis.xrange(app.keys.q(queue) + "history"))


def test_the_stream_counts_its_records_as_entries_and_extra(app, tmp_path):
    """finish.lua counts a batch entry's records beyond the first in history:extra, and the
    archiver's trim (trim.lua) takes them off with the entries: backlog() (XLEN + extra) is
    the stream's count at each step, and the count goes with the stream's last entry."""
    fill(app, 1200, per_ack=500)  # entries of 500, 500, 200
    fill(app, 30, per_ack=1)  # 30 entries of one
    key = app.keys.q("default") + "history"
    assert app.redis.xlen(key) == 33 and app.redis.get(key + ":extra") == str(499 + 499 + 199)
    assert history.backlog(app, ["default"]) == {"default": 1230} == {"default": records_in(app)}
    Archiver(app, str(tmp_path), batch=600).archive_batch("default")  # two entries: 1000 records
    assert history.backlog(app, ["default"]) == {"default": 230} == {"default": records_in(app)}
    assert Archiver(app, str(tmp_path), batch=600).archive() == 230
    assert app.redis.xlen(key) == 0 and not app.redis.exists(key + ":extra")
    for bad, why in ([["x", 0], "stream id"], [["1-0", -1], "whole number"], [["1-0", 0, "yes"], "forget"]):
        with pytest.raises(redis.ResponseError, match=why):
            scripts.TRIM(app.redis, [app.keys.q("default")], bad)


def test_the_dispatcher_keeps_a_stream_within_its_cap_in_records(app, monkeypatch):
    """An entry may hold a finish call's many records: the dispatcher's pass trims the stream
    to CAP records exactly (whole entries, oldest first), archiving or not (here: pyarrow
    missing, as in a core install), and no further."""
    from taskrunner.errors import MissingExtra

    def no_pyarrow(*_a, **_k):
        raise MissingExtra("archiving job history to Parquet", "history")

    monkeypatch.setattr("taskrunner.ops.dispatcher.Archiver", no_pyarrow)
    monkeypatch.setattr(history, "CAP", 1000)
    monkeypatch.setattr("taskrunner.ops.dispatcher.CAP", 1000)
    fill(app, 1500, per_ack=500)
    fill(app, 300, per_ack=1)
    d = Dispatcher(app)
    d.archive_history(["default"])  # 1800 records: the two oldest entries (1000) go, 800 stay
    assert history.backlog(app, ["default"]) == {"default": 800} == {"default": records_in(app)}
    assert app.redis.xlen(app.keys.q("default") + "history") == 301
    d.archive_history(["default"])
    assert records_in(app) == 800
    assert d.history_backlog == {}  # not archived: nothing to warn of (history stays in Redis, capped)


def test_the_cap_trims_through_a_dead_archivers_batch_and_forgets_it(app, tmp_path, monkeypatch):
    """An archiver that died after writing its batch leaves the range recorded; while no one
    archives it (a failing archive, history_interval 0), the stream must still be capped: the
    cap trims that range whole and forgets it, so the next archiver writes ranges after it —
    nothing twice in the archive, nothing over the cap in Redis."""
    monkeypatch.setattr(history, "CAP", 1000)
    monkeypatch.setattr("taskrunner.ops.dispatcher.CAP", 1000)
    first = fill(app, 1200)  # entries of 500, 500, 200
    with pytest.raises(KeyboardInterrupt):
        DiesBeforeTrim(app, str(tmp_path), batch=500).archive()  # wrote the first entry's 500, trimmed nothing
    key = app.keys.q("default") + "history"
    assert app.redis.exists(key + ":batch")
    later = fill(app, 1000)
    for _ in range(2):  # a pass, and one more: the cap holds, the dead batch is gone
        Dispatcher(app).cap_history(["default"], archived=False)
        assert history.backlog(app, ["default"]) == {"default": 1000} == {"default": records_in(app)}
    assert not app.redis.exists(key + ":batch")
    Archiver(app, str(tmp_path), batch=700).archive()
    rows = archived(tmp_path)
    assert len(rows) == 1500 and len({r["stream_id"] for r in rows}) == len({r["id"] for r in rows}) == 1500
    assert later <= {r["id"] for r in rows} and len(first & {r["id"] for r in rows}) == 500


def test_a_failing_archive_trims_nothing_below_the_cap(app, tmp_path, monkeypatch):
    """Entries of one record, then a few of many (a quiet hour, then a burst), while the
    archive cannot be written: the stream holds far fewer records than its cap, and the
    dispatcher's pass keeps them all (an estimate from the newest entries dropped ~half)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("TASKRUNNER_HISTORY_DIR", str(blocker / "history"))
    fill(app, 2000, per_ack=1)
    fill(app, 1000, per_ack=100)
    Dispatcher(app).archive_history(["default"])
    assert records_in(app) == 3000 == history.backlog(app, ["default"])["default"]


def test_entries_of_either_shape_are_archived_alike(app, tmp_path):
    """A stream holds entries an older worker wrote (a field each, `queue` among them, an
    empty `error_type`) and this one's (`id`, `v`, `error_type` when there is one; the queue
    is the stream's): the archiver writes the same row for the same delivery either way —
    a host with spaces whole, a canceled step's empty values as none."""
    key = app.keys.q("default") + "history"
    old = {"task": "t.a", "queue": "default", "state": "failed", "attempt": "2", "enqueued_at": "1800000000.25",
           "started_at": "1800000001.5", "finished_at": "1800000003.75", "worker": "w1", "host": "big host 7",
           "pid": "4242"}
    app.redis.xadd(key, {"id": "j-old", **old, "error_type": "ValueError"})
    app.redis.xadd(key, {"id": "j-new", "v": " ".join(old[k] for k in history.PACKED), "error_type": "ValueError"})
    app.redis.xadd(key, {"id": "c-old", "task": "t.b", "queue": "default", "state": "canceled", "attempt": "0",
                         "enqueued_at": "1800000000.5", "started_at": "", "finished_at": "1800000004",
                         "worker": "", "host": "", "pid": "", "error_type": "Canceled"})
    app.redis.xadd(key, {"id": "c-new", "v": "canceled 0 1800000000.5  1800000004  t.b  ", "error_type": "Canceled"})
    app.redis.xadd(key, {"id": "k-old", "task": "t.c", "queue": "default", "state": "completed", "attempt": "1",
                         "enqueued_at": "1800000000", "started_at": "1800000000.5", "finished_at": "1800000001",
                         "worker": "w2", "host": "h", "pid": "7", "error_type": ""})
    app.redis.xadd(key, {"id": "k-new", "v": "completed 1 1800000000 1800000000.5 1800000001 7 t.c w2 h"})
    assert Archiver(app, str(tmp_path)).archive(["default"]) == 6
    rows = {r.pop("id"): r for r in archived(tmp_path)}
    for r in rows.values():
        r.pop("stream_id")
    assert rows["j-old"] == rows["j-new"] and rows["c-old"] == rows["c-new"] and rows["k-old"] == rows["k-new"]
    j, c, k = rows["j-new"], rows["c-new"], rows["k-new"]
    assert (j["queue"], j["state"], j["attempt"], j["host"], j["pid"], j["error_type"]) == (
        "default", "failed", 2, "big host 7", 4242, "ValueError")
    assert (j["runtime"], j["wait"]) == (2.25, 1.25)
    assert (c["state"], c["attempt"], c["started_at"], c["worker"], c["pid"], c["runtime"]) == (
        "canceled", 0, None, "", None, None)
    assert (k["error_type"], k["runtime"], k["wait"]) == (None, 0.5, 0.5)
