"""The Lua scripts on their own: the claim protocol's corner cases, fencing, sweeping."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time

import pytest
import redis

from taskrunner.client.aio import AsyncClient
from taskrunner.ops.history import read, records
from taskrunner.ops.redis_server import RedisServer
from taskrunner.protocol import holders, scripts
from taskrunner.protocol.claims import STRIDE
from tests import apps
from tests.conftest import wait_for


def claim(app, queues=("default",), pids=(111,), worker="w1", ahead=""):
    head = json.dumps({"worker": worker, "host": "h", "ip": "1.2.3.4"})[:-1]
    slots = [v for pid in pids for v in (pid, ahead)]
    out = scripts.CLAIM(app.redis, [app.keys.q(q) for q in queues], [head, worker, "h", "1.2.3.4", 1, 300, *slots])
    return [out[i:i + 8] for i in range(0, len(out), STRIDE)]  # the first 8 values, as before headers


def finish(app, job_id, attempt, outcome, *values, queue="default", began=""):
    vals = (list(values) + ["", "", "", ""])[:4]
    return scripts.FINISH(app.redis, [app.keys.q(queue)], [3600, 600, 86400, job_id, attempt, outcome, began, *vals])[0]


def test_claim_records_holding_entry_and_deadline_bucket(app):
    job = apps.add.apply_async([1, 2], max_duration=30)
    [(qi, job_id, attempt, task, args, kwargs, md, policy)] = claim(app, pids=(4242,))
    assert (qi, job_id, attempt, task, args, kwargs, md, policy) == (
        1, job.id, 1, "tests.apps.add", "[1,2]", "{}", "30", "kill")
    p = app.keys.q("default")
    entry = json.loads(app.redis.hget(p + "running", job.id))
    assert entry["worker"] == "w1" and entry["ip"] == "1.2.3.4" and entry["pid"] == 4242
    assert entry["max_duration"] == 30 and entry["attempt"] == 1 and entry["started_at"] > 0
    assert app.redis.sismember(p + "processing", job.id) and not app.redis.sismember(p + "items", job.id)
    [bucket] = app.redis.zrange(p + "buckets", 0, -1)
    assert app.redis.smembers(p + "dl:" + bucket) == {job.id}
    assert abs(int(bucket) - (entry["started_at"] + 30)) <= 1
    assert claim(app) == []


def test_the_claim_reads_the_optional_fields_the_record_names_and_all_of_an_older_one(app):
    """A record's `opt` (written at enqueue) names the optional fields its claim reads; a plain
    job's is "", so the claim reads none of them (each absent field cost a whole-record scan).
    A record written before `opt` (an older producer, a rolling upgrade) has none: all are read."""
    p = app.keys.q("default")
    head = json.dumps({"worker": "w1", "host": "h", "ip": "1.2.3.4"})[:-1]

    def claim_one():
        out = scripts.CLAIM(app.redis, [p], [head, "w1", "h", "1.2.3.4", 1, 300, 111, ""])
        assert len(out) == STRIDE
        return out

    def lock(key):
        return app.redis.get(p + "unique:" + key)

    plain = apps.add.delay(1, 2)
    assert app.redis.hget(p + "job:" + plain.id, "opt") == "" and "opt" not in plain.refresh().to_dict()
    assert claim_one()[8:] == ["", ""]
    for old in (False, True):
        full = apps.soft_sleeper.apply_async(("k", True), headers={"trace": old}, unique_key=f"u{old}",
                                             unique_until="start")
        until_finish = apps.add.apply_async([1, 1], unique_key=f"f{old}")
        job = p + "job:" + full.id
        assert app.redis.hget(job, "opt") == "headers soft_limit unique_key"
        assert app.redis.hget(p + "job:" + until_finish.id, "opt") == ""  # its lock stays until it ends
        if old:
            app.redis.hdel(job, "opt")
            app.redis.hdel(p + "job:" + until_finish.id, "opt")
        row = claim_one()
        assert row[1] == full.id and row[8:] == [json.dumps({"trace": old}, separators=(",", ":")), "0.3"]
        assert lock(f"u{old}") is None
        assert claim_one()[1] == until_finish.id and lock(f"f{old}") == until_finish.id


def test_claim_is_fifo_and_takes_count(app):
    ids = [apps.add.delay(i, 0).id for i in range(5)]
    got = claim(app, pids=(1, 2, 3))
    assert [g[1] for g in got] == ids[:3]
    assert [json.loads(app.redis.hget(app.keys.q("default") + "running", i))["pid"] for i in ids[:3]] == [1, 2, 3]


def test_claim_drops_killed_and_duplicate_ids(app):
    a, b = apps.add.delay(1, 0), apps.add.delay(2, 0)
    p = app.keys.q("default")
    app.redis.srem(p + "items", a.id)  # as if it was killed between LPUSH and claim
    app.redis.lpush(p + "pending", b.id)  # a stale duplicate
    got = claim(app, pids=(1, 2, 3))
    assert [g[1] for g in got] == [b.id]
    assert app.redis.llen(p + "pending") == 0
    assert app.redis.smembers(p + "processing") == {b.id}


def test_an_unbatched_claim_drops_killed_and_held_ids_and_wakes_while_jobs_are_left(app):
    """A claim of one job checks its id with SREM items / SADD processing instead of the
    batch's SMISMEMBERs, and learns from its LRANGE whether jobs are left: the same end state."""
    p = app.keys.q("default")
    killed, held = apps.add.delay(1, 0), apps.add.delay(2, 0)
    assert [g[1] for g in claim(app)] == [killed.id]  # first in line: the one to kill below
    app.redis.delete(p + "wake")
    entry = app.redis.hget(p + "running", killed.id)
    # `killed` again in pending without being in items (killed meanwhile), then `held`'s
    # copy that another delivery holds, in items and processing both.
    assert [g[1] for g in claim(app)] == [held.id]
    app.redis.rpush(p + "pending", held.id, killed.id)  # killed.id is next in line
    app.redis.sadd(p + "items", held.id)
    assert claim(app) == []  # killed.id (not in items) dropped, then held.id (another delivery's)
    assert app.redis.llen(p + "pending") == 0 and app.redis.sismember(p + "items", held.id)
    assert app.redis.smembers(p + "processing") == {killed.id, held.id}
    assert app.redis.hget(p + "running", killed.id) == entry
    assert not app.redis.exists(p + "wake")  # nothing left to claim
    fresh = [apps.add.delay(i, 0).id for i in range(2)]
    assert [g[1] for g in claim(app)] == fresh[:1] and app.redis.llen(p + "wake") == 1  # one is left
    app.redis.delete(p + "wake")
    assert [g[1] for g in claim(app)] == fresh[1:] and not app.redis.exists(p + "wake")


def test_a_claim_that_finds_no_job_left_removes_the_stale_wake_token(app):
    """A wake token left while no worker listened (an enqueue's, or a claim's for the jobs
    it left) is stale once a claim finds no job left in the queue: it woke the next idle
    worker, or the claimer itself once it went idle, for one more claim that found nothing
    (the end of every drain: two claims for nothing instead of one). A job that comes later
    leaves its own token."""
    p = app.keys.q("default")
    [apps.add.delay(i, 0) for i in range(4)]
    assert app.redis.llen(p + "wake") == 1  # the enqueues'
    assert len(claim(app)) == 1 and app.redis.llen(p + "wake") == 1  # jobs are left: it stays
    assert len(claim(app, pids=(1, 2))) == 2 and app.redis.llen(p + "wake") == 1  # one is left
    assert len(claim(app, pids=(1, 2))) == 1 and not app.redis.exists(p + "wake")  # found none left
    apps.add.delay(9, 0)
    app.redis.delete(p + "wake")  # as if an idle worker had taken it
    app.redis.lpush(p + "wake", 1)  # and given it back (it woke while woken already)
    assert len(claim(app)) == 1 and app.redis.llen(p + "wake") == 1  # the last job: none looked for beyond it
    assert claim(app) == [] and not app.redis.exists(p + "wake")  # the claim that finds nothing removes it
    apps.add.delay(5, 0)
    assert app.redis.llen(p + "wake") == 1  # a new job, a new token


def test_claim_fails_corrupt_records(app):
    p = app.keys.q("default")
    app.redis.sadd(p + "items", "ghost")
    app.redis.lpush(p + "pending", "ghost")
    assert claim(app) == []
    d = app.job("ghost", queue="default").to_dict()
    assert d["state"] == "failed" and d["error_type"] == "CorruptJob"


def test_claim_priority_and_baton_wake(app):
    low = [apps.add.delay(i, 0).id for i in range(3)]
    high = apps.high.delay("x").id
    app.redis.delete(app.keys.q("default") + "wake", app.keys.q("high") + "wake")
    got = claim(app, queues=("high", "default"), pids=(1, 2))
    assert [(g[0], g[1]) for g in got] == [(1, high), (2, low[0])]
    # jobs remain: the claimer leaves a wake token for the next idle worker
    assert app.redis.llen(app.keys.q("default") + "wake") == 1


def test_prefetched_jobs_queue_behind_each_other_in_one_process(app):
    """Jobs claimed for the same PID run one after the other: each deadline allows for the
    max durations ahead of it (its latest start), and its entry says how much is ahead."""
    ids = [apps.add.apply_async([i, 0], max_duration=30).id for i in range(3)]
    other = apps.add.apply_async([9, 9], max_duration=30).id
    got = claim(app, pids=(7, 7, 7, 8), ahead="5")
    assert [g[1] for g in got] == [*ids, other]
    p = app.keys.q("default")
    entries = [json.loads(app.redis.hget(p + "running", i)) for i in [*ids, other]]
    assert [e.get("ahead", 0) for e in entries] == [5, 35, 65, 5]
    # One deadline bucket for a process's chain, the first job's (bucket width 1 s): due
    # early for the others, and the dispatcher's check moves them on, unflagged.
    buckets = [int(app.job(i).data["bucket"]) for i in [*ids, other]]
    assert buckets == [math.floor(entries[0]["started_at"] + 35)] * 4
    for i in [*ids, other]:
        assert app.redis.sismember(p + "dl:" + app.job(i).data["bucket"], i)
    third = ids[2]
    assert scripts.STUCK(app.redis, [p], [third, "1", 0, 1, "check"]) == []
    assert app.job(third).data["bucket"] == str(math.floor(entries[2]["started_at"] + 95))
    assert app.redis.sismember(p + "dl:" + app.job(third).data["bucket"], third)
    assert app.job(third).data.get("stuck") is None  # a first delivery has none until it is flagged
    # The worker running it knows when it began: its word flags it at once.
    assert scripts.STUCK(app.redis, [p], [third, "1", 0, 1]) == ["w1", "kill", 1]
    assert app.job(third).data["stuck"] == "1"
    # Put back in line, its next delivery is not stuck (yet).
    assert app.job(third).requeue()
    assert [g[1:3] for g in claim(app)] == [[third, 2]] and app.job(third).data["stuck"] == "0"


def test_finish_records_when_the_job_began_and_batches_many(app):
    a, b = apps.add.delay(1, 2), apps.add.delay(3, 4)
    claim(app, pids=(1, 1), ahead="0")
    claimed_at = float(app.job(b.id).data["started_at"])
    values = [a.id, "1", "completed", "0.5", "3", "", "", "", b.id, "1", "completed", "", "7", "", "", "",
              b.id, "1", "completed", "", "7", "", "", ""]
    assert scripts.FINISH(app.redis, [app.keys.q("default")], [3600, 600, 86400, *values]) == [1, 1, 2]
    da, db = app.job(a.id).to_dict(), app.job(b.id).to_dict()
    assert (da["state"], da["result"], db["state"], db["result"]) == ("completed", 3, "completed", 7)
    assert abs(da["finished_at"] - da["started_at"] - 0.5) < 0.01  # began 0.5 s before the finish
    assert db["started_at"] == claimed_at  # unknown: the claim's time stays
    p = app.keys.q("default")
    assert app.redis.hlen(p + "running") == 0 and app.redis.scard(p + "processing") == 0
    # One history entry for the call, holding a's and b's records (b's second delivery: nothing).
    assert app.redis.zcard(p + "completed") == 2 and app.redis.xlen(p + "history") == 1
    held = {f["id"]: f for _, f in read(app.redis.xrange(p + "history"))}
    assert held[a.id]["state"] == held[b.id]["state"] == "completed" and len(held) == 2
    ra = held[a.id]
    assert abs(float(ra["finished_at"]) - float(ra["started_at"]) - 0.5) < 0.01  # the archiver's runtime


def test_return_hands_a_job_back_that_never_began(app):
    job = apps.add.delay(1, 2)
    [(_, job_id, attempt, *_)] = claim(app)
    p = app.keys.q("default")
    before = app.redis.xlen(p + "history")
    assert finish(app, job.id, str(attempt), "return", "job X ahead of it ran long") == 1
    d = app.job(job.id).to_dict()
    assert d["state"] == "pending" and app.redis.lindex(p + "pending", -1) == job.id  # next in line
    assert app.redis.xlen(p + "history") == before  # it never ran: no history record
    assert any("returned before it began: job X ahead of it ran long" in e["event"] for e in d["timeline"])
    assert "requeues" not in app.job(job.id).data and "lost" not in app.job(job.id).data
    [(_, _, again, *_)] = claim(app)
    assert again == attempt + 1  # a new delivery: the old one is fenced off
    assert finish(app, job.id, str(attempt), "completed", "3") == 0


def test_the_finish_of_an_exclusive_queues_job_wakes_the_next_and_a_plain_one_reads_no_meta(app):
    """finish.lua knows an exclusive queue from the record (claim.lua marks its deliveries
    `exclusive`): its next job gets a wake token; a plain queue's finish reads no meta."""
    from taskrunner.ops import queue

    queue.create(app, "solo", exclusive=True)
    first, _ = apps.add.apply_async([1, 1], queue="solo"), apps.add.apply_async([2, 2], queue="solo")
    p = app.keys.q("solo")
    [row] = claim(app, queues=("solo",))
    assert row[1] == first.id and app.redis.hget(p + "job:" + first.id, "exclusive") == "1"
    app.redis.delete(p + "wake")
    assert claim(app, queues=("solo",)) == []  # one of its jobs runs: the next waits
    assert finish(app, first.id, "1", "completed", "2", queue="solo") == 1
    assert app.redis.llen(p + "wake") == 1
    plain = apps.add.delay(1, 1)
    [row] = claim(app)
    assert app.redis.hget(app.keys.q("default") + "job:" + plain.id, "exclusive") is None
    app.redis.config_resetstat()
    assert finish(app, plain.id, "1", "completed", "2") == 1
    assert "cmdstat_hmget" in app.redis.info("commandstats")
    assert app.redis.info("commandstats")["cmdstat_hmget"]["calls"] == 1  # the record's; no meta


def test_finish_is_fenced(app):
    job = apps.add.delay(1, 2)
    claim(app)
    assert finish(app, job.id, "1", "completed", "3") == 1
    assert app.job(job.id).to_dict()["result"] == 3
    assert finish(app, job.id, "1", "completed", "99") == 2  # a retried call: nothing to do
    assert app.job(job.id).to_dict()["result"] == 3


def test_finish_from_a_lost_delivery_cannot_overwrite_the_new_owner(app):
    job = apps.add.delay(1, 2)
    claim(app, worker="old")
    lost = scripts.LOSE(app.redis, [app.keys.q("default")], [3600, job.id, "1", "worker old is dead", "", "1"])
    assert lost == ["pending"]
    claim(app, worker="new")
    assert finish(app, job.id, "1", "completed", '"stale"') == 0
    assert app.job(job.id).data["state"] == "running"
    assert finish(app, job.id, "2", "completed", '"fresh"') == 1
    d = app.job(job.id).to_dict()
    assert (d["result"], d["worker"], d["attempts"], d["requeues"]) == ("fresh", "new", 2, 1)


def test_lose_respects_owner_and_kill_and_poison(app):
    job = apps.crash.delay("x")  # max_lost=2
    p = app.keys.q("default")
    claim(app, worker="a")
    assert scripts.LOSE(app.redis, [p], [3600, job.id, "1", "r", "b", "1"]) == [""]  # not b's
    assert scripts.LOSE(app.redis, [p], [3600, job.id, "1", "r", "a", "1"]) == ["pending"]
    claim(app, worker="a")
    assert scripts.LOSE(app.redis, [p], [3600, job.id, "2", "r", "", "1"]) == ["failed"]
    assert app.job(job.id).data["error_type"] == "WorkerLost"
    other = apps.add.delay(1, 1)
    claim(app)
    assert other.kill() == "running"
    assert scripts.LOSE(app.redis, [p], [3600, other.id, "1", "r", "", "1"]) == ["killed"]


def test_lose_counts_only_deliveries_that_may_have_begun(app):
    """A delivery lost with began "0" goes back to the front like a lost one (requeued, its
    timeline says it had not begun), without counting towards max_lost; a bad `began` or a
    value missing is refused before any job is touched."""
    job = apps.crash.delay("nb")  # max_lost=2
    p = app.keys.q("default")
    for attempt in ("1", "2", "3"):  # three deaths of its process, none while it ran
        claim(app, worker="a")
        assert scripts.LOSE(app.redis, [p], [3600, job.id, attempt, "worker a is dead", "a", "0"]) == ["pending"]
    d = app.job(job.id).to_dict()
    assert (d["state"], d.get("lost", 0), d["requeues"], d["attempts"]) == ("pending", 0, 3, 3)
    assert "delivery 3 requeued, it had not begun: worker a is dead" in [e["event"] for e in d["timeline"]]
    assert app.redis.lindex(p + "pending", -1) == job.id  # next in line
    claim(app, worker="a")
    for bad, why in [([3600, job.id, "4", "r", "a"], "5 values per job"),
                     ([3600, job.id, "4", "r", "a", "yes"], r'began \(ARGV\[6\]\) must be "1"'),
                     (["x", job.id, "4", "r", "a", "1"], "failed TTL")]:
        with pytest.raises(redis.ResponseError, match=why):
            scripts.LOSE(app.redis, [p], bad)
    assert app.job(job.id).data["state"] == "running"
    assert scripts.LOSE(app.redis, [p], [3600, job.id, "4", "r", "a", "1"]) == ["pending"]  # counted: 1 of 2
    assert app.job(job.id).to_dict()["lost"] == 1


def test_the_dispatcher_logs_a_delivery_that_had_not_begun_as_not_lost(app, caplog):
    """holders.lose() says which deliveries were requeued as not begun, and the dispatcher's
    log line says so instead of "lost its process" (it was not counted towards max_lost)."""
    from taskrunner.ops.dispatcher import Dispatcher

    ran, waited = apps.add.delay(1, 1), apps.add.delay(2, 2)
    claim(app, pids=(5, 5), worker="a")
    acted = holders.lose(app, "default", [ran.id, "1", "worker a is dead", "a", "1",
                                          waited.id, "1", "worker a is dead", "a", "0"])
    assert [(x.id, x.state, x.began) for x in acted] == [(ran.id, "pending", True), (waited.id, "pending", False)]
    with caplog.at_level(logging.WARNING, logger="taskrunner.dispatcher"):
        Dispatcher(app)._tally(acted, {"requeued": 0})
    said = {r.getMessage().split()[2]: r.getMessage() for r in caplog.records}
    assert said[ran.id].endswith("lost its process -> pending")
    assert said[waited.id].endswith("waited for a process that died (had not begun: not lost) -> pending")


def test_a_dead_serial_process_counts_only_its_first_in_line(app):
    """lose_held() on a dead worker's deliveries: of those claimed for one process of a serial
    worker (a chain, each sent ahead behind the one before), the first in line counts; each
    process's own first does; a holder not known to be serial (its heartbeat does not say:
    a loop child runs many at once) has every delivery counted, as before."""
    p = app.keys.q("default")
    jobs = [apps.add.delay(i, i) for i in range(7)]
    claim(app, pids=(501, 501, 501), worker="s", ahead="0.000")  # one child's chain of 3
    claim(app, pids=(502,), worker="s", ahead="0.000")  # another child's, alone
    claim(app, pids=(601, 601, 601), worker="loop", ahead="0.000")  # a loop child's 3 (same entries)
    app.redis.set(app.keys.worker("s"), json.dumps({"name": "s", "serial": True}))
    app.redis.set(app.keys.worker("loop"), json.dumps({"name": "loop", "serial": False}))
    entries = {i: json.loads(app.redis.hget(p + "running", j.id)) for i, j in enumerate(jobs)}
    assert [entries[i].get("ahead", 0) for i in range(7)] == [0, 300, 600, 0, 0, 300, 600]
    acted = holders.lose_held(app, ["default"], lambda e: True, "worker {} is dead")
    assert sorted(x.id for x in acted) == sorted(j.id for j in jobs)
    lost = [app.job(j.id).to_dict().get("lost", 0) for j in jobs]
    assert lost == [1, 0, 0, 1, 1, 1, 1]
    assert all(app.job(j.id).data["state"] == "pending" for j in jobs)


@pytest.mark.parametrize("pill_md", [300, 5], ids=["same max duration", "shorter pill"])
def test_a_job_claimed_later_does_not_take_the_running_ones_place(app, pill_md):
    """(Review.) A chain of 3 claimed for one child, the first two ended at once, the third
    (a pill) running; the worker's next claim for that child says `ahead` = what is left of the
    pill's max duration, so the job it claims has an earlier latest start (started_at + ahead)
    than the pill: ordered by that, the pill went uncounted and the later job counted. Claim
    order (started_at, then ahead) is the order the child runs them in."""
    a, b = apps.add.delay(1, 1), apps.add.delay(2, 2)
    pill, later = apps.add.apply_async([3, 3], max_duration=pill_md), apps.add.delay(4, 4)
    claim(app, pids=(501, 501, 501), worker="s", ahead="0.000")
    assert finish(app, a.id, "1", "completed", "2") == finish(app, b.id, "1", "completed", "4") == 1
    claim(app, pids=(501,), worker="s", ahead=f"{pill_md - 0.01:.3f}")  # policy.slots: the pill's max duration left
    app.redis.set(app.keys.worker("s"), json.dumps({"name": "s", "serial": True}))
    holders.lose_held(app, ["default"], lambda e: True, "worker {} is dead")
    assert [app.job(j.id).to_dict().get("lost", 0) for j in (pill, later)] == [1, 0]


def test_the_dispatchers_sweep_counts_only_the_first_in_line_of_a_dead_process(app):
    """The sweep's due deliveries of a holder that is not alive: the first in line of each
    process counts; the corrupt entry beside them is requeued and counted, as before."""
    from taskrunner.ops.dispatcher import Dispatcher

    p = app.keys.q("default")
    chain = [apps.add.apply_async([i, i], max_duration=0.01) for i in range(3)]
    claim(app, pids=(801, 801, 801), worker="s", ahead="0.000")
    app.redis.set(app.keys.worker("s"), json.dumps({"name": "s", "serial": True}))  # listed nowhere: not alive
    corrupt = apps.add.apply_async([9, 9], max_duration=0.01)
    claim(app, pids=(802,), worker="s", ahead="")
    app.redis.hset(p + "running", corrupt.id, "not json")
    wait_for(lambda: Dispatcher(app).run_once()["requeued"], what="the due bucket swept")
    assert [app.job(j.id).to_dict().get("lost", 0) for j in [*chain, corrupt]] == [1, 0, 0, 1]
    assert [app.job(j.id).data["state"] for j in [*chain, corrupt]] == ["pending"] * 4


def test_deliveries_tied_first_in_line_all_count(app):
    """Equal starts (nothing to order them by) or a missing start (the order is unknown):
    every delivery of that process counts."""
    p = app.keys.q("default")

    def edit(job_id, field):  # a holding entry some other client wrote
        entry = json.loads(app.redis.hget(p + "running", job_id))
        del entry[field]
        app.redis.hset(p + "running", job_id, json.dumps(entry))

    tied = [apps.add.delay(i, i) for i in range(2)]
    claim(app, pids=(701, 701), worker="s", ahead="0.000")
    edit(tied[1].id, "ahead")
    odd = [apps.add.delay(i, i) for i in range(2)]
    claim(app, pids=(702, 702), worker="s", ahead="0.000")
    edit(odd[0].id, "started_at")
    held = holders.holdings(app, ["default"])
    began = holders.may_have_begun(held, held, lambda h: True)
    assert all(began) and len(began) == 4


def test_sweep_promotes_due_and_reports_due_deadlines(app):
    p = app.keys.q("default")
    later = apps.add.apply_async([1, 1], delay=100)
    now = apps.add.apply_async([2, 2], delay=0.001)
    import time

    time.sleep(0.01)  # let the 1 ms delay pass (Redis clock)
    out = scripts.SWEEP(app.redis, [p], [100, 10, 3600, 3600])
    assert out[0] == 1 and app.job(now.id).data["state"] == "pending"
    assert app.job(later.id).data["state"] == "delayed"
    job = apps.add.apply_async([3, 3], max_duration=0.001)
    claim(app)  # claims `now` first (FIFO)
    claim(app)
    time.sleep(1.1)  # bucket width is 1 s: its bucket is due once it has fully passed
    out = scripts.SWEEP(app.redis, [p], [100, 10, 3600, 3600])
    due = dict(zip(out[1::2], out[2::2]))
    assert job.id in due and now.id not in due
    res = scripts.STUCK(app.redis, [p], [job.id, "1", time.time() + 60, 1, "check"])
    assert res == ["w1", "kill", 1]
    assert app.job(job.id).data["stuck"] == "1"
    assert scripts.SWEEP(app.redis, [p], [100, 10, 3600, 3600])[1:] == []  # moved to a later bucket


def test_a_sweep_told_not_to_trim_leaves_the_finished_sets_to_a_later_one(app):
    """sweep.lua's ARGV[5] "0" (the dispatcher's passes between its tidy ones) promotes and
    reads deadlines but trims nothing; without it (an older dispatcher) or with "1", it trims."""
    p = app.keys.q("default")
    app.redis.zadd(p + "completed", {"old": 1.0})
    app.redis.zadd(p + "failed", {"old": 1.0})
    due = apps.add.apply_async([1, 1], delay=0.001)
    wait_for(lambda: scripts.SWEEP(app.redis, [p], [100, 10, 3600, 3600, "0"])[0] == 1, what="the promotion")
    assert app.job(due.id).data["state"] == "pending"
    assert app.redis.zscore(p + "completed", "old") == 1.0 and app.redis.zscore(p + "failed", "old") == 1.0
    scripts.SWEEP(app.redis, [p], [100, 10, 3600, 3600, "1"])
    assert app.redis.zscore(p + "completed", "old") is None and app.redis.zscore(p + "failed", "old") is None
    app.redis.zadd(p + "completed", {"old": 1.0})
    scripts.SWEEP(app.redis, [p], [100, 10, 3600, 3600])
    assert app.redis.zscore(p + "completed", "old") is None


@pytest.mark.parametrize("args, why", [
    (["x", 10, 3600, 3600], "most delayed jobs to promote (ARGV[1])"),
    ([100, "x", 3600, 3600], "most deadline buckets to read (ARGV[2])"),
    ([100, 0, 3600, 3600], "most deadline buckets to read (ARGV[2])"),
    ([100, 1.5, 3600, 3600], "most deadline buckets to read (ARGV[2])"),
])
def test_a_sweep_refuses_bad_counts_before_it_promotes_anything(app, args, why):
    """A count that is not a whole number >= 1 is refused in one line and changes nothing: a
    bad ARGV[2] used to fail with Lua's error after the due delayed jobs were promoted."""
    p = app.keys.q("default")
    due = apps.add.apply_async([1, 1], delay=0.001)
    wait_for(lambda: app.redis.zrangebyscore(p + "delayed", "-inf", "{}.{:06d}".format(*app.redis.time())),
             what="the delay to pass")
    with pytest.raises(redis.ResponseError, match=re.escape(f"sweep: the {why} must be an integer >= 1")):
        scripts.SWEEP(app.redis, [p], args)
    assert app.job(due.id).data["state"] == "delayed" and app.redis.zscore(p + "delayed", due.id) is not None


@pytest.mark.parametrize("ttl", [None, "x", "0", "1.5"])
def test_a_kill_refuses_a_bad_failed_ttl_before_it_kills(app, ttl):
    """kill.lua's failed TTL is checked first: without one (or with one that is not a whole
    number >= 1) it used to end the job killed and listed, then fail at its EXPIRE, leaving the
    record for ever, its waiters unwoken and its children waiting."""
    p = app.keys.q("default")
    job = apps.add.delay(1, 1)
    with pytest.raises(redis.ResponseError, match=re.escape("kill: the failed TTL (ARGV[3]) must be an integer >= 1")):
        scripts.KILL(app.redis, [p], [job.id, "me"] + ([] if ttl is None else [ttl]))
    assert app.job(job.id).data["state"] == "pending" and app.redis.zscore(p + "killed", job.id) is None
    assert scripts.KILL(app.redis, [p], [job.id, "me", 60]) == ["killed"]
    assert 0 < app.redis.ttl(p + "job:" + job.id) <= 60


@pytest.mark.parametrize("script, args, why", [
    ("DELETE", ["{id}", "0"], "delete: the failed TTL (ARGV[2]) must be an integer >= 1"),
    ("DELETE", ["{id}", "x", "pending"], "delete: the failed TTL (ARGV[2]) must be an integer >= 1"),
    ("PURGE", [10, "0"], "purge: the failed TTL (ARGV[2]) must be an integer >= 1"),
    ("PURGE", ["x"], "purge: the most jobs to delete (ARGV[1]) must be an integer >= 1"),
])
def test_delete_and_purge_refuse_a_bad_ttl_or_count_before_changing_anything(app, script, args, why):
    """Their optional failed TTL is for the steps they cancel: 0 (or -1) used to delete the
    canceled records at once (EXPIRE), and text to fall back to a week, unsaid; purge's count
    failed with Lua's error. Refused now in one line, nothing changed."""
    parent = apps.add.delay(1, 1)
    child = apps.add.apply_async((2, 2), depends_on=[parent])
    argv = [a.format(id=parent.id) if isinstance(a, str) else a for a in args]
    with pytest.raises(ValueError, match=re.escape(why)):  # ERR taskrunner: BadCall: ..., as taskrunner raises it
        getattr(scripts, script)(app.redis, [app.keys.q("default")], argv)
    assert (parent.refresh().state, child.refresh().state) == ("pending", "waiting")


#: redis-server options that take FCALL and FUNCTION away: they answer "unknown command", as
#: on Redis < 7.0.
NO_FUNCTIONS = ("--rename-command", "FCALL", "", "--rename-command", "FUNCTION", "")


def library_loaded(r) -> bool:
    """Does the server hold this version's library?"""
    return bool(r.function_list(library=scripts.LIBRARY_NAME))


def test_scripts_are_functions_reloaded_after_function_flush(app):
    """Every script is a function of one library, loaded once per server; a server that lost
    it (FUNCTION FLUSH here; a restart without persistence) gets it again at the next call,
    lone or in a batch, which then runs as if nothing had happened."""
    apps.add.delay(1, 1)
    assert library_loaded(app.redis)
    [lib] = app.redis.function_list(library=scripts.LIBRARY_NAME)  # RESP2: flat lists of names and values
    functions = dict(zip(lib[::2], lib[1::2]))["functions"]
    assert {dict(zip(f[::2], f[1::2]))["name"] for f in functions} == {s.function for s in scripts.ALL}
    app.redis.function_flush()
    job = apps.add.delay(2, 2)  # a lone call: "Function not found", loaded, called again
    assert library_loaded(app.redis) and job.state == "pending"
    app.redis.function_flush()
    batch = scripts.Batch(app.redis)
    batch.call(scripts.WATCH, [app.keys.q("default")], [job.id])
    batch.call(scripts.WATCH, [app.keys.q("default")], [job.id])
    assert batch.execute() == [scripts.WATCH(app.redis, [app.keys.q("default")], [job.id])] * 2
    assert library_loaded(app.redis)


@pytest.mark.parametrize("flush", ["none", "FUNCTION FLUSH", "no functions"])
def test_the_async_client_loads_the_library_or_falls_back_too(app, tmp_path, flush):
    """AsyncClient calls the scripts as the sync client does: after a FUNCTION FLUSH it loads
    the library again; on a server without Functions (renamed away: unknown command, as
    Redis < 7.0 answers) it calls them by EVALSHA."""
    gone = flush == "no functions"
    server = RedisServer(tmp_path, appendonly=False,
                         extra=NO_FUNCTIONS if gone else ()).start()
    app.configure(redis_url=server.url)

    async def go() -> list[str]:
        client = AsyncClient(app)
        try:
            ids = [await client.enqueue("tests.apps.add", [1, 1])]
            if flush == "FUNCTION FLUSH":
                app.redis.function_flush()
            ids.append(await client.enqueue("tests.apps.add", [2, 2]))
            return ids
        finally:
            await client.close()

    try:
        ids = asyncio.run(go())
        assert [app.job(i).data["state"] for i in ids] == ["pending", "pending"]
        stats = app.redis.info("commandstats")
        if gone:
            assert stats["cmdstat_evalsha"]["calls"] == 2
        else:
            assert "cmdstat_evalsha" not in stats and app.redis.function_list(library=scripts.LIBRARY_NAME)
    finally:
        server.stop()


def test_each_scripts_header_names_every_key_and_argument_its_code_reads():
    """The comment that opens each script documents its keys, arguments and answer
    (docs/PROTOCOL.md points to it): every KEYS[n] and ARGV[n] its code names is there."""
    for path in sorted(scripts._DIR.glob("*.lua")):
        if path.name == "_lib.lua":
            continue
        lines = path.read_text().splitlines()
        n = next(i for i, line in enumerate(lines) if not line.startswith("--"))
        header, code = "\n".join(lines[:n]), "\n".join(line.split("--")[0] for line in lines[n:])
        named = {f"{a}[{i}]" for a, i in re.findall(r"(ARGV|KEYS)\[(\d+)\]", code)}
        assert [k for k in sorted(named) if k not in header] == [] and "Returns" in header, path.name


def test_the_library_is_named_by_its_text():
    """Workers of two versions on one Redis never call each other's code: a change to any
    script (or to `_lib.lua`) gives the library, and each of its functions, another name."""
    changed = [scripts.Script.__new__(scripts.Script) for _ in scripts.ALL]
    for new, old in zip(changed, scripts.ALL):
        new.name, new.frees, new.body = old.name, old.frees, old.body + ("\n-- changed" if old is scripts.WATCH else "")
    text = scripts.library(changed)
    assert text != scripts.LIBRARY and text.split("\n")[0] != scripts.LIBRARY.split("\n")[0]
    assert not {s.function for s in changed} & {s.function for s in scripts.ALL}
    assert scripts.library(scripts.ALL) == scripts.LIBRARY  # the same text: the same name


def test_two_versions_of_the_library_live_side_by_side(app):
    """Another version's library on the same server (a rolling deploy) is left alone, and each
    version calls its own functions. Loading one's own again (FUNCTION LOAD REPLACE, two
    processes that found it missing at once) is harmless."""
    other = scripts.LIBRARY.replace(scripts.LIBRARY_NAME, "taskrunner_0000000000000000")  # its functions too
    app.redis.execute_command("FUNCTION", "LOAD", "REPLACE", other)
    try:
        apps.add.delay(1, 1)
        app.redis.execute_command("FUNCTION", "LOAD", "REPLACE", scripts.LIBRARY)
        job = apps.add.delay(2, 2)
        assert job.state == "pending" and library_loaded(app.redis)
        assert app.redis.function_list(library="taskrunner_0000000000000000")
    finally:
        app.redis.function_delete("taskrunner_0000000000000000")


def test_function_calls_share_no_state(app):
    """A function's helpers (the library's) live from one call to the next: what one call
    keeps (the outbox entries a finish emitted for children in other slots, fmt()'s last
    answer) must not reach the next. A plain job's finish after a parent's answers no entry."""
    p = app.keys.q("default")
    r = app.redis
    parent, plain = apps.add.delay(1, 1), apps.add.delay(2, 2)
    for job in (parent, plain):  # claimed by hand: attempt 1 holds each
        r.hset(p + "running", job.id, "{}")
        r.hset(app.keys.job("default", job.id), mapping={"attempts": "1", "state": "running"})
    r.hset(app.keys.job("default", parent.id), mapping={"children": "other c1", "cross_children": "other c1 -"})
    [one, entries] = scripts.FINISH(r, [p], [3600, 600, 3600, parent.id, "1", "completed", "", "3", "", "", ""])
    assert one == 1 and [dict(zip(e[1][::2], e[1][1::2]))["child"] for e in entries] == ["other c1"]
    assert scripts.FINISH(r, [p], [3600, 600, 3600, plain.id, "1", "completed", "", "5", "", "", ""]) == [1]


def test_every_state_the_helpers_keep_is_cleared_by_fresh_call():
    """The helpers' state across calls, read from `_lib.lua`: every name declared at its top
    level that a function assigns (its state, kept between calls of a Redis Function) is
    either cleared by fresh_call() or made once and the same for every call (the workflow
    helpers made by workflows(); rare_fields, a metatable of no call's data). A helper added
    with state of its own fails here until fresh_call() clears it."""
    lib = (scripts._DIR / "_lib.lua").read_text()
    declared = {n for names, _ in scripts._definitions(lib) for n in names}

    def assigned_in(text: str, indent: str) -> set[str]:  # `n = `, `a, n = `, `function n(`
        return {n for n in declared if re.search(rf"^{indent}(?!local\b)(?:[\w.]+\s*,\s*)*{n}\b\s*(?:,\s*[\w.]+\s*)*"
                                                 rf"=(?!=)|^{indent}function\s+{n}\b", text, re.M)}

    assigned = assigned_in(lib, "[ \t]+")  # inside a function of the lib (indented)
    fresh = re.search(r"local function fresh_call\(\)\n(.*?)\nend", lib, re.S)[1]
    made_once = {"rare_fields", "workflows", "sibling", "queue_of", "prepend", "emit", "blame", "CHILD",
                 "far_parent", "join", "settle", "settle_children"}
    assert {"fmt_x", "fmt_s", "emitted"} <= assigned
    assert assigned - made_once <= scripts._names(fresh), assigned - made_once - scripts._names(fresh)
    for script in scripts.ALL:  # a script's body (a function's) assigning a helper's name keeps it too
        own = {n for n in declared if re.search(rf"^\s*local\s+(?:function\s+)?[\w\s,]*\b{n}\b", script.body, re.M)}
        assert not assigned_in(script.body, "[ \t]*") - own, script.name


@pytest.mark.parametrize("denied", ["-fcall -function", "-function", "no such commands"])
def test_a_server_or_user_without_functions_calls_the_scripts_by_evalsha(app, tmp_path, caplog, denied):
    """Redis < 7.0 has no FCALL or FUNCTION (here: both renamed away, which answers as it
    does: unknown command), and an ACL user may be refused FCALL or FUNCTION LOAD: the client
    says so in one log line and calls the same scripts by EVALSHA from then on (lone calls,
    batches, the lone enqueue's fast path). A user refused EVALSHA too gets the server's
    one-line NOPERM."""
    gone = denied == "no such commands"
    server = RedisServer(tmp_path, appendonly=False,
                         extra=NO_FUNCTIONS if gone else ()).start()
    admin = redis.Redis(unix_socket_path=str(server.socket), decode_responses=True)
    try:
        admin.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all",
                              *([] if gone else denied.split()))
        app.configure(redis_url=f"unix://limited:pw@{server.socket}")
        with caplog.at_level(logging.WARNING, "taskrunner.scripts"):
            jobs = [apps.add.delay(1, 1), apps.add.delay(2, 2)]
            rows = claim(app, pids=(1, 2))
            assert [finish(app, row[1], str(row[2]), "completed", "2") for row in rows] == [1, 1]
        assert {j.refresh().state for j in jobs} == {"completed"}
        assert caplog.messages and all("calling the scripts by EVALSHA" in m and "\n" not in m
                                       for m in caplog.messages)
        stats = admin.info("commandstats")
        fcall = stats.get("cmdstat_fcall", {})  # refused (rejected), or "Function not found" (failed): none ran
        assert stats["cmdstat_evalsha"]["calls"] >= 4 and fcall.get("calls", 0) == fcall.get("failed_calls", 0)
        if not gone:
            assert admin.function_list() == []
            admin.execute_command("ACL", "SETUSER", "limited", "-evalsha")
            with pytest.raises(redis.exceptions.NoPermissionError, match="evalsha"):
                claim(app)
    finally:
        admin.close()
        server.stop()


def test_a_command_refused_inside_a_function_is_not_a_refusal_of_functions(app, tmp_path, caplog):
    """A user who may call FCALL but not a command a script runs (here: XADD, the finish's
    history entry, after the job was released and its record written): the call fails with
    the server's own error, once, and the client keeps FCALL. From Redis 7.2 that refusal
    reads "ACL failure in script: User ... has no permissions to run the 'xadd' command
    script: ..., on @user_function", which read as Functions refused: the client switched
    to EVALSHA for good and ran the half-done finish again (it answered "not held"). A
    script's refusal quoting the caller's text read as one too (fails before)."""
    server = RedisServer(tmp_path, appendonly=False).start()
    admin = redis.Redis(unix_socket_path=str(server.socket), decode_responses=True)
    try:
        admin.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-xadd")
        app.configure(redis_url=f"unix://limited:pw@{server.socket}")
        job = apps.add.delay(1, 1)
        [row] = claim(app)
        with caplog.at_level(logging.WARNING, "taskrunner.scripts"):
            with pytest.raises(redis.exceptions.ResponseError, match="@user_function"):
                finish(app, row[1], str(row[2]), "completed", "2")
        assert not caplog.messages  # no switch to EVALSHA
        assert admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) == 0
        assert job.refresh().data.get("state") is not None
    finally:
        admin.close()
        server.stop()
    echo = redis.exceptions.ResponseError("taskrunner: InvalidName: task \"x this user has no permissions to run "
                                          "the 'fcall' command\"")
    assert not scripts.missing(echo)
    assert not scripts.missing(redis.exceptions.ResponseError(  # Redis 7.2's words for the case above
        "ACL failure in script: User limited has no permissions to run the 'xadd' command script: "
        "taskrunner_0123456789abcdef_finish, on @user_function:12."))
    assert scripts.missing(redis.exceptions.NoPermissionError("User u has no permissions to run the 'fcall' command"))
    assert scripts.missing(redis.exceptions.ResponseError("unknown command 'FUNCTION', with args beginning with: "))


def test_a_redis_over_maxmemory_can_be_emptied_with_taskrunners_own_commands(app, tmp_path):
    """Redis full (maxmemory, noeviction): enqueues are refused with its OOM error, but
    deleting a job, purging a queue and the dispatcher's sweep still run (their functions
    are flagged allow-oom), so an operator frees it with taskrunner. Functions without flags
    are refused whole over maxmemory: purge and delete were too (fails before)."""
    server = RedisServer(tmp_path, appendonly=False).start()
    admin = redis.Redis(unix_socket_path=str(server.socket), decode_responses=True)
    try:
        app.configure(redis_url=f"unix://{server.socket}")
        jobs = app.enqueue_many([{"task": "tests.apps.add", "args": [i, "x" * 2000]} for i in range(300)])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] - 100_000)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            apps.add.delay(1, 1)
        assert jobs[0].delete()
        assert scripts.SWEEP(app.redis, [app.keys.q("default")], [100, 100, 3600, 604800])[0] == 0
        assert app.purge("default") == 299
        admin.config_set("maxmemory", 0)
        assert apps.add.delay(1, 1).state == "pending"
    finally:
        admin.close()
        server.stop()


def test_operator_actions(app):
    failed = apps.boom.delay("x")
    claim(app)
    finish(app, failed.id, "1", "failed", "ValueError", "x", "tb")
    assert failed.retry("op") and failed.state == "pending"
    assert not failed.retry("op")  # pending: nothing to retry
    d = failed.refresh().to_dict()
    assert d["failures"] == 0 and any(e["event"] == "retried by op" for e in d["timeline"])
    assert app.redis.zcard(app.keys.q("default") + "failed") == 0
    delayed = apps.add.apply_async([1, 1], delay=100)
    assert delayed.requeue("op") and delayed.state == "pending"
    [row] = [r for r in claim(app, pids=(1, 2)) if r[1] == delayed.id] or [None]
    assert row is not None
    assert not delayed.delete()  # running: refused
    assert delayed.requeue("op") and delayed.state == "pending"  # running -> back in line
    assert finish(app, delayed.id, "1", "completed", "2") == 2  # the old delivery is fenced off
    assert delayed.delete()
    with pytest.raises(Exception, match="no job"):
        delayed.refresh()
    for i in range(2500):
        apps.add.delay(i, i)
    assert app.purge("default") == 2500  # the retried job was claimed above
    assert app.redis.llen(app.keys.q("default") + "pending") == 0


def test_a_batch_runs_in_order_after_the_server_lost_its_scripts(app):
    """A server without scripts (a restart, a flush, a promoted replica) used to get them
    loaded one by one, as first met: a later sync then found finish.lua known and
    progress.lua not; re-run after the finish of its batch, progress.lua found the job
    finished and its last log lines were lost. Any NOSCRIPT now loads every script, so a
    server knows all or none of them (and a batch of unknown ones is re-run in order). One
    library holds them all now: a server has all or none by construction."""
    first, second = apps.add.delay(1, 2), apps.add.delay(3, 4)
    p = app.keys.q("default")
    r = app.redis
    for job in (first, second):  # claimed by hand: attempt 1 holds each
        r.hset(p + "running", job.id, "{}")
        r.hset(app.keys.job("default", job.id), mapping={"attempts": "1", "state": "running"})
    r.function_flush()

    def finish(job_id: str) -> list:
        return [3600, 600, 3600, job_id, "1", "completed", "", "3", "", "", ""]

    batch = scripts.Batch(r)  # a sync that finishes a job: NOSCRIPT
    batch.call(scripts.FINISH, [p], finish(first.id))
    assert batch.execute() == [[1]]
    batch = scripts.Batch(r)  # the next: a job's last log line, then its finish
    batch.call(scripts.PROGRESS, [p], [100, second.id, "1", "", "", b'[1.5,1,"last words"]', 0])
    batch.call(scripts.FINISH, [p], finish(second.id))
    assert batch.execute() == [[1], [1]]
    assert "last words" in r.hget(app.keys.job("default", second.id), "logs")


def test_each_script_carries_only_the_lib_helpers_it_uses():
    """Every helper of `_lib.lua` is made at every call of a script that carries it (a closure
    each, before the script's first line): a script carries those it uses, directly or
    through another helper, and no other; names in comments and strings are no use."""
    lib = "\n".join([
        "-- the header", "", "local function a() return 1 end",
        "local X, Y = 1, 2", "-- b uses a", "local function b()", "  return a() + X", "end",
        "local c  -- made below", "local function d() return 'c' end  -- not c: a string",
        "c = function()", "  -- a() here is a comment", "  return Y", "end"])
    assert scripts.prelude(lib, "return b()") == "-- the header\n\nlocal function a() return 1 end\n" \
        "local X, Y = 1, 2\n-- b uses a\nlocal function b()\n  return a() + X\nend"
    assert scripts.prelude(lib, "return c() -- not d()") == "local X, Y = 1, 2\nlocal c  -- made below\n" \
        "c = function()\n  -- a() here is a comment\n  return Y\nend"
    assert scripts.prelude(lib, "return 'a'") == ""
    with pytest.raises(ValueError, match="outside any definition"):
        scripts.prelude("redis.call('PING')", "")
    helpers = scripts._definitions((scripts._DIR / "_lib.lua").read_text())
    for script in scripts.ALL:  # every helper a script names (itself, or a helper it carries) is carried
        used = scripts._names(script.source) & {name for names, _ in helpers for name in names}
        carried = {name for names, text in helpers if text in script.source for name in names}
        assert used <= carried, (script.name, used - carried)
    heartbeat = scripts.HEARTBEAT.source
    assert "local function is_name" in heartbeat and "local function finalize" not in heartbeat
    assert "local function finalize" in scripts.FINISH.source


def test_now_is_written_as_formatting_it_would(app):
    """A script writes its `now` from TIME's own digits, not by formatting the number: the
    text must be what string.format('%.6f') gives, leading zeros of the microseconds too."""
    info = json.dumps({"name": "w1", "host": "h", "pid": 1})
    deadline, padded = time.monotonic() + 5, False
    while not padded:  # until a second's first tenth: microseconds written with a leading zero
        assert time.monotonic() < deadline
        text = scripts.HEARTBEAT(app.redis, [app.keys.g], ["w1", info, 30])
        text = text.decode() if isinstance(text, bytes) else text
        assert re.fullmatch(r"\d{10}\.\d{6}", text) and text == f"{float(text):.6f}", text
        padded = text.split(".")[1].startswith("0")


def test_a_history_entry_is_the_id_and_one_packed_value(app):
    """A delivery's history entry is `id`, `v` (history.PACKED's values, one space between
    them, the host last and whole: it alone may hold a space) and `error_type` only when
    there is one — 2 or 3 fields where it had 11 or 12 (each field of an XADD costs Redis
    more than its text). The queue is the stream's."""
    from taskrunner.ops.history import PACKED

    ok, bad = apps.add.delay(1, 2), apps.add.delay(3, 4)
    p = app.keys.q("default")
    head = json.dumps({"worker": "w1", "host": "my host", "ip": "1.2.3.4"})[:-1]
    got = scripts.CLAIM(app.redis, [p], [head, "w1", "my host", "1.2.3.4", 1, 300, 4242, "", 4242, ""])
    attempts = {got[i + 1]: str(got[i + 2]) for i in range(0, len(got), STRIDE)}
    assert finish(app, ok.id, attempts[ok.id], "completed", "3") == 1
    assert finish(app, bad.id, attempts[bad.id], "failed", "ValueError", "no", "") == 1
    entries = {f["id"]: f for _, f in app.redis.xrange(p + "history")}
    assert set(entries[ok.id]) == {"id", "v"} and set(entries[bad.id]) == {"id", "v", "error_type"}
    assert entries[bad.id]["error_type"] == "ValueError"
    record = app.redis.hgetall(p + "job:" + ok.id)
    v = dict(zip(PACKED, entries[ok.id]["v"].split(" ", len(PACKED) - 1)))
    assert v == {"state": "completed", "attempt": "1", "enqueued_at": record["enqueued_at"],
                 "started_at": record["started_at"], "finished_at": record["finished_at"], "pid": "4242",
                 "task": "tests.apps.add", "worker": "w1", "host": "my host"}
    assert records(entries[bad.id], "default") == [{
        "id": bad.id, "queue": "default", "error_type": "ValueError",
        **dict(zip(PACKED, entries[bad.id]["v"].split(" ", len(PACKED) - 1)))}]
    assert records(entries[bad.id])[0]["state"] == "failed"


def test_a_finish_call_of_many_writes_one_history_entry_of_their_records(app):
    """A finish call that ends or requeues several deliveries writes one history entry for
    them all (an XADD costs Redis ~13k instructions a job; `jobs`: three lines a record, its
    id, `v`, error type), whatever each outcome; a newline in a foreign client's host or
    error type is a space there, so that no record takes another's lines."""
    jobs = [apps.add.apply_async([i, 1], retries=1 if i == 2 else 0) for i in range(4)]
    p = app.keys.q("default")
    head = json.dumps({"worker": "w1", "host": "my\nhost", "ip": "1.2.3.4"})[:-1]
    got = scripts.CLAIM(app.redis, [p], [head, "w1", "my\nhost", "1.2.3.4", 1, 300, *[4242, ""] * 4])
    attempts = {got[i + 1]: str(got[i + 2]) for i in range(0, len(got), STRIDE)}
    a, b, c, d = (j.id for j in jobs)
    values = [a, attempts[a], "completed", "", "3", "", "", "",
              b, attempts[b], "failed", "", "Bad\nType", "no", "", "",
              c, attempts[c], "error", "", "ValueError", "again", "", "1",
              d, attempts[d], "lost", "", "its process died", "", "", ""]
    assert scripts.FINISH(app.redis, [p], [3600, 600, 86400, *values]) == [1, 1, 1, 1]
    [(stream_id, entry)] = app.redis.xrange(p + "history")
    assert set(entry) == {"jobs"} and len(entry["jobs"].split("\n")) == 12
    held = read(app.redis.xrange(p + "history"), "default")
    assert sorted(i for i, _ in held) == [f"{stream_id}/{k}" for k in (1, 2, 3, 4)]
    got = {f["id"]: f for _, f in held}
    assert {i: (f["state"], f.get("error_type")) for i, f in got.items()} == {
        a: ("completed", None), b: ("failed", "Bad Type"), c: ("requeued", "ValueError"),
        d: ("requeued", "WorkerLost")}
    record = app.redis.hgetall(p + "job:" + a)
    assert got[a] == {"id": a, "queue": "default", "state": "completed", "attempt": "1",
                      "enqueued_at": record["enqueued_at"], "started_at": record["started_at"],
                      "finished_at": record["finished_at"], "pid": "4242", "task": "tests.apps.add",
                      "worker": "w1", "host": "my host"}
    assert scripts.TALLY(app.redis, [p], [10]) == 4
    stats = app.redis.hgetall(p + "stats")
    assert (stats["jobs|tests.apps.add|completed"], stats["jobs|tests.apps.add|failed"],
            stats["jobs|tests.apps.add|requeued"]) == ("1", "1", "2")


@pytest.mark.parametrize("ttl, cap, failed_ttl", [("3600.0", "600", "86400"), ("3600", "0.5", "1e5"),
                                                  ("3600", "600", "86400")])
def test_finish_takes_every_ttl_and_cap_written_as_a_number(app, ttl, cap, failed_ttl):
    """The settings are checked by one string.find each when they are an integer's digits;
    any other text that is such a number ("3600.0", "1e5"; a cap "0.5") is taken as before."""
    ok, bad = apps.add.delay(1, 2), apps.add.delay(3, 4)
    got = claim(app, pids=(1, 2))
    attempts = {job_id: str(attempt) for _, job_id, attempt, *_ in got}
    p = app.keys.q("default")
    out = scripts.FINISH(app.redis, [p], [ttl, cap, failed_ttl, ok.id, attempts[ok.id], "completed", "", "3", "", "",
                                          "", bad.id, attempts[bad.id], "failed", "", "E", "no", "", ""])
    assert out == [1, 1]
    assert 3590 < app.redis.ttl(p + "job:" + ok.id) <= 3600
    assert int(float(failed_ttl)) - 10 < app.redis.ttl(p + "job:" + bad.id) <= int(float(failed_ttl))


def test_finish_refuses_an_unknown_outcome_after_a_completed_one(app):
    """Outcomes other than `completed` are looked up in a table made when the first one comes:
    a batch whose first job completes still has the others' checked, before anything changes."""
    ok, other = apps.add.delay(1, 2), apps.add.delay(3, 4)
    got = claim(app, pids=(1, 2))
    attempts = {job_id: str(attempt) for _, job_id, attempt, *_ in got}
    p = app.keys.q("default")
    with pytest.raises(Exception, match="unknown outcome"):
        scripts.FINISH(app.redis, [p], [3600, 600, 86400, ok.id, attempts[ok.id], "completed", "", "3", "", "", "",
                                        other.id, attempts[other.id], "done", "", "", "", "", ""])
    assert app.redis.hlen(p + "running") == 2 and app.redis.xlen(p + "history") == 0


def test_a_lone_finish_with_began_writes_one_now_everywhere(app):
    """A job finished alone (no lists: its SREMs and ZADD name it) with `began`: started_at is
    now − began, formatted apart, and the record's finished_at, its timeline entry, its score in
    `completed` and its history entry's finished_at all carry the same now."""
    from taskrunner.ops.history import PACKED

    apps.add.delay(1, 2)
    [(_, job_id, attempt, *_)] = claim(app)
    p = app.keys.q("default")
    assert finish(app, job_id, str(attempt), "completed", "3", began="0.25") == 1
    rec = app.redis.hgetall(p + "job:" + job_id)
    now = rec["finished_at"]
    assert rec["end:1"] == f"{now} completed" and abs(float(now) - float(rec["started_at"]) - 0.25) < 2e-6
    assert app.redis.zscore(p + "completed", job_id) == float(now)
    [(_, entry)] = app.redis.xrange(p + "history")
    v = dict(zip(PACKED, entry["v"].split(" ", len(PACKED) - 1)))
    assert (v["started_at"], v["finished_at"]) == (rec["started_at"], now)
    assert not app.redis.hexists(p + "running", job_id) and not app.redis.sismember(p + "processing", job_id)
    assert not any(app.redis.sismember(k, job_id) for k in app.redis.scan_iter(p + "dl:*"))
    assert finish(app, job_id, str(attempt), "completed", "3") == 2  # released: a repeated call changes nothing
