"""Compaction of the job-history archive on real files: fewer files, the same records, and
every record exactly once for a reader and for the next compaction whatever step dies."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from datetime import datetime, timezone

import pyarrow.parquet as pq
import pytest

from taskrunner.ops.analyze import plan
from taskrunner.ops.compact import Compactor
from taskrunner.ops.dispatcher import Dispatcher
from taskrunner.ops.history import Archiver, live_files, open_dir
from tests.conftest import wait_for
from tests.test_history import DiesBeforeTrim

DAY = 86400
# Records of "today" finish up to 600 s before NOW: in the first hour of a UTC day they would
# land in yesterday's partition (the tests failed from 00:00 to 00:10 UTC). NOW is then an
# hour into the day, a little ahead of the clock; the day stays the clock's.
NOW = max(time.time(), time.time() // DAY * DAY + 3600)


def day(offset: int) -> str:
    return datetime.fromtimestamp(NOW - offset * DAY, timezone.utc).strftime("%Y-%m-%d")


def put(app, n: int, days: list[int], queue: str = "default", start: int = 0) -> None:
    """n records into the history stream, finished on the given days before today (0: today)."""
    pipe = app.redis.pipeline(transaction=False)
    for i in range(start, start + n):
        finished = NOW - days[i % len(days)] * DAY - (i % 600)
        pipe.xadd(app.keys.q(queue) + "history", {
            "id": f"j{i}", "task": "t", "queue": queue, "state": "completed", "attempt": "1",
            "enqueued_at": f"{finished - 2:.6f}", "started_at": f"{finished - 1:.6f}",
            "finished_at": f"{finished:.6f}", "worker": "w", "host": "h", "pid": "1"})
    pipe.execute()
    app.redis.sadd(app.keys.queues, queue)


def read(directory) -> list[dict]:
    """What a reader sees: the files analyze would read (its own path filter), every row."""
    files, _ = plan(str(directory), 0)
    return sorted((row for f in files for row in pq.read_table(str(directory) + f).to_pylist()),
                  key=lambda r: r["stream_id"])


def on_disk(directory) -> list[str]:
    """Every record of every Parquet file there is, leftovers included."""
    return sorted(r for f in directory.glob("date=*/queue=*/*.parquet")
                  for r in pq.read_table(f, columns=["stream_id"]).column("stream_id").to_pylist())


def files(directory, when: str | None = None) -> list:
    return sorted(directory.glob(f"date={when or '*'}/queue=*/*.parquet"))


@pytest.fixture
def archive(app, tmp_path):
    """2,400 records over today and the 3 days before, 2 queues, in batches of 60: 20
    files a (date, queue) partition."""
    for q in ("q1", "q2"):
        put(app, 1200, [0, 1, 2, 3], queue=q)
    assert Archiver(app, str(tmp_path), batch=60).archive() == 2400
    return tmp_path


def test_compaction_merges_small_files_and_keeps_every_record(app, stack, archive):
    before = read(archive)
    assert len(before) == 2400 and len(files(archive)) == 160
    size = sum(f.stat().st_size for f in files(archive, day(1)))
    stats = Compactor(app, str(archive), target_mb=size / 2 / 4 / 2**20).run()  # ~4 files a partition
    assert stats["partitions"] == 6 and stats["merged"] == 120 and 6 < stats["written"] <= 36
    assert read(archive) == before and on_disk(archive) == [r["stream_id"] for r in before]
    assert len(files(archive, day(0))) == 40  # today's partitions: not by default
    assert not list(archive.rglob(".*"))
    # by hand, one day, into one file a partition
    r = stack.cli("history", "compact", "--date", day(1), "--history-dir", str(archive), "--json", check=True)
    assert json.loads(r.stdout)["partitions"] == 2 and len(files(archive, day(1))) == 2
    assert read(archive) == before and on_disk(archive) == [r["stream_id"] for r in before]
    r = stack.cli("history", "compact", "--date", "yesterday", "--history-dir", str(archive))
    assert r.returncode == 2 and "--date" in r.stderr
    app.redis.set(app.keys.g + "history:compact:lock", "the dispatcher's", ex=60)
    r = stack.cli("history", "compact", "--history-dir", str(archive))
    assert r.returncode == 1 and r.stderr.startswith("Error: another compaction of the job history runs"), r


class Dies(Compactor):
    """Dies (KeyboardInterrupt) at one step of its first merge."""

    def __init__(self, *args, at: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.drops = at, 0

    def _merge(self, group, tmp):
        super()._merge(group, tmp)
        if self.at == "written":
            raise KeyboardInterrupt("killed with the merged file under its temporary name")

    def _commit(self, tmp, final):
        super()._commit(tmp, final)
        if self.at == "renamed":
            raise KeyboardInterrupt("killed with the merged file in place, its inputs all there")

    def _drop(self, path):
        super()._drop(path)
        self.drops += 1
        if self.at == "deleting" and self.drops == 3:
            raise KeyboardInterrupt("killed with some inputs deleted")


@pytest.mark.parametrize("at", ["written", "renamed", "deleting"])
def test_a_compaction_killed_at_any_step_leaves_every_record_once(app, archive, at):
    before = read(archive)
    with pytest.raises(KeyboardInterrupt):
        Dies(app, str(archive), at=at).run([day(2)])
    assert read(archive) == before  # a reader meanwhile: each record once
    leftovers = {"written": ".compact-", "renamed": "", "deleting": ""}[at]
    assert any(f.name.startswith(leftovers) for f in archive.glob(f"date={day(2)}/queue=q1/*"))
    if at != "written":  # inputs on disk beside their merged file, which readers ignore
        assert len(on_disk(archive)) > 2400
    assert not app.redis.exists(app.keys.g + "history:compact:lock")
    Compactor(app, str(archive)).run([day(2)])  # the next one finishes it
    assert read(archive) == before and on_disk(archive) == [r["stream_id"] for r in before]
    assert len(files(archive, day(2))) == 2 and not list(archive.rglob(".compact-*"))


def test_late_files_and_an_unfinished_batch_are_left_alone(app, archive):
    """The archiver may write into a past day's partition while it is compacted (a late
    batch), or have died with a batch written and not trimmed (it writes that file again):
    compaction merges neither, deletes neither, and every record stays once."""
    put(app, 30, [2], queue="q1", start=5000)
    with pytest.raises(KeyboardInterrupt):
        DiesBeforeTrim(app, str(archive), batch=30).archive(["q1"])
    unfinished = app.redis.get(app.keys.q("q1") + "history:batch").replace(" ", "_") + ".parquet"
    put(app, 30, [2], queue="q1", start=6000)

    class ArchiverMeanwhile(Compactor):
        def _merge(self, group, tmp):
            Archiver(app, str(archive), batch=1000).archive(["q1"])  # the unfinished batch again, then a late one
            super()._merge(group, tmp)

    ArchiverMeanwhile(app, str(archive)).run([day(2)])
    folder = archive / f"date={day(2)}" / "queue=q1"
    names = sorted(f.name for f in folder.glob("*.parquet"))
    assert unfinished in names and len(names) == 3, names  # merged, unfinished batch, late batch
    rows = read(archive)
    assert len(rows) == 2460 and len({r["stream_id"] for r in rows}) == 2460
    assert on_disk(archive) == [r["stream_id"] for r in rows]
    assert {f.base_name for f in live_files(*open_dir(str(folder)))} == set(names)


def test_dispatchers_compact_once_a_day(app, archive, monkeypatch, caplog):
    """...and log what they did: the last day compacted is yesterday (today is left to
    tomorrow's run), not today."""
    caplog.set_level(logging.INFO, logger="taskrunner.dispatcher")
    monkeypatch.setenv("TASKRUNNER_HISTORY_DIR", str(archive))
    before = read(archive)
    first, second = Dispatcher(app, "d1"), Dispatcher(app, "d2")
    app.redis.set(app.keys.g + "history:compact:lock", "someone", ex=60)  # a compaction by hand runs
    first.compact_history(NOW).join(30)
    assert not app.redis.exists(app.keys.g + "history:compacted") and len(files(archive)) == 160
    app.redis.delete(app.keys.g + "history:compact:lock")
    first.compact_history(NOW).join(30)
    assert app.redis.get(app.keys.g + "history:compacted") == day(1)
    assert len(files(archive)) == 6 + 40  # one file a past partition; today's as they were
    assert f"dispatcher d1: history compacted up to {day(1)} (days compacted: 3 days, {day(3)} to {day(1)}): " \
           "partitions=6 merged=120 written=6" in caplog.text
    assert second.compact_history(NOW) is None and first.compact_history(NOW) is None  # done for today
    tomorrow = Dispatcher(app, "d3").compact_history(NOW + DAY)  # yesterday again (late batches), then today
    tomorrow.join(30)
    assert app.redis.get(app.keys.g + "history:compacted") == day(0) and len(files(archive)) == 8
    assert f"dispatcher d3: history compacted up to {day(0)} (days compacted: 2 days, {day(1)} to {day(0)})" \
        in caplog.text
    assert read(archive) == before and on_disk(archive) == [r["stream_id"] for r in before]


def test_sigkilled_compaction_loses_and_duplicates_nothing(app, stack, tmp_path):
    put(app, 3000, list(range(1, 31)), queue="q1")
    assert Archiver(app, str(tmp_path), batch=150).archive() == 3000  # 600 files over 30 days
    before = read(tmp_path)
    p = stack.spawn("history", "compact", "--history-dir", str(tmp_path))
    wait_for(lambda: len(files(tmp_path)) < 600, what="compaction under way")
    os.killpg(p.pid, signal.SIGKILL)  # mid-run: maybe mid-merge, maybe mid-deletion
    p.wait()
    assert read(tmp_path) == before
    app.redis.delete(app.keys.g + "history:compact:lock")  # its lock would expire after 600 s
    r = stack.cli("history", "compact", "--history-dir", str(tmp_path), check=True)
    assert "files merged into" in r.stdout and len(files(tmp_path)) == 30
    assert read(tmp_path) == before and on_disk(tmp_path) == [r["stream_id"] for r in before]
