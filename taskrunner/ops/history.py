"""The archiver: moves job history from each queue's Redis stream to Parquet files
partitioned by date, `<dir>/date=YYYY-MM-DD/queue=Q/<first>_<last>.parquet`.

Exactly once, whatever dies when. A batch is a range of stream ids. Before writing, its
range is recorded in Redis (`history:batch`); the files are named after the range, so
writing them again gives the same files; only after they are written are the entries
trimmed from the stream and the record cleared (one MULTI). An archiver killed at any
point leaves either an untouched stream or a recorded range, which the next run writes
again (same names, same content) before it goes on."""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from taskrunner.errors import require_extra
from taskrunner.protocol import scripts

if TYPE_CHECKING:
    from taskrunner.client.app import TaskRunner

log = logging.getLogger("taskrunner.history")
#: The most records a queue's history stream keeps: the dispatchers trim it to this many at
#: each pass (cap(); an entry holds one record or a finish call's many), archiving or not.
#: Each XADD caps it at twice as many entries (HISTORY_MAX in _lib.lua), for a queue no
#: dispatcher serves.
CAP = 500_000
#: Beyond this backlog the dispatcher warns: records past CAP are trimmed before being archived.
WARN_BACKLOG = CAP // 2
_DATE = re.compile(r"date=\d{4}-\d{2}-\d{2}")


def schema() -> Any:
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema([("id", pa.string()), ("task", pa.string()), ("queue", pa.string()), ("state", pa.string()),
                      ("attempt", pa.int64()), ("enqueued_at", ts), ("started_at", ts), ("finished_at", ts),
                      ("runtime", pa.float64()), ("wait", pa.float64()), ("worker", pa.string()),
                      ("host", pa.string()), ("pid", pa.int64()), ("error_type", pa.string()),
                      ("stream_id", pa.string())])


def default_dir() -> str:
    return os.environ.get("TASKRUNNER_HISTORY_DIR") or os.path.join("var", "history")


def open_dir(directory: str) -> tuple[Any, str]:
    """The pyarrow filesystem of an archive and the archive's path in it (a local directory
    made absolute, or any pyarrow filesystem URI: `s3://bucket/prefix`, whose server and
    credentials come from the AWS variables, AWS_ENDPOINT_URL for an S3-compatible one, or
    from the URI's options, e.g. `?endpoint_override=host:9000&scheme=http`)."""
    import pyarrow.fs as pafs

    if "://" in directory:
        fs, root = pafs.FileSystem.from_uri(directory)
        return fs, root.rstrip("/")
    return pafs.LocalFileSystem(), os.path.abspath(directory)


def listing(fs: Any, folder: str) -> list[Any]:
    """The entries of a folder (FileInfo); none when it does not exist."""
    import pyarrow.fs as pafs

    return fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))


def dates(fs: Any, root: str) -> list[str]:
    """The archive's date partitions (YYYY-MM-DD), in order: one listing of its root."""
    import pyarrow.fs as pafs

    return sorted(i.base_name[5:] for i in listing(fs, root)
                  if i.type == pafs.FileType.Directory and _DATE.fullmatch(i.base_name))


def queue_dirs(fs: Any, root: str, day: str) -> list[str]:
    """The (date, queue) partitions of one day, as paths."""
    import pyarrow.fs as pafs

    return sorted(i.path for i in listing(fs, f"{root}/date={day}")
                  if i.type == pafs.FileType.Directory and i.base_name.startswith("queue="))


def live_files(fs: Any, folder: str) -> list[Any]:
    """The Parquet files of one (date, queue) partition that hold its records, each once,
    in stream order (FileInfo: path, size). Not a write under way (`.` names). Not a file
    whose stream-id range lies within another's: that is an input of a compaction whose
    merged file is in place (taskrunner/ops/compact.py), deleted next. Decided from the
    names of one listing, so a reader never sees both an input and its merged file, nor
    neither, whatever the listing's order."""
    return live(listing(fs, folder))


def live(listing: list[Any]) -> list[Any]:
    """live_files of a folder's listing (FileInfo of each entry)."""
    import pyarrow.fs as pafs

    files = sorted((i for i in listing if i.type == pafs.FileType.File
                    and i.base_name.endswith(".parquet") and not i.base_name.startswith((".", "_"))),
                   key=lambda i: (_range(i.base_name)[0], tuple(-n for n in _range(i.base_name)[1])))
    kept, reach = [], (-1, -1)
    for i in files:  # ranges are disjoint or nested: one sweep finds the nested ones
        last = _range(i.base_name)[1]
        if last > reach:
            kept.append(i)
            reach = last
    return kept


def _range(name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The stream ids `<first>_<last>.parquet` spans, as numbers (for ordering)."""
    first, _, last = name[:-len(".parquet")].partition("_")
    return _id(first), _id(last)


def _id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def _next_id(stream_id: str) -> str:
    ms, seq = stream_id.split("-")
    return f"{ms}-{int(seq) + 1}"


#: The values a history entry written since 2026-11-26 packs in its field `v`, in order, one
#: space between them (docs/PROTOCOL.md, Keys: `p history`): the host last, as the only one
#: that may hold a space.
PACKED = ("state", "attempt", "enqueued_at", "started_at", "finished_at", "pid", "task", "worker", "host")


def _unpacked(id: str, v: str, error_type: str | None, queue: str) -> dict[str, str]:
    out = {"id": id, "queue": queue, **dict(zip(PACKED, v.split(" ", len(PACKED) - 1)))}
    if error_type:
        out["error_type"] = error_type
    return out


def records(f: dict[str, str], queue: str = "") -> list[dict[str, str]]:
    """The records a history stream entry holds, each its fields by name, whichever shape it
    was written in (docs/PROTOCOL.md, Keys: `p history`): one field each (`id, task, queue,
    state, attempt, …`, entries written before 2026-11-26); `id`, `v` (the values of PACKED)
    and `error_type` when there is one; or `jobs`, a finish call's records, three lines each
    (id, `v`, error type or an empty line). The last two have no `queue`: it is the
    stream's (`queue`)."""
    jobs = f.get("jobs")
    if jobs is not None:
        lines = jobs.split("\n")
        return [_unpacked(lines[k], lines[k + 1], lines[k + 2], queue) for k in range(0, len(lines) - 2, 3)]
    v = f.get("v")
    if v is None:
        return [f]
    return [_unpacked(f.get("id", ""), v, f.get("error_type"), queue)]


def count(f: dict[str, str]) -> int:
    """How many records a history stream entry holds (records() without reading them)."""
    jobs = f.get("jobs")
    return 1 if jobs is None else (jobs.count("\n") + 1) // 3


def read(entries: list[tuple[str, dict[str, str]]], queue: str = "") -> list[tuple[str, dict[str, str]]]:
    """The records of stream entries as XRANGE gives them, each with its own id: the
    entry's, or for an entry holding several, `<entry id>/<k>` (k = 1, 2, …): the archive's
    `stream_id`, one per row."""
    out = []
    for stream_id, f in entries:
        held = records(f, queue)
        if "jobs" in f:
            out += [(f"{stream_id}/{k}", rec) for k, rec in enumerate(held, 1)]
        else:
            out += [(stream_id, rec) for rec in held]
    return out


def _record(stream_id: str, f: dict[str, str]) -> dict[str, Any]:
    """A record of `queue`'s stream (records()) as a row. Runtime and wait are derived
    here, not stored in Redis (its CPU is every worker's bottleneck); entries written by
    earlier versions carry them."""
    def num(v: str | None, kind: type = float) -> Any:
        try:
            return kind(float(v)) if v else None
        except ValueError:
            return None

    def ts(v: float | None) -> datetime | None:
        return datetime.fromtimestamp(v, timezone.utc) if v is not None else None

    def since(end: float | None, start: float | None) -> float | None:
        return round(end - start, 6) if end is not None and start is not None else None

    enqueued, started, finished = num(f.get("enqueued_at")), num(f.get("started_at")), num(f.get("finished_at"))
    runtime = num(f["runtime"]) if "runtime" in f else since(finished, started)
    wait = num(f["wait"]) if "wait" in f else since(started, enqueued)
    return {"id": f.get("id", ""), "task": f.get("task", ""), "queue": f.get("queue", ""),
            "state": f.get("state", ""), "attempt": num(f.get("attempt"), int),
            "enqueued_at": ts(enqueued), "started_at": ts(started), "finished_at": ts(finished),
            "runtime": runtime, "wait": wait, "worker": f.get("worker", ""), "host": f.get("host", ""),
            "pid": num(f.get("pid"), int), "error_type": f.get("error_type") or None, "stream_id": stream_id}


def backlog(app: TaskRunner, queues: list[str] | None = None) -> dict[str, int]:
    """Records waiting in each queue's history stream (no pyarrow needed: known with
    archiving off too): XLEN + `history:extra`, the records of its entries beyond one each
    (an entry holds one record or a finish call's many), read without reading the stream."""
    queues = queues if queues is not None else app.queue_names()
    pipe = app.redis.pipeline(transaction=False)
    for q in queues:
        pipe.xlen(app.keys.q(q) + "history")
        pipe.get(app.keys.q(q) + "history:extra")
    got = pipe.execute()
    return {q: got[2 * i] + int(got[2 * i + 1] or 0) for i, q in enumerate(queues)}


def trim(app: TaskRunner, queue: str, entries: list[tuple[str, dict[str, str]]], forget: bool = False) -> int:
    """Remove `entries` (read from the head of `queue`'s stream, in order) and what they count
    in `history:extra` (trim.lua), for a caller holding `history:lock`, and with `forget` the
    recorded `history:batch` too; the entries removed."""
    extra = sum(count(f) - 1 for _, f in entries)
    return scripts.TRIM(app.redis, [app.keys.q(queue)], [_next_id(entries[-1][0]), extra, int(forget)])


@contextmanager
def _holding(app: TaskRunner, queue: str, token: str) -> Iterator[bool]:
    """`queue`'s `history:lock` for the block (True), or False where another holds it; let go
    at the end if still ours (it expires after 300 s, for a holder that died)."""
    r, lock = app.redis, app.keys.q(queue) + "history:lock"
    got = bool(r.set(lock, token, nx=True, ex=300))
    try:
        yield got
    finally:
        if got and r.get(lock) == token:
            r.delete(lock)


def _count_first(app: TaskRunner, queue: str) -> None:
    """While someone reads metrics, count the stream (tally.lua) before it is trimmed."""
    if app.redis.exists(app.keys.g + "metrics:on"):
        from taskrunner.ops.metrics import tally

        while tally(app, queue):
            pass


def cap(app: TaskRunner, held: dict[str, int], token: str) -> dict[str, int]:
    """Keep each queue's history stream within CAP records (the dispatchers, at each pass,
    archiving or not; `held`: backlog() of the queues): from a stream holding more, the
    oldest entries that make the excess are read, counted first (tally.lua) while someone
    reads metrics, and trimmed (trim.lua) 1000 entries at a time.
    Skipped for a queue whose `history:lock` an archiver holds. A `history:batch` recorded
    while the lock is free is a dead archiver's: trimmed whole (a part left would be written
    again as a range overlapping the file it may have written) and forgotten, in the call
    that passes its end. Returns the records trimmed per queue trimmed."""
    out = {}
    for q, n in held.items():
        if n <= CAP:
            continue
        r, p = app.redis, app.keys.q(q)
        with _holding(app, q, token) as mine:
            if not mine:
                continue
            _count_first(app, q)
            mark = r.get(p + "history:batch")
            through = _id(mark.split()[1]) if mark else None  # a dead archiver's range
            excess, start, done = n - CAP, "-", 0
            while piece := r.xrange(p + "history", start, "+", count=1000):
                taken = []
                for e in piece:
                    if excess <= 0 and (through is None or _id(e[0]) > through):
                        break
                    taken.append(e)
                    excess -= count(e[1])
                if not taken:
                    break
                forget = through is not None and _id(taken[-1][0]) >= through
                trim(app, q, taken, forget)
                done += sum(count(f) for _, f in taken)
                through = None if forget else through
                if len(taken) < len(piece):
                    break
                start = "(" + taken[-1][0]
            if done:
                out[q] = done
    return out


class Archiver:
    def __init__(self, app: TaskRunner, directory: str | None = None, batch: int = 10_000):
        """Raises MissingExtra without pyarrow (the `history` extra)."""
        require_extra("history", "archiving job history to Parquet", "pyarrow")
        self.app, self.batch = app, batch
        self.directory = directory or default_dir()
        self.fs, self.root = open_dir(self.directory)
        self.token = secrets.token_hex(8)

    def archive(self, queues: list[str] | None = None, progress: Callable[[int], Any] | None = None,
                max_batches: int | None = None) -> int:
        """Archive until the streams are empty (or max_batches per queue); returns records."""
        total = 0
        for q in queues if queues is not None else self.app.queue_names():
            for _ in range(max_batches or 10**9):
                n = self.archive_batch(q)
                total += n
                if progress and n:
                    progress(n)
                if not n:  # not `n < batch`: a resumed batch may be of another size
                    break
        return total

    def archive_batch(self, queue: str) -> int:
        """One batch of one queue; returns how many records it archived (0: none, or another
        archiver holds this queue's lock)."""
        r, p = self.app.redis, self.app.keys.q(queue)
        mark, stream = p + "history:batch", p + "history"
        with _holding(self.app, queue, self.token) as mine:
            if not mine:
                return 0
            recorded = r.get(mark)
            # A batch that an archiver began: write exactly it again. None left of it: that
            # archiver died after its trim, before forgetting the batch; go on with the next.
            entries = r.xrange(stream, *recorded.split()) if recorded else []
            if entries:
                first, last = recorded.split()
            else:
                entries = self._take(stream)
                if not entries:
                    return 0
                first, last = entries[0][0], entries[-1][0]
                r.set(mark, f"{first} {last}")
            self._write(queue, first, last, entries)
            _count_first(self.app, queue)
            # Trim (with what the entries count in history:extra: trim.lua), then forget the
            # batch, in this order and without MULTI (redis-py before 6.1 has no transactions
            # on a cluster): a death between the two is the case above.
            trim(self.app, queue, entries)
            r.delete(mark)
            return sum(count(f) for _, f in entries)

    def _take(self, stream: str) -> list:
        """The stream's oldest entries up to the first that makes `batch` records (an entry
        holds one record or a finish call's many), read up to 500 entries at a time."""
        entries: list = []
        held, start = 0, "-"
        while held < self.batch:
            piece = self.app.redis.xrange(stream, start, "+", count=min(500, self.batch - held))
            if not piece:
                break
            for e in piece:
                entries.append(e)
                held += count(e[1])
                if held >= self.batch:
                    break
            start = "(" + piece[-1][0]
        return entries

    def _write(self, queue: str, first: str, last: str, entries: list) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        by_date: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for stream_id, entry in read(entries, queue):
            rec = _record(stream_id, entry)
            day = (rec["finished_at"] or datetime.fromtimestamp(int(stream_id.split("-")[0]) / 1000, timezone.utc))
            by_date[day.strftime("%Y-%m-%d")].append(rec)
        for day, records in by_date.items():
            folder = f"{self.root}/date={day}/queue={queue}"
            self.fs.create_dir(folder, recursive=True)
            final = f"{folder}/{first}_{last}.parquet"
            tmp = f"{folder}/.{first}_{last}.{self.token}.tmp"
            pq.write_table(pa.Table.from_pylist(records, schema=schema()), tmp, filesystem=self.fs)
            # Whole file or none: a rename here; on S3 (no rename) a copy, which makes the object
            # whole or not at all, then the temporary's delete (ignored by readers: a `.` name).
            self.fs.move(tmp, final)
