"""Compaction of the job-history archive: the archiver writes a file per queue and batch
(every 5 s: thousands a day); this merges each (date, queue) partition's files into files of
about a target size, exactly once whatever dies when.

A merged file is named after the stream-id range it spans, `<first of the first>_<last of
the last>.parquet`, so its inputs' ranges lie within its own. Its steps: write it under a
temporary `.compact-…` name; rename it into place (the commit: from then on every reader,
history.live_files, ignores files whose range lies within another's); delete the inputs.
A compaction killed before the rename leaves the inputs and an orphan temporary file; one
killed after it leaves inputs that readers already ignore. The next compaction deletes
both before it goes on. It merges only the files it listed, and never a file of the batch
an archiver has recorded but not finished (`p history:batch`): that archiver would write
the file again, beside the merged one. One compaction at a time (`g history:compact:lock`);
the dispatcher runs one a day and records the last day done (`g history:compacted`).

On an object store (S3) there is no rename: pyarrow's move is a copy, then the temporary's
delete. The copy is the commit (an object appears whole or not at all, and S3's listings
are consistent with it at once); one killed before the delete leaves a `.compact-` object,
which readers ignore and the next compaction deletes, as above. A merged object must stay
under S3's 5 GB limit of one copy: keep --target-mb below it."""

from __future__ import annotations

import logging
import secrets
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from taskrunner.errors import TaskRunnerError, require_extra
from taskrunner.ops.history import dates, default_dir, listing, live, live_files, open_dir, queue_dirs, schema

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

log = logging.getLogger("taskrunner.compact")
TARGET_MB = 128
#: The lock's life; renewed before each merge (a merge of TARGET_MB takes seconds).
LOCK_TTL = 600
#: Rows per row group of a merged file (the archiver's files have one small one each).
ROW_GROUP = 131_072


class Compactor:
    def __init__(self, app: TaskRunner, directory: str | None = None, target_mb: float = TARGET_MB):
        """Raises MissingExtra without pyarrow (the `history` extra)."""
        require_extra("history", "compacting the job history", "pyarrow")
        self.app, self.target = app, int(target_mb * 1024 * 1024)
        self.directory = directory or default_dir()
        self.fs, self.root = open_dir(self.directory)
        self.lock = app.keys.g + "history:compact:lock"
        self.token = secrets.token_hex(8)

    def run(self, days: list[str] | None = None, today: str | None = None) -> dict[str, int]:
        """Compact `days` (default: every day of the archive but today, UTC); returns the
        counts. TaskRunnerError when another compaction holds the lock."""
        if not self.app.redis.set(self.lock, self.token, nx=True, ex=LOCK_TTL):
            raise TaskRunnerError(f"another compaction of the job history runs (lock {self.lock}, "
                                  f"for at most {LOCK_TTL} s more)")
        try:
            today = today or datetime.now(timezone.utc).strftime("%Y-%m-%d")
            wanted = days if days is not None else [d for d in dates(self.fs, self.root) if d < today]
            stats = {"partitions": 0, "merged": 0, "written": 0}
            for day in wanted:
                for folder in queue_dirs(self.fs, self.root, day):
                    merged, written = self.partition(folder)
                    stats["partitions"] += 1
                    stats["merged"] += merged
                    stats["written"] += written
            return stats
        finally:
            if self.app.redis.get(self.lock) == self.token:
                self.app.redis.delete(self.lock)

    def partition(self, folder: str) -> tuple[int, int]:
        """Compact one (date, queue) partition: finish what a dead compaction left, then merge
        runs of files into files of about the target size. Returns (files merged, written)."""
        self._clean(folder)
        files = live_files(self.fs, folder)
        recorded = self.app.redis.get(self.app.keys.q(folder.rsplit("queue=", 1)[1]) + "history:batch")
        unfinished = f"{'_'.join(recorded.split())}.parquet" if recorded else None  # read after listing: see doc
        merged = written = 0
        for group in self._groups(files, unfinished):
            self._hold()
            first, last = group[0].base_name.split("_")[0], group[-1].base_name[:-len(".parquet")].split("_")[1]
            final = f"{folder}/{first}_{last}.parquet"
            tmp = f"{folder}/.compact-{first}_{last}.{self.token}.tmp"
            self._merge(group, tmp)
            self._commit(tmp, final)
            for f in group:
                self._drop(f.path)
            merged, written = merged + len(group), written + 1
        return merged, written

    def _groups(self, files: list[Any], unfinished: str | None) -> list[list[Any]]:
        """Runs of consecutive files of about the target size; a file of an unfinished batch
        ends a run and joins none (so no merged range spans it)."""
        groups: list[list[Any]] = [[]]
        size = 0
        for f in files:
            if f.base_name == unfinished:
                groups.append([])
                size = 0
                continue
            if size >= self.target:
                groups.append([])
                size = 0
            groups[-1].append(f)
            size += f.size
        return [g for g in groups if len(g) > 1]

    def _clean(self, folder: str) -> None:
        """What a dead compaction left: inputs of a merged file in place (ignored by
        readers since the rename), and temporary files never renamed. Safe: we hold the
        lock, so no other compaction writes here."""
        import pyarrow.fs as pafs

        entries = listing(self.fs, folder)  # one listing: a file written after it is not touched
        kept = {f.path for f in live(entries)}
        for i in entries:
            name = i.base_name
            if i.type != pafs.FileType.File:
                continue
            if name.startswith(".compact-") or (name.endswith(".parquet") and not name.startswith((".", "_"))
                                                and i.path not in kept):
                self._drop(i.path)

    def _merge(self, group: list[Any], tmp: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        with pq.ParquetWriter(tmp, schema(), filesystem=self.fs) as writer:
            pending: list[Any] = []
            for f in group:
                pending.append(pq.read_table(f.path, filesystem=self.fs, schema=schema()))
                if sum(t.num_rows for t in pending) >= ROW_GROUP:
                    writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP)
                    pending = []
            if pending:
                writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP)

    def _commit(self, tmp: str, final: str) -> None:
        self.fs.move(tmp, final)  # atomic (on S3: its copy): from here readers read it and not its inputs

    def _drop(self, path: str) -> None:
        self.fs.delete_file(path)

    def _hold(self) -> None:
        """Renew the lock, or stop if it was lost (expired: another compaction may run)."""
        if self.app.redis.get(self.lock) != self.token or not self.app.redis.expire(self.lock, LOCK_TTL):
            raise TaskRunnerError(f"compaction lost its lock {self.lock}; stopped (another may run)")


def daily(app: TaskRunner, today: str, directory: str | None = None) -> tuple[list[str], dict[str, int]] | None:
    """The dispatcher's daily run on `today` (UTC): compact the days from the last one done
    (again: a late batch may have landed in it) to yesterday, then record yesterday as done,
    so that every dispatcher skips it until tomorrow. Returns the days compacted (those of
    the archive in that span; yesterday is recorded even when it has none) and the counts.
    None: done already today, or another compaction holds the lock."""
    last = app.redis.get(app.keys.g + "history:compacted")
    if done(last, today):
        return None
    c = Compactor(app, directory)
    days = [d for d in dates(c.fs, c.root) if (last is None or d >= last) and d < today]
    try:
        stats = c.run(days, today)
    except TaskRunnerError as e:
        log.info("compaction skipped: %s", e)
        return None
    app.redis.set(app.keys.g + "history:compacted", yesterday(today))
    return days, stats


def done(last: str | None, today: str) -> bool:
    """Is `last`, the last day compacted (`g history:compacted`), yesterday or later?"""
    return last is not None and last >= yesterday(today)


def yesterday(today: str) -> str:
    return (datetime.strptime(today, "%Y-%m-%d") - timedelta(days=1)).strftime("%Y-%m-%d")
