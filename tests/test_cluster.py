"""Redis Cluster: three primaries on loopback, and three queues whose hash tags land on
three different primaries. A real worker serving all three and a real dispatcher, reached
through a redis+cluster:// URL, run their jobs (delayed and killed ones too); the CLI and
the dashboard work; a Consumer claims across them in strict priority and blocks on all."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from typing import Any

import pytest
import redis

from dashboard import create_app
from taskrunner import JobFailed, chain, chord, group
from taskrunner.client import steps
from taskrunner.client.aio import AsyncClient
from taskrunner.client.consumer import Consumer
from taskrunner.errors import QueueClosed, Timeout
from taskrunner.ops import listing
from taskrunner.ops import queue as queue_ops
from taskrunner.protocol import joins, scripts, shards
from taskrunner.protocol.connection import ClusterURL, connect, connect_async
from taskrunner.protocol.links import ClusterChannel
from taskrunner.protocol.outages import transient
from taskrunner.protocol.outcome import Ended, Outcome, finish_args
from tests import apps
from tests.conftest import Stack, wait_for
from tests.test_enqueue_retry import warnings  # noqa: F401 (a fixture)
from tests.test_failures import ledger, release, started_pid
from tests.test_node_client import need_node, node_script
from tests.topologies import Cluster, Topology, redis_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Topology(tmp_path_factory.mktemp("cluster")) as topology:
        yield redis_cluster(topology)


@pytest.fixture
def queues(cluster: Cluster) -> list[str]:
    """Three queue names whose keys live on three different primaries."""
    found: dict[int, str] = {}
    for i in range(1000):
        found.setdefault(cluster.owner(f"{{q{i}}}").port, f"q{i}")
        if len(found) == 3:
            return list(found.values())
    raise AssertionError("no three queues on three primaries")


@pytest.fixture
def capp(app, cluster):
    """The tests' app, reaching the cluster."""
    app.configure(redis_url=cluster.url())
    return app


@pytest.fixture
def stack(capp, cluster):
    s = Stack(capp, cluster.url())
    yield s
    s.stop()


def test_worker_and_dispatcher_run_jobs_of_queues_on_three_primaries(capp, stack, cluster, queues):
    stack.dispatcher()
    stack.worker("-Q", ",".join(queues), name="w1")
    jobs = [apps.add.apply_async([i, 1], queue=q) for i in range(20) for q in queues]
    many = capp.enqueue_many({"task": "tests.apps.add", "args": [i, 2], "queue": q} for q in queues for i in range(10))
    delayed = apps.add.apply_async([40, 2], queue=queues[1], delay=0.3)
    assert [j.wait(30) for j in jobs] == [i + 1 for i in range(20) for _ in queues]
    assert [(j.queue, j.wait(30)) for j in many] == [(q, i + 2) for q in queues for i in range(10)]
    assert delayed.wait(30) == 42
    jobs += many
    for q in queues:  # each queue's records on its own primary
        with cluster.owner(f"{{{q}}}").client() as node:
            done = [j for j in jobs if j.queue == q]
            assert {node.hget(capp.keys.job(q, j.id), "state") for j in done} == {"completed"}
            assert {node.hget(capp.keys.job(q, j.id), "worker") for j in done} == {"w1"}

    # A node that lost its scripts (a new node, a restart without persistence): "Function not
    # found", the library loaded again, on every primary.
    # redis-py finds FCALL's keys without asking the node (COMMAND GETKEYS) at every call.
    for n in cluster.primaries:
        with n.client() as node:
            node.function_flush()
            node.config_resetstat()
    again = [apps.add.apply_async([i, 3], queue=q) for i, q in enumerate(queues)]
    assert [j.wait(30) for j in again] == [3, 4, 5]
    for n in cluster.primaries:
        with n.client() as node:
            assert node.function_list(library=scripts.LIBRARY_NAME)
            stats = node.info("commandstats")
            assert stats["cmdstat_fcall"]["calls"] > 0 and "cmdstat_command|getkeys" not in stats, stats

    # Kill a running job: kill.lua in its queue's slot, the message on the worker's control list.
    held = apps.hold.apply_async(["k"], queue=queues[2])
    wait_for(lambda: held.state == "running", what="the job to run")
    assert held.kill() == "running"
    wait_for(lambda: held.state == "killed", what="the job killed")
    assert apps.add.apply_async([1, 1], queue=queues[2]).wait(30) == 2  # its worker carries on


def test_a_busy_worker_leaves_other_queues_wake_tokens_to_other_workers(capp, stack, cluster, queues):
    """One BRPOP per queue (their lists are in other slots). Woken by one, the worker leaves
    the others out (closing them lost tokens on their way); a token one of them brings while
    its children have no room is put back at once, as one BRPOP on every list would have left
    it: another worker, idle and woken by tokens alone (idle block 60 s), runs that job."""
    first, second = [q for q in queues if cluster.owner(f"{{{q}}}") != cluster.owner(capp.keys.g)][:2]
    stack.worker("-Q", f"{first},{second}", concurrency=1, name="busy", env={"TASKRUNNER_IDLE_BLOCK": "60"})
    with cluster.owner(f"{{{second}}}").client() as node:  # only the BRPOP on `second`'s wake list blocks there
        wait_for(lambda: node.info("clients")["blocked_clients"] == 1, what="the idle worker waiting on both queues")
        held = apps.hold.apply_async(["w"], queue=first)
        wait_for(lambda: held.state == "running", what="the job to run")
        stack.worker("-Q", second, concurrency=1, name="idle", env={"TASKRUNNER_IDLE_BLOCK": "60"})
        wait_for(lambda: node.info("clients")["blocked_clients"] >= 1, what="the other worker waiting")
        later = apps.add.apply_async([1, 2], queue=second)
        assert later.wait(30) == 3 and later.refresh().data["worker"] == "idle"
    release(capp, "w")
    assert held.wait(30) == "released"


def test_sigterm_stops_a_cluster_worker_cleanly(capp, stack, queues):
    """SIGTERM: the worker says goodbye (its entries go) and exits 0. redis-py's
    ClusterPipeline.delete() returns None, not the pipeline: a chained call after it
    raised AttributeError and the worker crashed without saying goodbye."""
    w = stack.worker("-Q", ",".join(queues), name="leaver")
    assert apps.add.apply_async([1, 1], queue=queues[0]).wait(30) == 2
    assert capp.redis.zscore(capp.keys.workers, "leaver") is not None
    w.send_signal(signal.SIGTERM)
    out, _ = w.communicate(timeout=60)
    assert w.returncode == 0, out
    assert "Traceback" not in out and "could not say goodbye" not in out, out
    assert capp.redis.zscore(capp.keys.workers, "leaver") is None
    assert not capp.redis.exists(capp.keys.worker("leaver"), capp.keys.control("leaver"))


def test_cli_dashboard_history_and_queue_delete(capp, stack, cluster, queues, tmp_path):
    stack.worker("-Q", ",".join(queues))
    ids = [stack.cli("enqueue", "tests.apps.add", "--args", f"[{i}, 1]", "-q", q, check=True).stdout.strip()
           for i, q in enumerate(queues)]
    assert [stack.cli("wait", i, "--timeout", "30", check=True).stdout.strip() for i in ids] == ["1", "2", "3"]
    assert json.loads(stack.cli("status", ids[2], "--json", check=True).stdout)["state"] == "completed"
    listed = json.loads(stack.cli("jobs", "--state", "completed", "--json", check=True).stdout)
    assert sorted(j["id"] for j in listed) == sorted(ids)
    counts = {q["name"]: q["completed"] for q in json.loads(stack.cli("queues", "--json", check=True).stdout)}
    assert counts == {q: 1 for q in queues}
    client = create_app(capp, password="", token="").test_client()
    page = client.get("/")
    assert page.status_code == 200 and all(q in page.text for q in queues)
    overview = client.get("/api/overview").get_json()
    assert {q["name"]: q["completed"] for q in overview["queues"]} == counts
    assert [w["state"] for w in overview["workers"]] == ["alive"]

    stack.cli("history", "archive", "--history-dir", str(tmp_path), check=True)
    assert {p.parent.name for p in tmp_path.rglob("*.parquet")} == {f"queue={q}" for q in queues}
    stack.cli("queue", "delete", queues[0], "--force", "--yes", check=True)  # SCAN on every primary
    with cluster.owner(f"{{{queues[0]}}}").client() as node:
        assert node.keys(capp.keys.q(queues[0]).replace("{", "\\{") + "*") == []
    assert [q["name"] for q in json.loads(stack.cli("queues", "--json", check=True).stdout)] == sorted(queues[1:])


def test_worker_follows_a_resharded_queue(capp, stack, cluster, queues):
    """The slot of a queue moves to another primary while the worker waits on its wake
    list there: its BRPOP answers MOVED, it learns the new layout and waits on the new
    owner, whose enqueue wakes it (its idle wait is longer than the test)."""
    q = queues[0]
    stack.worker("-Q", q, env={"TASKRUNNER_IDLE_BLOCK": "60"})
    before = apps.add.apply_async([1, 1], queue=q)
    assert before.wait(30) == 2
    source = cluster.owner(f"{{{q}}}")
    waiting = 1 + (cluster.owner(capp.keys.g) is source)  # and its control list's BRPOP, when there
    with source.client() as node:
        wait_for(lambda: node.info("clients")["blocked_clients"] == waiting, what="the worker waiting on the wake list")
    target = next(n for n in cluster.primaries if n is not source)
    cluster.move_slot(f"{{{q}}}", target)
    after = apps.add.apply_async([2, 2], queue=q)
    assert after.wait(30) == 4 and before.refresh().result == 2  # the records moved with the slot
    with target.client() as node:
        assert node.hget(capp.keys.job(q, after.id), "state") == "completed"


def test_consumer_claims_in_strict_priority_and_blocks_on_every_queue(capp, cluster, queues):
    first, second, third = queues
    later = [apps.add.apply_async([i, 0], queue=third) for i in range(2)]
    top = [apps.add.apply_async([i, 0], queue=first) for i in range(2)]
    with pytest.raises(Timeout):  # blocks in Redis (BLPOP) for 5 s, then some: no socket timeout cuts it
        top[0].wait(5.1)
    consumer = Consumer(capp, queues, name="c1")
    got = consumer.claim(3)
    assert [(d.queue, d.id) for d in got] == [(first, j.id) for j in top] + [(third, later[0].id)]
    assert consumer.ack(got) == [True] * 3
    assert [(d.queue, d.id) for d in consumer.claim(5)] == [(third, later[1].id)]

    # Nothing left: it blocks on all three wake lists (one per primary), and the enqueue wakes it.
    blocked = [0] * 3
    woke: list = []
    waiter = threading.Thread(target=lambda: woke.extend(consumer.claim(1, block=20)))
    waiter.start()

    def waiting() -> bool:
        for i, n in enumerate(cluster.primaries):
            with n.client() as node:
                blocked[i] = node.info("clients")["blocked_clients"]
        return all(blocked)

    wait_for(waiting, what="a blocked BRPOP on every primary")
    job = apps.add.apply_async([1, 2], queue=second)
    waiter.join(20)
    assert [(d.queue, d.id) for d in woke] == [(second, job.id)]
    consumer.close()


def test_asyncio_wait_blocks_on_the_primary_of_the_job(capp, stack, queues):
    """AsyncClient.wait's BLPOP goes to the primary of the job's slot, on a connection of
    its own: a Timeout while the job runs, then its result."""
    stack.worker("-Q", queues[1])
    held = apps.hold.apply_async(["aw"], queue=queues[1])
    wait_for(lambda: held.state == "running", what="the job to run")

    async def main() -> str:
        client = AsyncClient(capp)
        try:
            with pytest.raises(Timeout):
                await client.wait(held.id, 0.5)
            capp.redis.set(f"{capp.settings.prefix}:release:aw", "1")
            return await client.wait(held.id, 30)
        finally:
            await client.close()

    assert asyncio.run(main()) == "released"


def test_asyncio_client_loads_the_library_on_every_primary(capp, cluster, queues):
    """An AsyncClient meeting primaries without the library (a new cluster, a new node,
    FUNCTION FLUSH, a version no worker has loaded yet) loads it on every primary and its
    calls go on. Its FUNCTION LOAD, sent as separate words, had no route on a cluster ("No
    way to dispatch this command": no key): every call failed (fails before)."""
    for n in cluster.primaries:
        with n.client() as node:
            node.function_flush()

    async def main() -> list[str]:
        client = AsyncClient(capp)
        try:
            return [await client.enqueue("tests.apps.add", [i, 1], queue=q) for i, q in enumerate(queues)]
        finally:
            await client.close()

    ids = asyncio.run(main())
    assert [capp.job(i, queue=q).state for i, q in zip(ids, queues)] == ["pending"] * len(queues)
    for n in cluster.primaries:
        with n.client() as node:
            assert node.function_list(library=scripts.LIBRARY_NAME)


def test_asyncio_client_and_url(cluster, queues):
    async def roundtrip() -> list:
        client = connect_async(cluster.url())
        try:
            await client.mset({"{k}a": "1", "{k}b": "2"})  # one slot
            return [await client.get(f"{{{q}}}x") for q in queues] + await client.mget("{k}a", "{k}b")
        finally:
            await client.aclose()

    r = connect(cluster.url())
    for q in queues:
        r.set(f"{{{q}}}x", q)
    assert asyncio.run(roundtrip()) == [*queues, "1", "2"]
    u = ClusterURL.parse("redis+cluster://:p%40ss@10.0.0.1,[::1]:7001/?socket_timeout=2")
    assert (u.nodes, u.password, u.options) == ((("10.0.0.1", 6379), ("::1", 7001)), "p@ss", {"socket_timeout": 2.0})


def test_worker_and_dispatcher_wait_for_an_unreachable_cluster(app):
    """Started before the cluster (a host booting): they wait for it, as with one Redis,
    rather than exit because the client could not learn the layout."""
    stack = Stack(app, "redis+cluster://127.0.0.1:1")
    try:
        for p in (stack.worker(), stack.dispatcher()):
            lines: list[str] = []
            wait_for(lambda p=p, lines=lines: lines.append(p.stdout.readline()) or "Redis unavailable" in lines[-1]
                     or not lines[-1], what="it to say it waits for Redis")  # "": it exited
            assert p.poll() is None and "Redis unavailable" in lines[-1], lines
    finally:
        stack.stop()


def test_cli_says_when_no_cluster_node_answers(app):
    r = Stack(app, "redis+cluster://127.0.0.1:1").cli("queues")
    assert r.returncode == 3 and "cannot reach Redis" in r.stderr and "Traceback" not in r.stderr


def test_what_redis_py_raises_on_a_cluster_passes_only_when_it_does(app, cluster, queues):
    """transient() took every RedisClusterException for one that passes by itself, while
    redis-py raises that class for a command whose keys span slots too (found by review):
    that is ours to fix, and waiting would never end it. What it raises here: for a script
    call across slots, a RedisClusterException of its own ("... all keys must map to the same
    key slot"); for a command a node refuses across slots (CROSSSLOT), ClusterCrossSlotError
    ("Keys in request don't hash to the same slot"; in redis-py 5.0 a plain ResponseError
    "CROSSSLOT Keys ..."); for a cluster of which
    no node answers, a RedisClusterException "cannot be connected" raised from the
    connection error, which passes."""
    app.configure(redis_url=cluster.url())
    keys = [app.keys.q(queues[0]), app.keys.q(queues[1])]
    with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot") as across:
        scripts.ENQUEUE(app.redis, keys, [1, "x", 0, 1, "task", "t"])
    with cluster.nodes[0].client() as node, pytest.raises(redis.ResponseError, match="to the same slot") as refused:
        node.execute_command("MSET", keys[0] + "a", "1", keys[1] + "a", "1")
    with pytest.raises(redis.exceptions.RedisClusterException, match="cannot be connected") as unreachable:
        connect("redis+cluster://127.0.0.1:1")
    assert (transient(across.value), transient(refused.value), transient(unreachable.value)) == (False, False, True)


def test_a_producer_rides_out_an_unreachable_cluster_not_a_command_across_slots(app, cluster, queues,
                                                                               warnings):  # noqa: F811
    """A producer's request across slots is raised at once, with no warning (it was sent
    again for the whole enqueue_retry bound, 15 s by default, then raised); one to a cluster
    no node of which answers is ridden out, as before."""
    app.configure(redis_url=cluster.url(), enqueue_retry=1)

    def across_slots() -> steps.Steps[Any]:
        return (yield steps.Script(scripts.ENQUEUE, [app.keys.q(queues[0]), app.keys.q(queues[1])],
                                   [1, "x", 0, 1, "task", "t"]))

    with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
        steps.ride(app, across_slots(), "a test")
    assert warnings.outages() == 0, warnings.lines
    app.configure(redis_url="redis+cluster://127.0.0.1:1", enqueue_retry=0.3)
    with pytest.raises(redis.exceptions.RedisClusterException, match="cannot be connected"):
        apps.add.delay(1, 1)
    assert warnings.outages() == 1, warnings.lines


def test_a_wrong_password_to_a_cluster_is_raised_at_once(app, tmp_path, warnings):  # noqa: F811
    """redis-py's cluster client that reached no node raises RedisClusterException from
    the last node's error, here AuthenticationError: a producer raises it at once, as it does
    a wrong password to one Redis (it was ridden out for the whole bound)."""
    with Topology(tmp_path) as topology:
        node = topology.start()
        with node.client() as admin:
            admin.config_set("requirepass", "sesame")
        app.configure(redis_url=f"redis+cluster://:wrong@127.0.0.1:{node.port}", enqueue_retry=1)
        with pytest.raises(redis.exceptions.RedisClusterException, match="cannot be connected") as raised:
            apps.add.delay(1, 1)
    assert isinstance(raised.value.__cause__, redis.AuthenticationError)
    assert warnings.outages() == 0, warnings.lines


def test_declared_settings_and_queue_registration_on_a_cluster(capp, stack, cluster, queues):
    """Declarations live in each queue's slot, where enqueue.lua reads them; the global
    queue set is in another slot, so there the producer registers the queue (a script
    given both keys is refused by the cluster) and the dispatcher still promotes."""
    lane = capp.keys.q("lane")
    stack.worker(app="tests.declared_app", concurrency=1, name="declarer")
    stack.dispatcher()
    wait_for(lambda: capp.redis.zscore(capp.keys.workers, "declarer"), what="the worker's first heartbeat")
    job_id = stack.cli("enqueue", "tests.declared_app.flaky", "--args", '["c", 1]', check=True).stdout.strip()
    job = capp.job(job_id)
    assert (job.queue, job.data["max_duration"], job.data["retries"], job.data["timeout_policy"]) == \
        ("lane", "10", "3", "flag")
    assert job.wait(30) == "ok on try 1"
    with pytest.raises(Exception, match="CROSSSLOT|same key slot"):
        scripts.ENQUEUE(capp.redis, [lane, capp.keys.queues], [1, "x", 0, 1, "task", "t"])
    late = capp.enqueue("tests.nobody.declares", [1], queue=queues[1], delay=0.3)  # no worker serves it
    assert queues[1] in capp.queue_names()
    wait_for(lambda: late.refresh().state == "pending", what="the delayed job promoted")


def on_node(cluster: Cluster, capp, queue: str, job_id: str) -> dict[str, str]:
    """A job's record read on the primary of its queue's slot."""
    with cluster.owner(f"{{{queue}}}").client() as node:
        return node.hgetall(capp.keys.job(queue, job_id))


def outboxes(capp, queues: list[str]) -> int:
    """Entries left in the queues' outboxes."""
    return sum(capp.redis.xlen(joins.outbox(capp, q)) for q in queues)


def test_a_chain_over_three_slots_runs_each_step_once_in_order(capp, stack, cluster, queues):
    """Each step in another slot: a parent's finish leaves an entry in its outbox, which its
    worker carries to join.lua in the child's slot at once (no dispatcher runs here)."""
    stack.worker("-Q", ",".join(queues), name="w1")
    chain = (apps.counted.s(1, "c1").set(queue=queues[0]) | apps.counted.s("c2").set(queue=queues[1])
             | apps.counted.s("c3").set(queue=queues[2]) | apps.mul.s(10).set(queue=queues[0]))
    handle = chain.delay()
    assert handle.wait(30) == 40  # ((1 + 1) + 1) + 1, * 10
    assert [ledger(capp, k) for k in ("c1", "c2", "c3")] == [1, 1, 1]
    last = on_node(cluster, capp, queues[0], handle.id)
    assert (last["state"], last["args"], last["cross_slot"]) == ("completed", "[4,10]", "1")
    q, parent = last["parents"].split()
    step3 = on_node(cluster, capp, q, parent)
    assert q == queues[2] and step3["cross_children"] == f"{queues[0]} {handle.id} result"
    assert step3["children"] == f"{queues[0]} {handle.id}"
    wait_for(lambda: outboxes(capp, queues) == 0, what="the carrier to delete every entry it applied")
    graph = json.loads(stack.cli("workflow", handle.id, "--json", check=True).stdout)
    assert [(j["queue"], j["state"]) for j in graph["jobs"]] == [(q, "completed") for q in (*queues, queues[0])]


def test_a_chord_over_slots_writes_members_of_its_callbacks_queue_in_the_callbacks_call(capp, cluster, queues,
                                                                                       monkeypatch):
    """A chord over slots goes in calls by level (parents in other slots first); a member in
    the callback's own queue is written in the callback's call, not a call before it, where
    a worker could run it and see it fail before the callback existed (its enqueue was then
    refused: "parent … ended failed", CI)."""
    from taskrunner.client import steps

    calls: list[tuple[str, list[str]]] = []
    answer = steps._answer

    def recorded(app, r):
        if isinstance(r, steps.Enqueue):
            calls.append((r.queue, [job_id for job_id, _, _ in r.jobs]))
        return answer(app, r)

    monkeypatch.setattr(steps, "_answer", recorded)
    far, near = apps.add.s(1, 1).set(queue=queues[0]), apps.boom.s("no").set(queue=queues[2])
    handle = chord([far, near], apps.echo.s().set(queue=queues[2]), on_member_failure="continue").delay()
    parents = capp.redis.hget(capp.keys.q(queues[2]) + f"job:{handle.id}", "parents").split()
    far_id, near_id = parents[1], parents[3]
    # across()'s calls, level by level
    assert calls == [(queues[0], [far_id]), (queues[2], [near_id, handle.id])]


def test_a_chord_over_slots_gives_its_callback_every_result_in_order(capp, stack, cluster, queues):
    """Members in two slots, the callback in a third: each member's finish carries its result
    into the callback's slot (joined hash), and the last assembles them in the members' order.
    Then members in the callback's own slot and another, one failing with "continue": the
    callback's own-slot members are read from their records, the others from the hash."""
    stack.worker("-Q", ",".join(queues), concurrency=4)
    members = [apps.add.s(i, i).set(queue=queues[i % 2]) for i in range(10)]
    handle = chord(group(members), apps.tsum.s().set(queue=queues[2])).delay()
    assert handle.wait(30) == 90
    d = on_node(cluster, capp, queues[2], handle.id)
    assert d["args"] == "[[0,2,4,6,8,10,12,14,16,18]]" and d["cross_slot"] == "1"
    assert not capp.redis.exists(capp.keys.q(queues[2]) + f"joined:{handle.id}")  # gone once it was pending
    mixed = [apps.add.s(i, 1).set(queue=queues[2 * (i % 2)]) for i in range(4)]
    mixed[2] = apps.boom.s("no").set(queue=queues[2])
    handle = chord(mixed, apps.echo.s().set(queue=queues[2]), on_member_failure="continue").delay()
    assert handle.wait(30) == [1, 2, None, 4]
    wait_for(lambda: outboxes(capp, queues) == 0, what="the carrier to delete every entry it applied")


def test_callbacks_in_other_slots(capp, stack, cluster, queues):
    """on_success gets the result, on_failure the failure; the other ends canceled."""
    stack.worker("-Q", ",".join(queues), concurrency=2)
    ok = apps.add.apply_async((1, 2), queue=queues[0], on_success=apps.echo.s().set(queue=queues[1]),
                              on_failure=apps.echo.s().set(queue=queues[2]))
    assert ok.wait(30) == 3
    success, failure = on_node(cluster, capp, queues[0], ok.id)["cross_children"].split()[1::3]
    assert capp.job(success, queues[1]).wait(30) == 3
    wait_for(lambda: capp.job(failure, queues[2]).state == "canceled", what="on_failure canceled")
    bad = apps.boom.apply_async(("bad",), queue=queues[0], on_success=apps.echo.s().set(queue=queues[1]),
                                on_failure=apps.echo.s().set(queue=queues[2]))
    success, failure = on_node(cluster, capp, queues[0], bad.id)["cross_children"].split()[1::3]
    got = capp.job(failure, queues[2]).wait(30)
    assert (got["id"], got["state"], got["error"]) == (bad.id, "failed", "bad")
    wait_for(lambda: capp.job(success, queues[1]).state == "canceled", what="on_success canceled")


def test_a_failed_step_cancels_the_rest_of_a_chain_over_slots(capp, stack, cluster, queues):
    """The failure crosses two slots: step 2, canceled by join.lua in its slot, has a child in a
    third slot, which the same carrier's next round cancels, naming the step that failed."""
    stack.worker("-Q", ",".join(queues))
    handle = (apps.boom.s("down").set(queue=queues[0]) | apps.add.s(1).set(queue=queues[1])
              | apps.add.s(2).set(queue=queues[2])).delay()
    with pytest.raises(JobFailed, match="down") as e:
        handle.wait(30)
    last = on_node(cluster, capp, queues[2], handle.id)
    first = on_node(cluster, capp, queues[1], last["parents"].split()[1])["parents"].split()[1]
    assert (last["state"], last["canceled_by"]) == ("canceled", f"{queues[0]} {first}")
    assert f"step {first} (task tests.apps.boom) failed" in str(e.value)
    wait_for(lambda: outboxes(capp, queues) == 0, what="the carrier to delete every entry it applied")


def test_depends_on_jobs_of_another_slot(capp, stack, cluster, queues):
    """attach.lua records the edge in the parent's slot before the child is written; a parent
    that completed already leaves its entry at once (carried by the producer), one that failed
    is refused with nothing written."""
    done = apps.add.apply_async((1, 1), queue=queues[0])
    running = apps.hold.apply_async(["dep"], queue=queues[1])
    stack.worker("-Q", ",".join(queues), concurrency=2)
    assert done.wait(30) == 2
    started_pid(capp, "dep")
    after_done = apps.record.apply_async(["after-done"], queue=queues[2], depends_on=[done])
    assert after_done.wait(30) == 1
    after_both = apps.record.apply_async(["after-both"], queue=queues[2], depends_on=[done.id, running])
    assert after_both.refresh().state == "waiting"
    parent = on_node(cluster, capp, queues[1], running.id)
    assert parent["cross_children"] == f"{queues[2]} {after_both.id} -"
    release(capp, "dep")
    assert after_both.wait(30) == 1 and ledger(capp, "after-both") == 1
    failed = apps.boom.apply_async(("x",), queue=queues[0])
    with pytest.raises(JobFailed):
        failed.wait(30)
    before = {q: cluster.owner(f"{{{q}}}").client().dbsize() for q in queues}
    with pytest.raises(ValueError, match="ended failed: the job would never run"):
        apps.record.apply_async(["never"], queue=queues[2], depends_on=[failed])
    assert {q: cluster.owner(f"{{{q}}}").client().dbsize() for q in queues} == before
    wait_for(lambda: outboxes(capp, queues) == 0, what="the carrier to delete every entry it applied")


def test_an_entry_no_carrier_took_is_carried_by_the_dispatcher_once(capp, stack, cluster, queues):
    """A worker SIGKILLed between a parent's finish and its carry leaves the entry in the
    outbox: here a consumer finishes with finish.lua alone, as such a worker did. The
    dispatcher carries it; killed after join.lua applied an entry but before deleting it, the
    next one carries it again, and join.lua counts it once: the callback is enqueued once."""
    handle = chord(group(apps.add.s(i, 1).set(queue=queues[i]) for i in range(2)),
                   apps.tsum.s().set(queue=queues[2])).delay()
    consumer = Consumer(capp, queues[:2])
    held = consumer.claim(2)
    for d in held:
        answer = scripts.FINISH(capp.redis, [capp.keys.q(d.queue)],
                                finish_args(capp.settings, [Ended(d.id, d.attempt, Outcome.completed(
                                    str(d.args[0] + 1)))], 0))
        assert answer[0] == 1 and len(answer) == 2  # its answer, and the entry it left
    assert outboxes(capp, queues) == 2 and handle.refresh().state == "waiting"
    # A carrier that dies after join.lua but before XDEL: the first entry applied, not deleted.
    [entry] = joins.parse(capp.redis.xrange(joins.outbox(capp, queues[0])))
    f = entry.fields
    assert scripts.JOIN(capp.redis, [capp.keys.q(queues[2])], [
        3600, f["child"].split()[1], f["parent"], f["task"], f["state"], f["result"], "", "", ""]) == [1]
    assert on_node(cluster, capp, queues[2], handle.id)["waiting_on"] == "1"
    dispatcher = stack.dispatcher()
    wait_for(lambda: handle.refresh().state == "pending", what="the dispatcher to carry the entries")
    # join.lua made it pending; the XDEL of the entry that did follows it
    wait_for(lambda: outboxes(capp, queues) == 0, what="the dispatcher to delete the entries it carried")
    dispatcher.kill()
    dispatcher.wait()
    again = stack.dispatcher()  # restarted: nothing left to carry, nothing carried twice

    def passes() -> int:
        infos = [json.loads(v) for v in capp.redis.hgetall(capp.keys.dispatchers).values()]
        return max([i["passes"] for i in infos if i["pid"] == again.pid] or [0])

    wait_for(lambda: passes() >= 2, what="two passes of the restarted dispatcher")
    with cluster.owner(f"{{{queues[2]}}}").client() as node:
        assert node.lrange(capp.keys.q(queues[2]) + "pending", 0, -1) == [handle.id]
    stack.worker("-Q", queues[2])
    assert handle.wait(30) == 3  # [1, 2]


def test_a_child_written_after_its_parent_ended_takes_what_join_kept(capp, cluster, queues):
    """A producer writes a parent before its child in another slot: the parent may end, and
    its entry be carried, before the child exists. join.lua keeps the news in the child's
    slot (answer 2) and enqueue.lua applies it when the child comes."""
    parent_id, child_id = "early-parent", "early-child"
    assert scripts.ENQUEUE(capp.redis, [capp.keys.q(queues[0])], [
        1, parent_id, 0, 2, "task", "tests.apps.add", "cross_children", f"{queues[1]} {child_id} result"]) == [1]
    consumer = Consumer(capp, [queues[0]])
    [d] = consumer.claim(1)
    answer = scripts.FINISH(capp.redis, [capp.keys.q(queues[0])],
                            finish_args(capp.settings, [Ended(d.id, d.attempt, Outcome.completed("7"))], 0))
    assert answer[0] == 1
    [entry] = joins.split(answer, 1)[1]
    assert steps.run(capp, steps.carry(capp, [entry])) == 0  # kept for the child: answer 2
    assert scripts.ENQUEUE(capp.redis, [capp.keys.q(queues[1])], [
        1, child_id, 0, 4, "task", "tests.apps.echo", "parents", f"{queues[0]} {parent_id}", "takes", "result",
        "cross_slot", "1"]) == [1]
    child = on_node(cluster, capp, queues[1], child_id)
    assert (child["state"], child["args"], child["waiting_on"]) == ("pending", "[7]", "0")
    wait_for(lambda: outboxes(capp, queues) == 0, what="the carrier to delete every entry it applied")


def test_news_of_a_parent_the_child_does_not_list_is_not_counted(capp, cluster, queues):
    """A producer names a child in another slot (cross_children) before writing it; when a
    job with that id exists already (a workflow submitted again with fixed ids), the write
    changes nothing, and the parent's news must not count for that other job: it still
    waits for its own parent (it started without it, found in review)."""
    assert scripts.ENQUEUE(capp.redis, [capp.keys.q(queues[1])], [
        1, "x", 0, 4, "task", "tests.apps.add", "parents", f"{queues[2]} never-ends", "takes", "result",
        "cross_slot", "1"]) == [1]
    assert scripts.ENQUEUE(capp.redis, [capp.keys.q(queues[0])], [
        1, "p", 0, 2, "task", "tests.apps.add", "cross_children", f"{queues[1]} x result"]) == [1]
    assert scripts.ENQUEUE(capp.redis, [capp.keys.q(queues[1])], [
        1, "x", 0, 4, "task", "tests.apps.add", "parents", f"{queues[0]} p", "takes", "result",
        "cross_slot", "1"]) == [0]  # exists: nothing changed
    [d] = Consumer(capp, [queues[0]]).claim(1)
    answer = scripts.FINISH(capp.redis, [capp.keys.q(queues[0])],
                            finish_args(capp.settings, [Ended(d.id, d.attempt, Outcome.completed("7"))], 0))
    [entry] = joins.split(answer, 1)[1]
    assert steps.run(capp, steps.carry(capp, [entry])) == 0
    x = on_node(cluster, capp, queues[1], "x")
    assert (x["state"], x["waiting_on"]) == ("waiting", "1")
    wait_for(lambda: outboxes(capp, queues) == 0, what="the carrier to delete every entry it applied")


def test_a_workflow_a_later_slot_refuses_is_killed_where_it_was_written(capp, cluster, queues):
    """Across slots a workflow takes several calls: when a queue written after others is
    closed, the jobs written before are killed (they would run without the rest)."""
    capp.redis.hset(capp.keys.q(queues[1]) + "meta", "closed", "1")
    why = f"queue {queues[1]} is closed: the workflow was not enqueued \\(the jobs of it written before were killed: 1"
    with pytest.raises(QueueClosed, match=why):
        (apps.add.s(1, 2).set(queue=queues[0]) | apps.add.s(3).set(queue=queues[1])).delay()
    with cluster.owner(f"{{{queues[0]}}}").client() as node:
        [first] = node.zrange(capp.keys.q(queues[0]) + "killed", 0, -1)
        killed_by = node.hget(capp.keys.job(queues[0], first), "killed_by")
        assert killed_by.startswith("taskrunner: its workflow was refused")


def test_a_workflow_a_later_slot_fails_for_good_is_killed_where_it_was_written(capp, cluster, queues):
    """Across slots a workflow takes several calls: a call after others that fails for
    good with a Redis error (here the primary of its slot refuses writes, out of memory: no
    retry ends that) left the jobs written before enqueued, to run without the rest (only
    a queue's refusal killed them, found by review). They are killed, and the error says so.
    The primary refusing is not the one of the global keys, where the first call registers
    its queue, and the scripts are loaded before it refuses."""
    node = cluster.owner(f"{{{queues[1]}}}")
    later, first = (queues[1], queues[0]) if node.port != cluster.owner(capp.keys.g).port else (queues[0], queues[1])
    for q in (first, later):  # the scripts' library loaded on every primary (a load is a write)
        apps.add.apply_async((0, 0), queue=q)
    with cluster.owner(f"{{{later}}}").client() as admin:
        admin.config_set("maxmemory", "1")
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError) as refused:
                (apps.add.s(1, 2).set(queue=first) | apps.add.s(3).set(queue=later)).delay()
        finally:
            admin.config_set("maxmemory", "0")
    assert "the jobs of it written before were killed: 1" in str(refused.value), str(refused.value)
    with cluster.owner(f"{{{first}}}").client() as r:
        [step] = r.zrange(capp.keys.q(first) + "killed", 0, -1)
        killed = r.hmget(capp.keys.job(first, step), "state", "killed_by")
    assert killed == ["killed", f"taskrunner: its workflow could not be written to queue {later}"]


def test_a_workflow_whose_written_jobs_cannot_be_killed_names_them(capp, cluster, queues, monkeypatch):
    """As above, and the primary of the first call refuses writes too once that call went
    through (set as the second call is sent): the kill fails, and the error names the job
    left, which the caller kills."""
    node = cluster.owner(f"{{{queues[1]}}}")
    later, first = (queues[1], queues[0]) if node.port != cluster.owner(capp.keys.g).port else (queues[0], queues[1])
    for q in (first, later):  # the scripts' library loaded on every primary (a load is a write)
        apps.add.apply_async((0, 0), queue=q)
    admins = [cluster.owner(f"{{{q}}}").client() for q in (first, later)]
    answer = steps._answer

    def full_as_the_second_call_goes(app, r):
        if isinstance(r, steps.Enqueue) and r.queue == later:
            for admin in admins:
                admin.config_set("maxmemory", "1")
        return answer(app, r)

    monkeypatch.setattr(steps, "_answer", full_as_the_second_call_goes)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError) as refused:
            (apps.add.s(1, 2).set(queue=first) | apps.add.s(3).set(queue=later)).delay()
    finally:
        for admin in admins:
            admin.config_set("maxmemory", "0")
            admin.close()
    said = str(refused.value)
    assert "could not be killed (OutOfMemoryError" in said and "kill them (taskrunner kill ID)" in said, said
    [left] = [i for q, i in (p.split() for p in said.split("may run: ")[1].split(";")[0].split(", ")) if q == first]
    assert capp.job(left, first).kill() == "killed"


def test_a_workflow_a_later_slot_refuses_kills_only_the_jobs_this_call_wrote(capp, cluster, queues):
    """A step whose id existed before the call (enqueued before: a workflow given again with
    its ids, or another's) is answered 0 by its write; when a later slot refused the
    workflow, that job was killed with the ones this call wrote, with its children (found by
    review). Only those this call wrote (answered 1) are killed; the error names the other,
    and says that the workflow goes again with new ids."""
    old = apps.add.apply_async((1, 2), queue=queues[0], job_id="before-wf")
    capp.redis.hset(capp.keys.q(queues[1]) + "meta", "closed", "1")
    with pytest.raises(QueueClosed) as refused:
        chain(apps.add.s(1, 2).set(queue=queues[0], job_id="before-wf"), apps.add.s(3).set(queue=queues[2]),
              apps.add.s(4).set(queue=queues[1])).delay()
    said = str(refused.value)
    assert "the jobs of it written before were killed: 1; to enqueue it again, give them new ids" in said, said
    assert ("already existed (this call's earlier try whose answer was lost, or enqueued before): "
            f"not killed: {queues[0]} before-wf)") in said, said
    assert old.refresh().state == "pending"
    with cluster.owner(f"{{{queues[2]}}}").client() as node:
        [second] = node.zrange(capp.keys.q(queues[2]) + "killed", 0, -1)
    assert refused.value.withdrawn == [(queues[2], second)]


def test_enqueue_many_says_which_jobs_a_lone_call_withdrew(capp, cluster, queues):
    """enqueue_many writes a job whose callbacks are in another queue (slot) by a call of its
    own; when the callback's queue refuses, across() kills the job written: it was reported
    unsure, and given its id again (as .unsure says) it added nothing, never to run (found by
    review). It is in `.withdrawn`, given again with a new id it runs."""
    capp.redis.hset(capp.keys.q(queues[1]) + "meta", "closed", "1")
    given = [{"task": "tests.apps.add", "args": [1, 1], "queue": queues[0]},
             {"task": "tests.apps.add", "args": [2, 2], "queue": queues[0], "id": "lone",
              "on_success": {"task": "tests.apps.echo", "queue": queues[1]}}]
    with pytest.raises(QueueClosed) as refused:
        capp.enqueue_many(given)
    e = refused.value
    assert ([j.id for j in e.withdrawn], e.unsure, e.refused) == (["lone"], [], []), str(e)
    assert [(j.refresh().state, j.to_dict()["args"]) for j in e.enqueued] == [("pending", [1, 1])]
    assert "1 withdrawn (killed: enqueue them with new ids)" in str(e), str(e)
    assert capp.job("lone", queues[0]).state == "killed"
    capp.redis.hdel(capp.keys.q(queues[1]) + "meta", "closed")
    [again] = capp.enqueue_many([{**given[1], "id": "lone-2"}])
    assert again.created and again.refresh().state == "pending"


def test_workflows_over_slots_survive_killed_workers_and_a_restarted_dispatcher(capp, stack, cluster, queues):
    """Chaos: a chord of 40 members in two slots with its callback in a third, and a chain of
    6 steps going round the three slots, while workers are SIGKILLed again and again (between
    a finish and its carry too, as it happens) and the dispatcher is restarted. Every member
    and step runs (at least once); each join counts once, so the callback gets every result,
    in order, and the chain its sum."""
    members = [apps.slow_counted.s(i, f"m{i}", 0.05).set(queue=queues[i % 2]) for i in range(40)]
    handle = chord(group(members), apps.echo.s().set(queue=queues[2])).delay()
    steps = [apps.slow_counted.s(0, "s0", 0.1).set(queue=queues[0])]
    steps += [apps.slow_counted.s(f"s{k}", 0.1).set(queue=queues[k % 3]) for k in range(1, 6)]
    tail = chain(*steps).delay()
    keys = [f"m{i}" for i in range(40)] + [f"s{k}" for k in range(6)]

    def runs() -> int:
        pipe = capp.redis.pipeline(transaction=False)  # one GET a key: the keys are in many slots
        for k in keys:
            pipe.get(f"{capp.settings.prefix}:ledger:{k}")
        return sum(int(n or 0) for n in pipe.execute())

    dispatcher = stack.dispatcher()
    for round_ in range(8):
        before = runs()
        w = stack.worker("-Q", ",".join(queues), concurrency=2)
        # Killed once it ran a few more jobs (or all are done): in the middle of the work.
        wait_for(lambda before=before: runs() >= min(before + 3, 46) or handle.refresh().state == "completed",
                 what="the worker to run some jobs")
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
        if round_ == 3:
            dispatcher.kill()
            dispatcher.wait()
            dispatcher = stack.dispatcher()
    stack.worker("-Q", ",".join(queues), concurrency=2)
    assert handle.wait(120) == list(range(1, 41))
    assert tail.wait(120) == 6
    assert all(ledger(capp, f"m{i}") >= 1 for i in range(40))
    assert all(ledger(capp, f"s{k}") >= 1 for k in range(6))
    wait_for(lambda: outboxes(capp, queues) == 0, what="every outbox entry carried")


def test_asyncio_client_writes_workflows_over_slots(capp, stack, cluster, queues):
    """AsyncClient writes what TaskRunner writes across slots (the same steps: parents before
    children, level by level): a chain over three slots, a chord whose members are in two
    slots and its callback in a third, and enqueue with depends_on on a completed job and callbacks in others."""
    stack.worker("-Q", ",".join(queues), concurrency=2)

    async def main() -> tuple[str, str, str, str, list[str]]:
        client = AsyncClient(capp)
        try:
            first = await client.enqueue("tests.apps.add", [20, 1], queue=queues[0])
            assert await client.wait(first, 30) == 21  # completed: attach.lua answers its entry, carried here
            after = await client.enqueue("tests.apps.add", [2, 21], queue=queues[1], depends_on=[first],
                                         on_success=apps.echo.s().set(queue=queues[2]))
            last = await client.apply(apps.counted.s(1, "ac1").set(queue=queues[0])
                                      | apps.counted.s("ac2").set(queue=queues[1])
                                      | apps.counted.s("ac3").set(queue=queues[2]))
            callback = await client.apply(chord([apps.add.s(i, i).set(queue=queues[i % 2]) for i in range(6)],
                                                apps.tsum.s().set(queue=queues[2])))
            members = await client.apply(group(apps.add.s(i, 1).set(queue=q) for i, q in enumerate(queues)))
            assert await client.wait(last, 30) == 4 and await client.wait(callback, 30) == 30
            return last, callback, first, after, members
        finally:
            await client.close()

    last, callback, first, after, members = asyncio.run(main())
    assert [ledger(capp, k) for k in ("ac1", "ac2", "ac3")] == [1, 1, 1]
    step3 = on_node(cluster, capp, queues[2], last)
    assert (step3["args"], step3["cross_slot"]) == ('[3,"ac3"]', "1")
    assert capp.job(callback, queues[2]).refresh().data["args"] == "[[0,2,4,6,8,10]]"
    assert [capp.job(m, q).wait(30) for m, q in zip(members, queues)] == [1, 2, 3]
    assert on_node(cluster, capp, queues[0], first)["children"] == f"{queues[1]} {after}"
    assert capp.job(after, queues[1]).wait(30) == 23
    [callback_of_after] = on_node(cluster, capp, queues[1], after)["cross_children"].split()[1:2]
    assert capp.job(callback_of_after, queues[2]).wait(30) == 23
    wait_for(lambda: outboxes(capp, queues) == 0, what="every outbox entry carried")


def test_a_workflow_across_slots_sent_again_adds_nothing(capp, queues):
    """A workflow across slots given again (its ids the same: a caller that did not hear
    whether it went through) is written again by canvas.across(), which must leave the jobs
    it was given as they were (it adds cross_slot and cross_children to copies): the second
    run finds every job there, adds none and refuses nothing."""
    from taskrunner.client import canvas

    sigs = (apps.add.s(1, 2).set(queue=queues[0]) | apps.add.s(3).set(queue=queues[1])).steps
    first, second = steps.run(capp, canvas.make_drafts(capp, sigs, 1))
    second.fields += ["parents", f"{first.queue} {first.id}", "takes", "result"]
    jobs = [(d.id, d.delay, d.fields) for d in (first, second)]
    assert steps.run(capp, canvas.across(capp, jobs, queues[0])) == [1, 1]
    assert steps.run(capp, canvas.across(capp, jobs, queues[0])) == [0, 0]
    produced = [capp.redis.hget(capp.keys.q(q) + "meta", "produced_messages") for q in queues[:2]]
    assert produced == ["1", "1"]


def test_enqueue_many_with_depends_on_across_slots(capp, stack, cluster, queues):
    """enqueue_many's items may name parents in other queues (other slots): earlier items of the
    call (written first) and existing jobs, with callbacks in yet another slot."""
    old = apps.add.apply_async((1, 1), queue=queues[2])
    jobs = capp.enqueue_many([
        {"task": "tests.apps.add", "args": [1, 2], "queue": queues[0], "id": "em-a"},
        {"task": "tests.apps.add", "args": [3, 4], "queue": queues[0], "id": "em-b"},
        {"task": "tests.apps.add", "args": [10, 0], "queue": queues[1], "id": "em-c", "depends_on": ["em-a"]},
        {"task": "tests.apps.record", "args": ["em-d"], "queue": queues[2], "id": "em-d",
         "depends_on": ["em-b", "em-c", old.id], "on_success": {"task": "tests.apps.echo", "queue": queues[0]}},
        {"task": "tests.apps.add", "args": [5, 5], "queue": queues[1], "id": "em-e"},
    ])
    assert [(j.id, j.queue, j.created) for j in jobs] == [
        ("em-a", queues[0], True), ("em-b", queues[0], True), ("em-c", queues[1], True), ("em-d", queues[2], True),
        ("em-e", queues[1], True)]
    d = on_node(cluster, capp, queues[2], "em-d")
    assert (d["state"], d["cross_slot"], d["waiting_on"]) == ("waiting", "1", "3")
    assert on_node(cluster, capp, queues[0], "em-b")["cross_children"] == f"{queues[2]} em-d -"
    stack.worker("-Q", ",".join(queues), concurrency=2)
    assert capp.job("em-d", queues[2]).wait(30) == 1 and ledger(capp, "em-d") == 1
    [callback] = on_node(cluster, capp, queues[2], "em-d")["cross_children"].split()[1:2]
    assert capp.job(callback, queues[0]).wait(30) == 1
    assert capp.job("em-e", queues[1]).wait(30) == 10
    wait_for(lambda: outboxes(capp, queues) == 0, what="every outbox entry carried")


def test_node_client_writes_workflows_over_slots(capp, stack, cluster, queues):
    """The Node client on a redis+cluster:// URL writes a chain over three slots, a chord
    across slots and depends_on on a completed job of another slot as the Python producer
    does (parents first, cross_children, attach.lua, the news it answers carried); Python
    workers run them. Its consumer refuses a cluster in one line."""
    need_node()
    done = apps.add.apply_async((20, 1), queue=queues[2])
    stack.worker("-Q", ",".join(queues), concurrency=2)
    assert done.wait(30) == 21
    got = node_script(stack, f"""
      const q = {json.dumps(queues)};
      const last = await tr.chain([{{ task: 'tests.apps.counted', args: [1, 'nc1'], queue: q[0] }},
        {{ task: 'tests.apps.counted', args: ['nc2'], queue: q[1] }},
        {{ task: 'tests.apps.counted', args: ['nc3'], queue: q[2] }}]);
      const members = [0, 1, 2, 3].map((i) => ({{ task: 'tests.apps.add', args: [i, i], queue: q[i % 2] }}));
      const chord = await tr.chord(members, {{ task: 'tests.apps.tsum', queue: q[2] }});
      const after = await tr.enqueue('tests.apps.add', [1, 1], {{}}, {{ queue: q[0], dependsOn: ['{done.id}'],
        onSuccess: {{ task: 'tests.apps.echo', queue: q[1] }} }});
      let refused = null;
      try {{ new Consumer(tr, {{}}); }} catch (e) {{ refused = e.message; }}
      console.log(JSON.stringify({{ last, chord, after, refused }}));""")
    assert capp.job(got["last"]["id"], queues[2]).wait(30) == 4
    assert [ledger(capp, k) for k in ("nc1", "nc2", "nc3")] == [1, 1, 1]
    step3 = on_node(cluster, capp, queues[2], got["last"]["id"])
    q, parent = step3["parents"].split()
    assert (q, step3["cross_slot"]) == (queues[1], "1")
    assert on_node(cluster, capp, q, parent)["cross_children"] == f"{queues[2]} {got['last']['id']} result"
    assert capp.job(got["chord"]["id"], queues[2]).wait(30) == 12
    assert capp.job(got["after"]["id"], queues[0]).wait(30) == 2
    assert on_node(cluster, capp, queues[2], done.id)["children"] == f"{queues[0]} {got['after']['id']}"
    [callback] = on_node(cluster, capp, queues[0], got["after"]["id"])["cross_children"].split()[1:2]
    assert capp.job(callback, queues[1]).wait(30) == 2
    assert got["refused"] == "the Node consumer needs one Redis server, not a Redis Cluster (README: Limits)"
    wait_for(lambda: outboxes(capp, queues) == 0, what="every outbox entry carried")


# -- sharded queues (issue 18) ------------------------------------------------------------


@pytest.fixture
def sharded(capp, cluster) -> str:
    """A queue of 3 shards whose slots are on the three primaries."""
    for i in range(1000):
        if len({cluster.owner(f"{{{s}}}").port for s in shards.names(f"sh{i}", 3)}) == 3:
            queue_ops.create(capp, f"sh{i}", shards=3)
            return f"sh{i}"
    raise AssertionError("no queue whose 3 shards are on three primaries")


def test_a_sharded_queue_spreads_over_the_primaries_and_runs_each_job_once(capp, stack, cluster, sharded):
    stack.dispatcher()
    stack.worker("-Q", sharded, name="w1", concurrency=3)
    jobs = [apps.add.apply_async([i, 1], queue=sharded) for i in range(30)]
    jobs += capp.enqueue_many({"task": "tests.apps.add", "args": [i, 2], "queue": sharded} for i in range(15))

    async def produce() -> list[str]:
        client = AsyncClient(capp)
        try:
            return [await client.enqueue("tests.apps.add", [i, 3], queue=sharded) for i in range(6)]
        finally:
            await client.close()

    jobs += [capp.job(i) for i in asyncio.run(produce())]
    assert [j.wait(30) for j in jobs] == [i + 1 for i in range(30)] + [i + 2 for i in range(15)] + \
        [i + 3 for i in range(6)]
    by_shard: dict[str, list] = {}
    for j in jobs:
        by_shard.setdefault(j.queue, []).append(j)
    assert sorted(by_shard) == shards.names(sharded, 3) and all(len(v) == 17 for v in by_shard.values())
    for q, done in by_shard.items():  # each shard's records on its own primary, each run once
        with cluster.owner(f"{{{q}}}").client() as node:
            assert {node.hget(capp.keys.job(q, j.id), "state") for j in done} == {"completed"}
            assert {node.hget(capp.keys.job(q, j.id), "attempts") for j in done} == {"1"}
    [row] = [s for s in listing.queue_stats(capp) if s["name"] == sharded]
    assert row["completed"] == 51 and row["shards"] == 3
    # The worker waits on every shard's wake list, each on its own primary: one job on each wakes it.
    for s in shards.names(sharded, 3):
        with cluster.owner(f"{{{s}}}").client() as node:
            wait_for(lambda node=node: node.info("clients")["blocked_clients"] >= 1, what="a BRPOP on each primary")
    late = [apps.add.apply_async([i, 0], queue=sharded) for i in range(3)]
    assert sorted(j.queue for j in late) == shards.names(sharded, 3)
    assert [j.wait(30) for j in late] == [0, 1, 2]


def test_a_sigkilled_worker_loses_nothing_of_a_sharded_queue_on_a_cluster(capp, stack, cluster, sharded):
    stack.dispatcher()
    w1 = stack.worker("-Q", sharded, name="w1", concurrency=3)
    held = [apps.hold.apply_async([f"c{i}"], queue=sharded) for i in range(3)]
    assert sorted(j.queue for j in held) == shards.names(sharded, 3)
    for i in range(3):
        started_pid(capp, f"c{i}")
    os.killpg(w1.pid, signal.SIGKILL)
    w1.wait()
    stack.worker("-Q", sharded, name="w2", concurrency=3)
    for i in range(3):
        started_pid(capp, f"c{i}", 2)
        release(capp, f"c{i}")
    assert [j.wait(60) for j in held] == ["released"] * 3
    assert [(j.refresh().data["worker"], j.to_dict()["attempts"]) for j in held] == [("w2", 2)] * 3
    queue_ops.pause(capp, sharded)  # pause and resume reach every shard's primary
    paused = [apps.add.apply_async([i, 0], queue=sharded) for i in range(3)]
    assert {j.refresh().state for j in paused} == {"pending"}
    queue_ops.resume(capp, sharded)
    assert [j.wait(30) for j in paused] == [0, 1, 2]


def blocked_on_every_shard(cluster: Cluster, queue: str) -> bool:
    """Whether a client blocks (a BRPOP) on the primary of each of the 3 shards of `queue`."""
    for s in shards.names(queue, 3):
        with cluster.owner(f"{{{s}}}").client() as node:
            if node.info("clients")["blocked_clients"] < 1:
                return False
    return True


def test_wake_tokens_that_come_together_on_every_shard_each_bring_a_claim(capp, stack, cluster, sharded):
    """Jobs enqueued at once on every shard of an idle worker's queue: each shard's wake token
    answers one of the worker's BRPOPs (one per primary). Woken by the first, the worker closed
    the others' connections, and a token already on its way was lost: the jobs of those shards
    waited for its idle block (60 s here) before a claim found them (a sharded queue drained at
    62 jobs/s in bench/cluster.py)."""
    stack.worker("-Q", sharded, name="w1", concurrency=3, env={"TASKRUNNER_IDLE_BLOCK": "60"})
    for i in range(5):
        wait_for(lambda: blocked_on_every_shard(cluster, sharded), what="the worker's BRPOP on each primary")
        jobs = capp.enqueue_many({"task": "tests.apps.add", "args": [i, k], "queue": sharded} for k in range(3))
        assert sorted(j.queue for j in jobs) == shards.names(sharded, 3)
        assert [j.wait(20) for j in jobs] == [i, i + 1, i + 2]


def test_a_consumers_wake_tokens_that_come_together_on_every_shard_each_bring_a_claim(capp, cluster, sharded):
    """The Consumer's blocking claim, as the worker's above: woken by one shard's token, it
    closed its BRPOPs on the other primaries, and dropped the other tokens that came with the
    first; a token lost so left the next claim that started at an empty shard asleep for its
    block (5 s) while another shard had a job. Tokens that come once it is woken go back to
    their list, so each job is claimed at once, and none is left armed between claims."""
    consumer = Consumer(capp, [sharded], name="c1")
    try:
        for i in range(5):
            first: list = []
            waiter = threading.Thread(target=lambda got=first: got.extend(consumer.claim(1, block=30)))
            waiter.start()
            wait_for(lambda: blocked_on_every_shard(cluster, sharded), what="the consumer's BRPOP on each primary")
            jobs = capp.enqueue_many({"task": "tests.apps.add", "args": [i, k], "queue": sharded} for k in range(3))
            waiter.join(30)
            assert not waiter.is_alive() and len(first) == 1
            # the two tokens of the shards not claimed from are back on their lists (dropped,
            # the next claim that starts at one of those shards would sleep its whole block)
            tokens = sum(capp.redis.llen(capp.keys.q(s) + "wake") for s in shards.names(sharded, 3))
            assert tokens == 2, f"round {i}: {tokens} wake tokens left for the two shards' jobs"
            got = first + consumer.claim(1, block=30)
            got += consumer.claim(1, block=30)
            assert sorted(d.id for d in got) == sorted(j.id for j in jobs)
            assert consumer.ack(got) == [True] * 3
            for n in cluster.primaries:  # between claims no BRPOP of ours holds a token others may need
                with n.client() as node:
                    assert node.info("clients")["blocked_clients"] == 0
    finally:
        consumer.close()


def spreads(cluster: Cluster, queue: str) -> dict[int, list[int]]:
    """For each shard count n (1 to shards.MAX), the shards of `queue` on each primary (by
    port), by the cluster's own CLUSTER KEYSLOT and CLUSTER SLOTS (not redis-py's slot map,
    which the CLI reads)."""
    with cluster.primaries[0].client() as c:
        ranges = [(start, end, int(port)) for start, end, (_, port, *_) in c.execute_command("CLUSTER", "SLOTS")]
        pipe = c.pipeline(transaction=False)
        for s in shards.names(queue, shards.MAX):
            pipe.execute_command("CLUSTER", "KEYSLOT", f"{{{s}}}")
        owners = [next(port for start, end, port in ranges if start <= slot <= end) for slot in pipe.execute()]
    ports = sorted(node.port for node in cluster.primaries)
    return {n: [owners[:n].count(p) for p in ports] for n in range(1, shards.MAX + 1)}


def even(counts: list[int]) -> bool:
    return max(counts) - min(counts) <= 1


def per_primary_line(cluster: Cluster, counts: list[int]) -> str:
    ports = sorted(node.port for node in cluster.primaries)
    return f"shards per primary: {', '.join(map(str, counts))} ({', '.join(f'127.0.0.1:{p}' for p in ports)})"


def test_queue_create_warns_of_shards_that_fall_unevenly_and_names_counts_that_spread_evenly(capp, stack, cluster):
    """CRC16 decides where each shard's slot is: 3 shards on 3 primaries fall one on each for
    about 22% of names. `queue create` says how they fell and, when unevenly, the smallest
    shard counts that put a fair share on every primary (those the cluster's own slot map
    says spread evenly); for about a tenth of uneven names no count up to 64 does."""
    layouts = {f"un{i}": spreads(cluster, f"un{i}") for i in range(200)}
    fixable = {q: [k for k in range(3, shards.MAX + 1) if even(by[k])][:3] for q, by in layouts.items()
               if not even(by[3])}
    name, suggested = next((q, ks) for q, ks in fixable.items() if ks)
    r = stack.cli("queue", "create", name, "--shards", "3", "--bound", "99", check=True)
    fell = layouts[name][3]
    assert r.stdout.splitlines() == [f"queue {name}: bound 99, 3 shards", per_primary_line(cluster, fell)]
    assert r.stderr.splitlines() == [  # the command it names need not repeat the bound: queue create keeps it
        f"warning: the 3 shards of queue {name} fall unevenly on the 3 primaries: {', '.join(map(str, suggested))} "
        f"shards would spread this name evenly (taskrunner queue create {name} --shards {suggested[0]}, "
        "while it has no unfinished job)"]
    info = json.loads(stack.cli("queue", "info", name, "--json", check=True).stdout)["placement"]
    ports = sorted(node.port for node in cluster.primaries)
    assert info == {"per_primary": {f"127.0.0.1:{p}": c for p, c in zip(ports, fell)},
                    "uneven": True, "even_shard_counts": suggested}
    assert '"uneven": true' in stack.cli("queue", "info", name, check=True).stdout  # JSON, not Python's repr

    r = stack.cli("queue", "create", name, "--shards", str(suggested[0]), check=True)  # as the warning said
    assert r.stdout.splitlines() == [f"queue {name}: bound 99, {suggested[0]} shards",
                                     per_primary_line(cluster, layouts[name][suggested[0]])] and r.stderr == ""
    rows = json.loads(stack.cli("queues", "--shards", "--json", check=True).stdout)
    primaries = {row["name"]: row["primary"] for row in rows if shards.logical(row["name"]) == name}
    assert primaries == {s: f"127.0.0.1:{cluster.owner(f'{{{s}}}').port}" for s in shards.names(name, suggested[0])}
    assert f"primary=127.0.0.1:{cluster.owner(f'{{{name}~1}}').port}" in stack.cli("queues", "--shards").stdout

    hopeless = next(q for q, ks in fixable.items() if not ks)
    r = stack.cli("queue", "create", hopeless, "--shards", "3", check=True)
    assert r.stderr == (f"warning: the 3 shards of queue {hopeless} fall unevenly on the 3 primaries: no shard count "
                        "up to 64 spreads this name evenly\n")


def test_queue_create_gives_no_warning_for_shards_one_on_each_primary(capp, stack, cluster, sharded):
    r = stack.cli("queue", "create", sharded, "--shards", "3", check=True)
    assert r.stdout.splitlines()[1] == per_primary_line(cluster, [1, 1, 1]) and r.stderr == ""
    assert json.loads(stack.cli("queue", "info", sharded, "--json", check=True).stdout)["placement"]["uneven"] is False


def incr_each(r, counters: list[str]) -> scripts.Batch:
    """A batch that INCRs each counter (one per primary: what ran where, and how often)."""
    batch = scripts.Batch(r)
    for key in counters:
        batch.pipe.incr(key)
    return batch


def test_a_blocking_take_waits_for_every_batch_in_flight_not_the_last_alone(capp, cluster, queues):
    """take(block=True) (a worker's reconcile, its goodbye) waits for every batch in flight:
    it waited for the last one's answers only, which on a cluster may come from another
    primary first, and returned with an earlier batch (a claim, a heartbeat) unanswered
    (found by review: a reconcile then requeued jobs whose claim was about to land)."""
    r = capp.redis
    channel = ClusterChannel.of(r)
    assert channel is not None
    slow, fast = (capp.keys.q(q) + "x" for q in queues[:2])  # on two primaries
    with cluster.owner(f"{{{queues[0]}}}").client() as node:
        node.execute_command("CLIENT", "PAUSE", 1500, "WRITE")  # the first's primary holds its writes a while
        try:
            channel.send([("SET", slow, "1")])
            channel.send([("GET", fast)])  # answered at once
            assert len(channel.take(block=True)) == 2
        finally:
            node.execute_command("CLIENT", "UNPAUSE")
            channel.close()


def test_a_lean_sync_to_a_slot_that_moved_fails_and_the_next_goes_to_its_new_owner(capp, cluster, queues):
    """A worker's syncs on a cluster go past redis-py (links.ClusterChannel: each
    command to the primary of its slot, on a connection of our own) by redis-py's slot map.
    A slot that moved since answers MOVED: the command did not run there, and Batch.settle
    fails the sync as a lost connection (the worker reconciles; a command run again through
    redis-py could be sent twice by its retries), running nothing again; once the channel is
    closed, as the worker does, the next sync reads the layout and goes to the new owner."""
    r = capp.redis
    channel = ClusterChannel.of(r)
    assert channel is not None
    counters = [capp.keys.q(q) + "lean" for q in queues]  # one per primary: INCR counts the runs

    def sync() -> tuple[list, list]:
        batch = incr_each(r, counters)
        info = json.dumps({"name": "lean", "host": "h", "pid": 1})
        batch.call(scripts.HEARTBEAT, [capp.keys.g], ["lean", info, 60])  # a script call, routed by its key
        channel.send(batch.commands())
        got: list = []
        while not got:  # answered from three primaries, taken once all have
            got = channel.take()
        [answers] = got
        return list(answers), batch.settle(answers)

    answers, results = sync()  # a node that lacks the library answers "Function not found": loaded, run again
    assert results[:3] == [1, 1, 1]
    source = cluster.owner(f"{{{queues[0]}}}")
    target = next(n for n in cluster.primaries if n is not source)
    cluster.move_slot(f"{{{queues[0]}}}", target)  # the client's map still names `source`
    with pytest.raises(redis.ConnectionError, match="layout changed"):
        sync()
    with target.client() as node:
        assert node.get(counters[0]) == "1"  # moved with its slot, and not run again
    channel.close()  # what the worker's _redis_failed() does
    answers, results = sync()  # the layout read anew
    assert results[:3] == [2, 3, 3] and not any(isinstance(a, Exception) for a in answers)
    channel.close()


def test_a_wake_token_given_back_by_a_sync_that_failed_goes_back_with_the_next(capp, cluster, sharded):
    """A worker gives back a token it took but will not use (a cluster's BRPOP per shard)
    in its next sync; a sync that failed may not have run: the token goes again with the
    next (a list holds one token at most, so twice is once)."""
    from taskrunner.worker.main import Flight, Worker
    from taskrunner.worker.outbox import Load

    w = Worker(capp, [sharded], concurrency=1, name="giver")
    w._check_name_free()
    wake = capp.keys.q(shards.name(sharded, 1)) + "wake"
    w.reconcile = False
    w._give_back(wake)
    w._give_back(wake)  # twice: one token
    assert w.gifts == [wake]
    w.flights.append(Flight(scripts.Batch(capp.redis), Load(), [], [], [], w.gifts))  # in flight, then lost
    w.gifts = []
    w._redis_failed(redis.ConnectionError("lost"))
    assert w.gifts == [wake] and capp.redis.llen(wake) == 0
    w.redis_ok_at = 0.0
    w._sync(wait=True)
    assert capp.redis.llen(wake) == 1 and w.gifts == [] and not w.flights
    capp.redis.delete(wake)
    assert w.channel is not None
    w.channel.close()


def test_a_busy_workers_claim_that_finds_its_shard_short_goes_on_to_the_next(capp, cluster, sharded):
    """On a cluster a claim asks one shard of a sharded queue. A busy worker's claim that found
    its shard short claims from the next shard at once, rather than waiting on every shard's
    wake list (an idle round: with shards drained unevenly every other claim found an empty
    shard, and each cost a BRPOP per shard and their tokens given back); after every other
    shard once in a row, or after a probe (the queues were found empty before), it waits."""
    from taskrunner.worker.main import Flight, Worker
    from taskrunner.worker.outbox import Load

    class Room:  # a child with room, as Crew.deliver sees one
        def flush(self) -> None:
            pass

    w = Worker(capp, [sharded], concurrency=1, name="passer")
    w._check_name_free()
    assert w.queues == shards.names(sharded, 3)

    def claimed_nothing(first: str, probe: bool = False) -> None:
        order = w.served.order(first)
        assert order[0] == first
        w.probing = probe  # what the claim was sent with
        w._landed(Flight(scripts.Batch(capp.redis), Load(), [(Room(), 0.0)], ["h"] * 6 + [1, ""], order, []), [[]])

    claimed_nothing(shards.name(sharded, 2))
    assert (w.woken, w.may_claim, w.probing) == (sharded, True, False)  # shard 0 next, at once
    claimed_nothing(sharded)
    assert (w.woken, w.may_claim, w.probing) == (shards.name(sharded, 1), True, False)
    claimed_nothing(shards.name(sharded, 1))  # every shard found short in a row: wait for a token
    assert (w.may_claim, w.probing) == (False, True)
    w.may_claim, w.woken = True, None
    claimed_nothing(sharded, probe=True)  # a probe found its shard short: wait
    assert (w.may_claim, w.probing) == (False, True)


def test_a_lean_sync_whose_connection_was_dropped_fails_and_the_next_reads_the_layout(capp, cluster, queues):
    """A primary that dropped the channel's connection (CLIENT KILL, a restart): a
    connection dropped while idle is replaced before the next sync is written (it would fail
    it, and the worker would back off and reconcile for nothing); one dropped with a sync in
    flight fails that sync with a connection error (the worker reconciles: nothing is sent
    again), the channel forgets its connections and what was in flight, and the next sync
    reads the cluster's layout anew and goes through."""
    r = capp.redis
    channel = ClusterChannel.of(r)
    assert channel is not None
    counters = [capp.keys.q(q) + "dropped" for q in queues]

    def send() -> list:
        batch = incr_each(r, counters)
        channel.send(batch.commands())
        return batch.settle(channel.take(block=True)[0])

    def kill(link) -> None:
        host, port = link.sock.getsockname()[:2]
        with next(n for n in cluster.primaries if n.port == link.conn.port).client() as node:
            assert node.client_kill(f"{host}:{port}")

    assert send() == [1, 1, 1]
    assert len(channel.links) == 3
    for link in channel.links.values():
        kill(link)
    wait_for(lambda: len(channel.poller.poll(0)) == 3, what="the closed connections to read as closed")
    assert send() == [2, 2, 2] and not channel.stale  # replaced before the sync: nothing failed
    link = next(iter(channel.links.values()))
    with next(n for n in cluster.primaries if n.port == link.conn.port).client() as node:
        node.execute_command("CLIENT", "PAUSE", "20000", "WRITE")  # our INCR waits there, unrun
        try:
            channel.send(incr_each(r, counters).commands())
            kill(link)
        finally:
            node.execute_command("CLIENT", "UNPAUSE")
    with pytest.raises(redis.ConnectionError):
        channel.take(block=True)
    assert channel.stale and not channel.links and not channel.spreads
    assert sorted(send()) == [3, 4, 4]  # the killed connection's command never ran
    channel.close()


def test_a_lean_sync_times_each_primary_from_its_own_last_answer(capp, cluster, queues):
    """A primary that stops answering is found within socket_timeout of what it owes,
    however often the others answer (they used to push the one deadline back), and a
    blocking take() gives up at that deadline rather than after each connection's own
    timeout in turn."""
    r = capp.redis
    channel = ClusterChannel.of(r)
    assert channel is not None and channel.timeout
    counters = [capp.keys.q(q) + "timed" for q in queues]

    def send() -> None:
        channel.send(incr_each(r, counters).commands())

    send()
    channel.take(block=True)
    stuck = next(iter(channel.links.values()))
    with next(n for n in cluster.primaries if n.port == stuck.conn.port).client() as node:
        node.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # it answers nothing meanwhile
        try:
            send()
            first = channel.deadline()
            assert first == stuck.heard + channel.timeout
            wait_for(lambda: not channel.take() and all(not x.owed for x in channel.links.values() if x is not stuck),
                     what="the other primaries' answers")
            send()  # the others answer again; the stuck one still owes the first
            wait_for(lambda: not channel.take() and all(not x.owed for x in channel.links.values() if x is not stuck),
                     what="the other primaries' answers")
            assert channel.deadline() == first
            with pytest.raises(redis.TimeoutError):
                channel.take(block=True)
        finally:
            node.execute_command("CLIENT", "UNPAUSE")
    assert channel.stale and not channel.links
    channel.close()
