"""A Redis Cluster failover: three primaries, each with a replica, on loopback; a primary
SIGKILLed mid-drain, its replica promoted by the cluster itself (no Sentinel). Workers
and a dispatcher reached through a redis+cluster:// URL carry on without a restart, and
every job that was enqueued and replicated before the kill completes, at least once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from taskrunner.client.aio import AsyncClient
from taskrunner.errors import JobNotFound
from taskrunner.protocol import shards
from tests import apps
from tests.conftest import Stack, kill_groups, wait_for
from tests.test_cluster import blocked_on_every_shard, capp, sharded  # noqa: F401 (fixtures)
from tests.topologies import Cluster, Node, Topology, redis_cluster


@pytest.fixture
def topology(tmp_path):
    with Topology(tmp_path / "redis") as t:
        yield t


@pytest.fixture
def cluster(topology):
    """Fresh for each test (it kills a node): a replica per primary, a node that does not
    answer for 1 s is failing, so a failover takes a few seconds."""
    return redis_cluster(topology, replicas=1, node_timeout_ms=1000)


@pytest.fixture
def stack(capp, cluster):  # noqa: F811
    s = Stack(capp, cluster.url())
    # Longer than a failover (as for Sentinel): what a worker held on the dead primary it
    # must sort out itself, rather than the dispatcher burying a live worker and requeueing
    # everything it held on every shard.
    s.env["TASKRUNNER_DEAD_AFTER"] = "30"
    yield s
    s.stop()


def replicated(cluster: Cluster, keys: list[str]) -> None:
    """Wait until the replica of each primary serving a slot of `keys` has everything
    written there so far: a write to the slot on that primary, then WAIT 1 (replication is
    one ordered stream, and WAIT counts from this connection's last write)."""
    for key in keys:
        with cluster.owner(key).client() as node:
            pipe = node.pipeline(transaction=False)
            pipe.incr(key + "failover-test-fence").execute_command("WAIT", 1, 10_000)
            assert pipe.execute()[1] == 1, f"the replica of {node} did not acknowledge in 10 s"


def cut_off(replica: Node, primary: redis.Redis) -> None:
    """Stop `replica` replicating `primary` (a client of it), as if it lagged: a wrong
    masterauth keeps it from syncing again once its link is closed. Returns once its link
    is down."""
    with replica.client() as r:
        r.config_set("masterauth", "not-the-password")
        primary.client_kill_filter(_type="slave")  # redis-py before 5.1 knows no "replica"; the server takes both
        wait_for(lambda: r.info("replication")["master_link_status"] == "down", what="the replica cut off")


def role(node: Node) -> str | None:
    """The node's replication role; None while it does not answer."""
    try:
        with node.client(socket_timeout=2) as c:
            return c.info("replication")["role"]
    except redis.ConnectionError:
        return None


async def produce(client: AsyncClient, queue: str, args: list) -> list[str]:
    """Enqueue logged(path, n), logged(path, n + 1), logged(path, n + 2) on `queue` with
    the asyncio client (args: [path, n]): one on each of its 3 shards. The ids."""
    return [await client.enqueue("tests.apps.logged", [args[0], args[1] + i], queue=queue) for i in range(3)]


def runs(path: Path) -> Counter[int]:
    """How many times each job of logged() started, by its number."""
    return Counter(int(line) for line in path.read_text().split())


def test_a_primary_killed_mid_drain_fails_over_and_loses_only_what_it_had_not_replicated(  # noqa: F811
        capp, stack, topology, cluster, sharded, tmp_path):  # noqa: F811
    """240 jobs replicated (WAIT), then the dying primary's replica cut off: what that primary
    takes from then on (claims, finishes, an enqueue) is acknowledged but never replicated,
    as when replication lags. The primary is SIGKILLed mid-drain and its replica promoted:
    every replicated job completes, those whose end the replica never got run again on
    that shard alone (at least once), the enqueue the primary alone took is lost, and
    workers, dispatcher and producers go on with the new primary without a restart."""
    ran = tmp_path / "runs"
    ran.touch()
    parts = shards.names(sharded, 3)
    # The primary of the global keys (heartbeats, the worker registry) dies, and one shard with it.
    victim = cluster.owner(capp.keys.g)
    [lost_shard] = [q for q in parts if cluster.owner(f"{{{q}}}") is victim]
    successor = cluster.replicas[cluster.primaries.index(victim)]

    dispatcher = stack.dispatcher()
    workers = [stack.worker("-Q", sharded, name=f"w{i}", concurrency=2) for i in range(2)]
    before = capp.enqueue_many({"task": "tests.apps.logged", "args": [str(ran), i, 0.05], "queue": sharded}
                               for i in range(240))
    # Due about when the primary dies: the dispatcher makes them pending, after the failover if not before.
    delayed = [apps.logged.apply_async([str(ran), 1000 + i, 0], queue=sharded, delay=3) for i in range(6)]
    assert {j.queue for j in before + delayed} == set(parts)
    replicated(cluster, [capp.keys.q(q) for q in parts] + [capp.keys.g])
    wait_for(lambda: sum(runs(ran).values()) >= 20, what="the drain under way")

    done = capp.keys.q(lost_shard) + "completed"
    with victim.client() as primary:
        cut_off(successor, primary)
        cut = primary.zcard(done)
        wait_for(lambda: primary.zcard(done) >= cut + 5, what="jobs of that shard completed on the primary alone")
        wait_for(lambda: primary.hlen(capp.keys.q(lost_shard) + "running") > 0, what="jobs running on that shard")

    def promoted() -> None:
        wait_for(lambda: role(successor) == "master" and cluster.owner(capp.keys.g) is successor, 60,
                 what="the replica promoted")

    async def across() -> tuple[list[str], list[str]]:
        """An asyncio producer's enqueues on either side of the failover (one client)."""
        client = AsyncClient(capp)
        try:
            unreplicated = await produce(client, sharded, [str(ran), 1100])
            victim.kill()
            killed = time.monotonic()
            # At once: the enqueue into the dead primary's shard rides out the promotion
            # (enqueue_retry) instead of raising ConnectionError until it is done.
            during = await produce(client, sharded, [str(ran), 2030])
            await asyncio.to_thread(promoted)
            print(f"replica promoted {time.monotonic() - killed:.1f}s after the kill")
            return unreplicated, during
        finally:
            await client.close()

    unreplicated, produced = asyncio.run(across())
    after = capp.enqueue_many({"task": "tests.apps.logged", "args": [str(ran), 2000 + i, 0], "queue": sharded}
                              for i in range(30))
    after += [capp.job(i) for i in produced]
    assert {j.queue for j in after} == set(parts)

    assert [j.wait(60) for j in before] == list(range(240))
    assert [j.wait(60) for j in delayed] == [1000 + i for i in range(6)]
    assert [j.wait(60) for j in after] == [2000 + i for i in range(33)]
    # The enqueue of the three the primary alone took is lost (the producer holds an id
    # the new primary never heard of); the other two, on the other shards, run.
    kept = []
    for i in unreplicated:
        try:
            kept.append(capp.job(i))
        except JobNotFound:
            pass
    assert len(kept) == 2 and lost_shard not in {j.queue for j in kept}
    assert sorted(j.wait(60) for j in kept) == sorted(int(j.to_dict()["args"][1]) for j in kept)
    counted = runs(ran)
    # (the lost one may have run before the kill, from the primary that took it)
    assert set(counted) - {1100, 1101, 1102} == set(range(240)) | {1000 + i for i in range(6)} | \
        {2000 + i for i in range(33)}
    # At least once: the jobs that ended on the primary alone ran again on the new one, on
    # that shard alone (a finish or a claim the replica never got); none elsewhere.
    again = {i for i, n in counted.items() if n > 1}
    shard_of = {j.result: j.queue for j in before + delayed + after + kept}
    assert len(again) >= 5 and {shard_of[i] for i in again} == {lost_shard}, again
    print(f"jobs run twice after the failover: {len(again)} of {len(counted)}, all on the dead primary's shard")

    # Nothing left held: every shard's running hash and processing set empty.
    def held() -> list[int]:
        pipe = capp.redis.pipeline(transaction=False)
        for q in parts:
            pipe.hlen(capp.keys.q(q) + "running").scard(capp.keys.q(q) + "processing")
        return pipe.execute()

    wait_for(lambda: held() == [0] * 6, what="nothing held")
    assert dispatcher.poll() is None and all(w.poll() is None for w in workers), "no process was restarted"

    # The dead node comes back as a replica of its successor, and the cluster runs on.
    topology.restart(victim)
    with victim.client() as back:
        wait_for(lambda: role(victim) == "slave" and back.info("replication")["master_link_status"] == "up"
                 and back.info("replication")["master_port"] == successor.port, 60, what="the old primary rejoined")
    again_after = [apps.logged.apply_async([str(ran), 3000 + i, 0], queue=sharded) for i in range(6)]
    assert [j.wait(60) for j in again_after] == [3000 + i for i in range(6)]
    kill_groups(stack.procs)
    for p in [dispatcher, *workers]:
        out = p.stdout.read()
        assert "Traceback" not in out, out


def test_an_idle_worker_follows_the_failover_of_a_shards_primary(capp, stack, cluster, sharded):  # noqa: F811
    """An idle worker waits on each shard's wake list, a BRPOP on each primary, for 60 s. One
    of those primaries dies (not the global keys' one, whose heartbeats would show the worker
    an error of its own): its BRPOP's connection drops, and the worker must learn where the
    shard went and wait there, so that a job enqueued there after the failover runs at once.
    So must a client waiting for a job of that shard (Job.wait, a BLPOP there), and the
    dispatcher that makes a delayed job of that shard pending once due."""
    parts = shards.names(sharded, 3)
    # Not shard 0, whose name is the queue's: a job enqueued there by name goes to any shard.
    [lost_shard] = [q for q in parts[1:] if cluster.owner(f"{{{q}}}") is not cluster.owner(capp.keys.g)][:1]
    victim = cluster.owner(f"{{{lost_shard}}}")
    successor = cluster.replicas[cluster.primaries.index(victim)]
    stack.dispatcher()
    worker = stack.worker("-Q", sharded, name="w1", concurrency=3, env={"TASKRUNNER_IDLE_BLOCK": "60"})
    wait_for(lambda: blocked_on_every_shard(cluster, sharded), what="the worker's BRPOP on each primary")
    # Due after the failover, most likely: the dispatcher promotes it on the new primary. A
    # waiter blocks on its notify list on the old one from before the kill.
    later = apps.add.apply_async([2, 2], queue=lost_shard, delay=4)
    replicated(cluster, [capp.keys.q(lost_shard)])
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(later.wait(60)))
    waiter.start()
    with victim.client() as primary:
        # (or the job was due and ran first, on a loaded machine: the waiter is done, the rest holds)
        wait_for(lambda: waited or primary.info("clients")["blocked_clients"] >= 2,
                 what="the worker and the waiter blocked")
    victim.kill()
    wait_for(lambda: role(successor) == "master" and cluster.owner(f"{{{lost_shard}}}") is successor, 60,
             what="the replica promoted")
    job = apps.add.apply_async([1, 1], queue=lost_shard)  # that shard alone: its wake list alone wakes the worker
    assert job.wait(30) == 2 and job.queue == lost_shard
    waiter.join(60)
    assert waited == [4]
    assert worker.poll() is None
