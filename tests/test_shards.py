"""Sharded queues (issue 18, goal 3) on one Redis server: one logical queue over N
physical queues ("Q", "Q~1", ...), each its own hash slot. Producers (sync, asyncio,
enqueue_many) spread jobs over the shards, a worker claims from all of them in one call
and sleeps on all of their wake lists, and every operation on the queue acts on every
shard. The cluster side is in test_cluster.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections import Counter

import psutil
import pytest

from dashboard import create_app
from taskrunner import chain, chord, group
from taskrunner.client.aio import AsyncClient
from taskrunner.errors import InvalidName, JobNotFound, QueueFull, TaskRunnerError
from taskrunner.ops import listing, queue
from taskrunner.protocol import shards
from tests import apps, flow_apps
from tests.conftest import wait_for
from tests.test_failures import release, started_pid
from tests.test_node_client import need_node, node_script
from tests.test_scripts import claim, finish


def on_shards(jobs) -> Counter:
    return Counter(shards.split(j.queue)[1] for j in jobs)


def test_jobs_spread_over_shards_and_run_once_from_every_producer(app, stack):
    r = stack.cli("queue", "create", "sq", "--shards", "4", check=True)
    # One server: nothing to say of where the shards fall (on a cluster: test_cluster.py).
    assert (r.stdout, r.stderr) == ("queue sq: bound none, 4 shards\n", "")
    assert queue.placement(app, "sq", 4) is None
    assert app.queue_names() == ["sq", "sq~1", "sq~2", "sq~3"]  # the dispatcher sweeps each
    jobs = [apps.add.apply_async([i, 1], queue="sq") for i in range(40)]
    jobs += app.enqueue_many({"task": "tests.apps.add", "args": [i, 2], "queue": "sq"} for i in range(20))

    async def produce() -> list[str]:
        client = AsyncClient(app)
        try:
            return [await client.enqueue("tests.apps.add", [i, 3], queue="sq") for i in range(8)]
        finally:
            await client.close()

    jobs += [app.job(i) for i in asyncio.run(produce())]
    assert on_shards(jobs) == {0: 17, 1: 17, 2: 17, 3: 17}  # round robin, per producer
    assert {j.refresh().data["queue"] for j in jobs} == {"sq", "sq~1", "sq~2", "sq~3"}
    stats = json.loads(stack.cli("queues", "--json", check=True).stdout)
    [row] = [s for s in stats if s["name"].startswith("sq")]  # one logical queue, its totals
    assert row["name"] == "sq" and row["pending"] == 68 and row["shards"] == 4
    per_shard = json.loads(stack.cli("queues", "--json", "--shards", check=True).stdout)
    assert {s["name"]: s["pending"] for s in per_shard} == {"sq": 17, "sq~1": 17, "sq~2": 17, "sq~3": 17}
    assert not any("primary" in s for s in per_shard) and "primary=" not in stack.cli("queues", "--shards").stdout
    assert "shards=4" in stack.cli("queues", check=True).stdout
    assert "placement" not in json.loads(stack.cli("queue", "info", "sq", "--json", check=True).stdout)

    stack.worker("-Q", "sq", concurrency=2)
    assert [j.wait(30) for j in jobs] == [i + 1 for i in range(40)] + [i + 2 for i in range(20)] + \
        [i + 3 for i in range(8)]
    assert {j.refresh().to_dict()["attempts"] for j in jobs} == {1}  # each ran once
    info = queue.info(app, "sq")
    assert info["produced_messages"] == 68 and info["consumed_messages"] == 68
    done = listing.list_jobs(app, "sq", "completed", limit=100)
    assert len(done) == 68  # `jobs -q sq` lists every shard's


def test_shards_per_primary_and_the_counts_that_would_spread_them_evenly():
    primaries = ["a", "b", "c"]
    owners = ["a", "a", "b", "c", "b", "c", "c", "a"] + ["a"] * (shards.MAX - 8)
    assert shards.per_primary(owners[:3], primaries) == [2, 1, 0] and shards.uneven([2, 1, 0])
    assert not shards.uneven([1, 1, 0]) and not shards.uneven([2, 2, 1])  # 2 shards over 3; 5 over 3
    assert shards.even_counts(owners, primaries, 3) == [4, 5, 6]  # 2,1,1; 2,2,1; 2,2,2 (7: 2,2,3 too)
    assert shards.even_counts(owners, primaries, 5) == [4, 5, 6, 7, 8]
    assert shards.even_counts(["a"] * shards.MAX, primaries, 3) == []


def test_an_idle_worker_sleeps_on_every_shard_and_wakes_for_any(app, stack):
    queue.create(app, "idle", shards=8)
    w = stack.worker("-Q", "idle", concurrency=1)
    assert apps.add.apply_async([1, 1], queue="idle").wait(30) == 2
    wait_for(lambda: app.redis.info("clients")["blocked_clients"] >= 2, what="the worker to block")
    proc = psutil.Process(w.pid)
    before = proc.cpu_times()
    t0 = time.monotonic()
    time.sleep(2.0)  # the window its CPU time is measured over
    after = proc.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    assert used < 0.2, f"an idle worker on 8 shards used {used:.2f}s of CPU in {time.monotonic() - t0:.1f}s: it polls"
    jobs = [apps.add.apply_async([i, 0], queue="idle") for i in range(8)]  # one on each shard
    assert on_shards(jobs) == {i: 1 for i in range(8)}
    assert [j.wait(30) for j in jobs] == list(range(8))


def test_kill_retry_delete_and_wait_by_id_on_a_shard(app, stack):
    queue.create(app, "ops", shards=3)
    queue.pause(app, "ops")
    a, b, c = (apps.add.apply_async([i, i], queue="ops") for i in range(3))
    assert {shards.split(j.queue)[1] for j in (a, b, c)} == {0, 1, 2}
    found = app.job(b.id)  # found by id alone: every shard is a queue of the index
    assert found.queue == b.queue and found.state == "pending"
    assert app.job(c.id).kill() == "killed"
    assert c.refresh().state == "killed"
    c.retry()
    assert c.refresh().state == "pending"
    assert a.delete()
    with pytest.raises(JobNotFound):
        app.job(a.id)
    queue.resume(app, "ops")
    stack.worker("-Q", "ops", concurrency=1)
    assert b.wait(30) == 2 and c.wait(30) == 4


def test_pause_and_resume_act_on_every_shard(app, stack):
    queue.create(app, "pq", shards=3)
    assert json.loads(stack.cli("queue", "pause", "pq", "--json", check=True).stdout)["paused"] is True
    assert [app.redis.hget(app.keys.q(s) + "meta", "paused") for s in ("pq", "pq~1", "pq~2")] == ["1"] * 3
    jobs = [apps.add.apply_async([i, 0], queue="pq") for i in range(6)]
    stack.worker("-Q", "pq,other", concurrency=1)
    assert apps.add.apply_async([1, 1], queue="other").wait(30) == 2  # the worker runs, and claims none of pq
    assert {j.refresh().state for j in jobs} == {"pending"}
    stack.cli("queue", "resume", "pq", check=True)
    assert [j.wait(30) for j in jobs] == list(range(6))


def test_the_shard_count_changes_only_while_the_queue_has_no_unfinished_job(app, stack):
    queue.create(app, "ch", shards=2)
    job = apps.add.apply_async([1, 1], queue="ch")
    r = stack.cli("queue", "create", "ch", "--shards", "4")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "has 1 jobs pending, delayed, waiting or running" in r.stderr and "(2)" in r.stderr
    stack.worker("-Q", "ch", concurrency=1)
    assert job.wait(30) == 2
    queue.create(app, "ch", shards=4)  # finished jobs do not count
    assert queue.info(app, "ch")["shards"] == 4
    wait_for(lambda: len([q for q in json.loads(stack.cli("workers", "--json", check=True).stdout)[0]["queues"]])
             == 4, what="the worker to serve the new shards (at its next heartbeat)")
    jobs = [apps.add.apply_async([i, 0], queue="ch") for i in range(8)]
    assert set(on_shards(jobs)) == {0, 1, 2, 3}
    assert [j.wait(30) for j in jobs] == list(range(8))
    queue.create(app, "ch", shards=2)  # fewer: the shards that go are closed, so a producer
    assert app.queue_names().count("ch~3") == 0  # that read the old count cannot leave jobs there
    with pytest.raises(TaskRunnerError, match="closed"):
        apps.add.apply_async([1, 1], queue="ch~3")
    r = stack.cli("queue", "create", "ch", "--shards", "2", "--exclusive")
    assert r.returncode != 0 and "exclusive" in r.stderr, r.stderr
    with pytest.raises(InvalidName):
        queue.create(app, "x~1")  # no user queue can take a shard's name


@pytest.mark.parametrize("at", [1, 2])
def test_a_job_a_stale_producer_puts_on_a_shard_being_removed_is_never_lost(app, stack, monkeypatch, at):
    """A producer that still has the old shard count (sharding.KEEP) enqueues into a shard
    that a smaller count removes, at the `at`-th check for unfinished jobs: before the shards
    are closed (the change is then refused and the job runs), or after (it is refused,
    QueueClosed). Never a job its producer was told was enqueued and that is deleted, or left
    where no worker serves it."""
    queue.create(app, "sh", shards=4)
    real, calls, stale = queue.unfinished, [], []

    def producer_in_between(app_, names):
        found = real(app_, names)
        calls.append(names)
        if len(calls) == at:  # just after the check
            try:
                stale.append(apps.add.apply_async([2, 3], queue="sh~3"))
            except TaskRunnerError as e:
                stale.append(e)
        return found

    monkeypatch.setattr(queue, "unfinished", producer_in_between)
    if at == 1:
        with pytest.raises(TaskRunnerError, match="came into the shards to remove") as refused:
            queue.create(app, "sh", shards=2)
        assert "\n" not in str(refused.value)
        monkeypatch.setattr(queue, "unfinished", real)
        [job] = stale
        assert queue.info(app, "sh")["shards"] == 4 and "sh~3" in app.queue_names()
        stack.worker("-Q", "sh", concurrency=1)
        assert job.wait(30) == 5
        assert apps.add.apply_async([1, 1], queue="sh~3").wait(30) == 2  # opened again
        queue.create(app, "sh", shards=2)
    else:
        queue.create(app, "sh", shards=2)
        assert len(stale) == 1 and isinstance(stale[0], TaskRunnerError) and "closed" in str(stale[0])
    assert queue.info(app, "sh")["shards"] == 2 and "sh~3" not in app.queue_names()
    assert app.redis.keys(app.keys.q("sh~3") + "*") == [app.keys.q("sh~3") + "meta"]  # finished records gone
    with pytest.raises(TaskRunnerError, match="closed"):
        apps.add.apply_async([1, 1], queue="sh~3")


def test_a_job_placed_on_a_shard_that_is_not_part_of_the_queue_is_refused(app):
    """enqueue.lua, not the producer, refuses a shard past the queue's count (one a client
    that places jobs itself names), before writing anything: no worker would serve it."""
    queue.create(app, "few", shards=2)
    for stray in ("few~2", "few~9", "plain~1"):
        with pytest.raises(InvalidName, match=f"queue {stray} is not a shard of queue {stray.split('~')[0]}"):
            apps.add.apply_async([1, 1], queue=stray)
        assert app.redis.keys(app.keys.q(stray) + "*") == []
        assert stray not in app.queue_names()
    with pytest.raises(InvalidName, match="few~2 is not a shard"):
        app.enqueue_many([{"task": "tests.apps.add", "args": [1, 1], "queue": "few~2"}])
    with pytest.raises(InvalidName, match="few~7 is not a shard"):  # a step in another queue (KEYS[3..])
        chain(apps.add.s(1, 1).set(queue="few"), apps.add.s(1).set(queue="few~7")).delay()
    assert queue.unfinished(app, ["few", "few~1"]) == 0
    assert apps.add.apply_async([1, 1], queue="few~1").created  # a shard of the queue takes it


def test_keys_that_limits_count_by_go_to_one_shard(app, stack):
    """A unique key, a concurrency key and a rate-limited task each land on the shard of
    their hash, so that the lock, the slots and the limit, which count per shard, stay exact."""
    queue.create(app, "kq", shards=4)
    queue.pause(app, "kq")
    first = apps.add.apply_async([1, 2], queue="kq", unique_key="k1")
    again = [apps.add.apply_async([i, 2], queue="kq", unique_key="k1") for i in range(6)]
    assert {j.id for j in again} == {first.id} and not any(j.created for j in again)
    capped = [flow_apps.capped.apply_async(["a", 0], queue="kq", concurrency_key="cust:7") for _ in range(6)]
    assert {j.queue for j in capped} == {shards.name("kq", shards.of_key("c:cust:7", 4))}
    limited = [flow_apps.limited.apply_async([i], queue="kq") for i in range(6)]
    assert {j.queue for j in limited} == {shards.name("kq", shards.of_key("r:tests.flow_apps.limited", 4))}
    plain = [apps.add.apply_async([i, 0], queue="kq") for i in range(8)]
    assert len({j.queue for j in plain}) == 4
    once = [apps.add.apply_async([1, 1], queue="kq", job_id="tick-1") for _ in range(4)]  # a schedule's tick
    assert len({j.queue for j in once}) == 1 and [j.created for j in once] == [True, False, False, False]
    # enqueue_many's too (it went round robin: one job per shard, four runs of one id)
    many = [app.enqueue_many([{"task": "tests.apps.add", "args": [1, 1], "queue": "kq", "id": "tick-2"}])[0]
            for _ in range(4)]
    assert len({j.queue for j in many}) == 1 and [j.created for j in many] == [True, False, False, False]


def test_a_sigkilled_worker_loses_nothing_on_a_sharded_queue(app, stack):
    queue.create(app, "kill", shards=3)
    stack.dispatcher()
    w1 = stack.worker("-Q", "kill", name="w1", concurrency=3)
    held = [apps.hold.apply_async([f"s{i}"], queue="kill") for i in range(3)]
    assert {shards.split(j.queue)[1] for j in held} == {0, 1, 2}
    for i in range(3):
        started_pid(app, f"s{i}")
    os.killpg(w1.pid, signal.SIGKILL)
    stack.worker("-Q", "kill", name="w2", concurrency=3)
    for i in range(3):
        started_pid(app, f"s{i}", 2)
        release(app, f"s{i}")
    assert [j.wait(30) for j in held] == ["released"] * 3
    assert {j.refresh().data["worker"] for j in held} == {"w2"}


def test_an_unsharded_queue_costs_no_command_more_per_job(app):
    """The shard count is read once per shards.KEEP seconds per queue and producer, not per
    job: 100 enqueues into a plain queue, then claims and finishes, cost the commands they
    cost before sharding (measured on main: 1100 and 2599; 2499 since finish.lua reads the
    meta only for a job of an exclusive queue, 2026-11-26)."""
    apps.add.apply_async([1, 1], queue="plainq")  # the scripts loaded, the count read
    claim(app, queues=("plainq",))
    app.redis.config_resetstat()
    for _ in range(100):
        apps.add.apply_async([1, 1], queue="plainq")
    enqueued = commands(app)
    app.redis.config_resetstat()
    for _ in range(100):
        [row] = claim(app, queues=("plainq",))
        assert finish(app, row[1], str(row[2]), "completed", "2", queue="plainq") == 1
    assert (enqueued, commands(app)) == (1100, 2499)


def commands(app) -> int:
    """Commands Redis ran since the last CONFIG RESETSTAT (those of scripts included), but
    the test's own INFO and CONFIG."""
    stats = app.redis.info("commandstats")
    return sum(v["calls"] for k, v in stats.items()
               if k.split("|")[0] not in ("cmdstat_info", "cmdstat_config", "cmdstat_hello", "cmdstat_client"))


def test_bound_and_rate_are_split_evenly_over_the_shards(app, stack):
    queue.create(app, "br", bound=10, rate="50/s", shards=3)
    metas = [app.redis.hgetall(app.keys.q(s) + "meta") for s in shards.names("br", 3)]
    assert [(m["bound"], m["rate"]) for m in metas] == [("4", "1000/m")] * 3  # 50/s = 3 x 1000/m
    info = queue.info(app, "br")
    assert (info["bound"], info["rate"], info["rate_each"], info["shards"]) == (10, "50/s", "1000/m", 3)
    queue.set_rate(app, "br", "30/s")
    assert {app.redis.hget(app.keys.q(s) + "meta", "rate") for s in shards.names("br", 3)} == {"10/s"}
    assert queue.info(app, "br")["rate"] == "30/s"
    r = stack.cli("queue", "create", "br7", "--rate", "50/s", "--shards", "7")
    assert r.returncode == 2 and "cannot be split evenly over 7 shards" in r.stderr, r.stderr
    assert not app.redis.exists(app.keys.q("br7") + "meta")  # refused before anything was written


def test_workflows_run_across_the_shards_of_a_queue(app, stack):
    """A chain's steps and a chord's members land on several shards (several slots): each
    step runs after its parent, the chord's callback gets every result in order."""
    queue.create(app, "wf", shards=3)
    stack.worker("-Q", "wf", concurrency=2)
    handle = chain(*[apps.add.s(1, 1).set(queue="wf")] + [apps.add.s(1).set(queue="wf") for _ in range(5)]).delay()
    assert handle.wait(30) == 7
    members = [apps.add.s(i, 0).set(queue="wf") for i in range(9)]
    result = chord(group(members), apps.echo.s().set(queue="wf")).delay()
    assert result.wait(30) == list(range(9))
    spread = {j.queue for j in listing.list_jobs(app, "wf", "completed", limit=100)}
    assert spread == {"wf", "wf~1", "wf~2"}


def test_the_node_producer_places_jobs_on_the_shards_as_python_does(app, stack):
    need_node()
    queue.create(app, "nq", shards=3)
    stack.worker("-Q", "nq", concurrency=2)
    got = node_script(stack, """
      const plain = [];
      for (let i = 0; i < 6; i++) plain.push(await tr.enqueue('tests.apps.add', [i, 1], {}, { queue: 'nq' }));
      const keyed = await tr.enqueue('tests.apps.add', [1, 1], {}, { queue: 'nq', uniqueKey: 'k-7' });
      const again = await tr.enqueue('tests.apps.add', [1, 1], {}, { queue: 'nq', id: 'node-tick-1' });
      const last = await tr.chain([{ task: 'tests.apps.add', args: [1, 1], queue: 'nq' },
        { task: 'tests.apps.add', args: [1], queue: 'nq' }, { task: 'tests.apps.add', args: [1], queue: 'nq' }]);
      const record = await tr.wait(last.id, last.queue, 30);
      console.log(JSON.stringify({ plain, keyed, again, result: record.result }));
    """)
    assert sorted(j["queue"] for j in got["plain"]) == ["nq", "nq", "nq~1", "nq~1", "nq~2", "nq~2"]
    assert got["keyed"]["queue"] == shards.name("nq", shards.of_key("u:k-7", 3))  # the hash Python uses
    assert got["again"]["queue"] == shards.name("nq", shards.of_key("i:node-tick-1", 3))
    assert got["result"] == "4"
    assert [app.job(j["id"]).wait(30) for j in got["plain"]] == [i + 1 for i in range(6)]


def test_a_queue_keeps_its_rate_when_its_shard_count_changes(app):
    queue.create(app, "rc", rate="60/s")
    queue.create(app, "rc", shards=3)  # the rate not given: the queue's, now split
    assert [app.redis.hget(app.keys.q(s) + "meta", "rate") for s in shards.names("rc", 3)] == ["20/s"] * 3
    queue.create(app, "rc", shards=1)
    assert (app.redis.hget(app.keys.q("rc") + "meta", "rate"), queue.info(app, "rc")["rate"]) == ("60/s", "60/s")
    assert app.redis.hget(app.keys.q("rc~1") + "meta", "retired") == "1"


def test_queue_create_keeps_the_settings_it_is_not_given(app, stack):
    """Run again to change the shard count (or one setting), `queue create` keeps the bound,
    exclusivity and rate it is not given: it reset the first two (to none) each time. The
    bound given is kept exactly, however often the count changes (each shard's part is
    rounded up); --bound 0 and --no-exclusive clear them."""
    def meta(q: str, n: int) -> list[dict[str, str]]:
        return [app.redis.hgetall(app.keys.q(s) + "meta") for s in shards.names(q, n)]

    stack.cli("queue", "create", "keep", "--bound", "10", "--rate", "60/s", check=True)
    r = stack.cli("queue", "create", "keep", "--shards", "3", check=True)
    assert r.stdout == "queue keep: bound 10, rate 60/s, 3 shards\n"
    assert [(m["bound"], m["rate"], m["exclusive"]) for m in meta("keep", 3)] == [("4", "20/s", "0")] * 3
    assert stack.cli("queue", "create", "keep", "--shards", "2", check=True).stdout.startswith("queue keep: bound 10,")
    assert [m["bound"] for m in meta("keep", 2)] == ["5", "5"]
    stack.cli("queue", "create", "keep", "--shards", "1", check=True)
    [one] = meta("keep", 1)
    assert (one["bound"], one["rate"], "bound_total" in one, "rate_total" in one) == ("10", "60/s", False, False)
    r = stack.cli("queue", "create", "keep", "--bound", "0", check=True)
    assert r.stdout == "queue keep: bound none, rate 60/s\n"

    stack.cli("queue", "create", "solo", "--exclusive", "--bound", "5", check=True)
    assert stack.cli("queue", "create", "solo", check=True).stdout == "queue solo: bound 5, exclusive\n"
    r = stack.cli("queue", "create", "solo", "--shards", "2")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--no-exclusive" in r.stderr, r.stderr
    assert stack.cli("queue", "info", "solo", "--json", check=True).stdout.count('"exclusive": true') == 1
    r = stack.cli("queue", "create", "solo", "--no-exclusive", "--shards", "2", check=True)
    assert r.stdout == "queue solo: bound 5, 2 shards\n"
    assert [(m["bound"], m["exclusive"]) for m in meta("solo", 2)] == [("3", "0")] * 2


def test_a_sharded_queue_shows_the_bound_it_was_given_everywhere(app, stack):
    """`queue create b --bound 10 --shards 3` said bound 10 while `queue info`, `queues`, the
    dashboard and the metrics showed 12, the sum of the shards' rounded-up parts (4 each).
    Each shows the bound given (meta `bound_total`); a per-shard view each shard's part;
    a queue sharded before bound_total was kept, the sum of its parts as before."""
    web = create_app(app, password="pw", token="tok").test_client()

    def shown() -> dict[str, float]:
        """Queue b's bound as each place shows it."""
        def cli(*command: str) -> str:
            return stack.cli(*command, check=True).stdout

        [listed] = [q for q in json.loads(cli("queues", "--json")) if q["name"] == "b"]
        [text] = [line.split()[1] for line in cli("queue", "info", "b").splitlines() if line.split()[0] == "bound"]
        [row] = [line for line in cli("queues").splitlines() if line.startswith("b ")]
        [api] = [q for q in web.get("/api/queues").get_json() if q["name"] == "b"]
        [overview] = [q for q in web.get("/api/overview").get_json()["queues"] if q["name"] == "b"]
        page = web.get("/queues/b").get_data(as_text=True)
        return {"info --json": json.loads(cli("queue", "info", "b", "--json"))["bound"], "info": int(text),
                "queues --json": listed["bound"], "queues": int(row.split("bound=")[1].split()[0]),
                "pause --json": json.loads(cli("queue", "pause", "b", "--json"))["bound"],
                "/api/queues": api["bound"], "/api/overview": overview["bound"],
                "page": int(re.findall(r">bound (\d+)<", page)[0]),
                "metrics": float(re.findall(r'^taskrunner_queue_bound\{queue="b"\} (\S+)$', cli("metrics"), re.M)[0])}

    assert stack.cli("queue", "create", "b", "--bound", "10", "--shards", "3", check=True).stdout.startswith(
        "queue b: bound 10,")
    places = shown()
    assert places == dict.fromkeys(places, 10)
    each = json.loads(stack.cli("queues", "--shards", "--json", check=True).stdout)
    assert [q["bound"] for q in each if q["name"].startswith("b")] == [4, 4, 4]  # each shard's own part
    assert [q["bound"] for q in listing.shard_stats(app, "b")] == [4, 4, 4]
    stack.cli("queue", "create", "b", "--shards", "2", check=True)
    assert queue.info(app, "b")["bound"] == 10 and [q["bound"] for q in listing.shard_stats(app, "b")] == [5, 5]
    stack.cli("queue", "create", "b", "--bound", "10", "--shards", "3", check=True)
    app.redis.hdel(app.keys.q("b") + "meta", "bound_total")  # sharded by a taskrunner that did not keep it
    assert shown() == dict.fromkeys(places, 12)


def test_each_shard_shows_its_own_rate_and_a_sharded_bound_what_it_holds(app, stack):
    """`queues --shards` showed the queue's rate (50/s) on shard 0's row and each other
    shard's part (1000/m) on theirs: each row has its shard's own now (the queue's rate on
    its total row, and as shard 0's `rate_total` in --json). The dashboard's bound badge
    said "at most 10 pending jobs" of a bound of 10 over 3 shards, which holds 12 (each
    shard enforces ⌈10/3⌉ = 4): it says so, as does `queues`."""
    queue.create(app, "rs", bound=10, rate="50/s", shards=3)
    rows = [q for q in json.loads(stack.cli("queues", "--shards", "--json", check=True).stdout)
            if q["name"].startswith("rs")]
    assert [(q["name"], q["rate"], q["bound"]) for q in rows] == [(n, "1000/m", 4) for n in ("rs", "rs~1", "rs~2")]
    assert rows[0]["rate_total"] == "50/s" and "rate_each" not in rows[0]
    lines = [line for line in stack.cli("queues", "--shards", check=True).stdout.splitlines() if line.startswith("rs")]
    assert len(lines) == 3 and all("rate=1000/m " in line and "50/s" not in line for line in lines), lines
    [total] = [line for line in stack.cli("queues", check=True).stdout.splitlines() if line.startswith("rs ")]
    assert "bound=10 (4 per shard: at most 12)" in total and "rate=50/s " in total, total
    [listed] = [q for q in json.loads(stack.cli("queues", "--json", check=True).stdout) if q["name"] == "rs"]
    assert (listed["bound"], listed["bound_each"], listed["shards"], listed["rate"]) == (10, 4, 3, "50/s")
    web = create_app(app).test_client()
    said = "bound 10 over 3 shards: each shard holds at most 4 pending jobs, so the queue at most 12"
    for page in ("/queues/rs", "/"):
        html = web.get(page).get_data(as_text=True)
        assert f'title="{said}">bound 10<' in html and "at most 10 pending" not in html, page
    # The overview (the dashboard's / and /api/queues, the metrics) combines the shards: the
    # queue's rate, not shard 0's part (it showed 1000/m once `queues --shards` got its parts).
    [seen] = [q for q in listing.overview(app)["queues"] if q["name"] == "rs"]
    assert seen["rate"] == "50/s" and "rate_total" not in seen, seen
    queue.create(app, "one", bound=10)  # not sharded: its bound is what it holds
    assert 'title="at most 10 pending jobs">bound 10<' in web.get("/queues/one").get_data(as_text=True)


def test_harvest_and_recover_reach_every_shard(app, stack):
    queue.create(app, "hv", shards=2)
    assert stack.cli("harvest").returncode == 0  # every queue, shards included: a shard's name is no typo
    stack.cli("harvest", "-q", "hv", check=True)
    assert stack.cli("recover", "-q", "hv", "--older-than", "1h", check=True).stdout.strip() == "nothing to recover"


def test_the_dashboard_shows_a_sharded_queue_once_and_pages_through_its_shards(app):
    web = create_app(app, password="pw", token="tok").test_client()
    queue.create(app, "dq", shards=3)
    queue.pause(app, "dq")
    jobs = [apps.add.apply_async([i, 0], queue="dq") for i in range(6)]
    [row] = [q for q in web.get("/api/queues").get_json() if q["name"].startswith("dq")]
    assert (row["name"], row["pending"], row["shards"], row["paused"]) == ("dq", 6, 3, True)
    page = web.get("/queues/dq").get_data(as_text=True)
    assert all(j.id in page for j in jobs)  # every shard's
    shard = next(j for j in jobs if j.queue == "dq~2")
    assert web.get(f"/jobs/{shard.id}").status_code == 200
    one = web.get("/queues/dq~2").get_data(as_text=True)  # a shard's own page: its jobs alone
    assert shard.id in one and sum(j.id in one for j in jobs) == 2


def test_a_bounded_sharded_queue_bounds_each_shard(app, stack):
    """bound 2 over 2 shards: 1 pending job each; a producer whose shard is full waits for
    room there, then gets QueueFull; a worker makes room."""
    queue.create(app, "bq", bound=2, shards=2)
    queue.pause(app, "bq")
    first = [apps.add.apply_async([i, 0], queue="bq") for i in range(2)]  # round robin: one on each
    assert sorted(j.queue for j in first) == ["bq", "bq~1"]
    with pytest.raises(QueueFull):
        apps.add.apply_async([2, 0], queue="bq", block_timeout=0.2)
    stack.worker("-Q", "bq", concurrency=1)
    queue.resume(app, "bq")
    assert [j.wait(30) for j in first] == [0, 1]
    assert apps.add.apply_async([3, 0], queue="bq", block_timeout=5).wait(30) == 3


def test_a_queue_named_twice_is_served_once_where_first_named(app, stack):
    """`-Q hi,lo,hi`: hi then lo (strict priority: a second place adds nothing). The list
    was kept as given, so every claim and heartbeat named hi twice."""
    served = shards.Served(["hi", "lo", "hi"])
    assert served.queues == ["hi", "lo"] and served.counts == [1, 1] and not served.update([1, 1])
    stack.worker("-Q", "hi,lo,hi", concurrency=1)
    assert wait_for(lambda: json.loads(stack.cli("workers", "--json", check=True).stdout),
                    what="the worker's heartbeat")[0]["queues"] == ["hi", "lo"]
