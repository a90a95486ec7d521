"""Several redis-server processes on loopback TCP (replication, Sentinel), for tests of
what a single server on a unix socket cannot show. A Topology starts nodes and stops every
one of them, whatever the test did to them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from taskrunner.ops.redis_server import find_redis_server
from tests.conftest import wait_for


def free_port() -> int:
    """A TCP port free right now (another process may take it before us: start() retries)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    """One redis-server (or sentinel) we started."""

    port: int
    dir: Path
    proc: subprocess.Popen
    cmd: list[str] = field(default_factory=list)

    def client(self, **options) -> redis.Redis:
        """A plain connection to this very node (not through the sentinels)."""
        options = {"decode_responses": True, "socket_timeout": 5, **options}
        return redis.Redis(host="127.0.0.1", port=self.port, **options)

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to tell anyone."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Topology:
    """Starts redis-server processes in `root` (one folder each); stop() ends them all."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: list[Node] = []

    def start(self, *args: str, conf: str | None = None, attempts: int = 5) -> Node:
        """A node on a free port with `args`; `conf` (a config file's text) starts it with
        that file, as Sentinel needs (it rewrites its file). Waits until it answers PING."""
        for _ in range(attempts):
            port = free_port()
            folder = self.root / f"node-{len(self.nodes)}-{port}"
            folder.mkdir(parents=True)
            cmd = [find_redis_server()]
            if conf is not None:
                (folder / "node.conf").write_text(conf)
                cmd.append(str(folder / "node.conf"))
            cmd += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                    "--logfile", str(folder / "redis.log"), *args]
            node = Node(port, folder, _spawn(cmd), cmd)
            self.nodes.append(node)
            if _up(node):
                return node
            # Most likely another process took the port between free_port() and the bind: again.
        raise RuntimeError(f"redis-server would not start; see the logs under {self.root}")

    def restart(self, node: Node) -> None:
        """Start a node we stopped again, as it was: its port, folder and arguments (a
        cluster node finds its nodes.conf there)."""
        node.kill()
        node.proc = _spawn(node.cmd)
        if not _up(node):
            raise RuntimeError(f"redis-server on {node.port} would not start again; see {node.dir}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _up(node: Node) -> bool:
    """Wait until the node answers PING (True) or its process exits (False)."""
    wait_for(lambda: node.proc.poll() is not None or _pings(node), timeout=20, what=f"redis on {node.port}")
    return node.proc.poll() is None


def _pings(node: Node) -> bool:
    try:
        with node.client(socket_timeout=1) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


DATA_NODE = ("--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0")


@dataclass
class SentinelGroup:
    primary: Node
    replicas: list[Node]
    sentinels: list[Node]
    service: str

    def url(self) -> str:
        """The redis+sentinel:// URL of the group."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def primary_ports(self) -> set[int]:
        """The primary's port as each sentinel that answers reports it."""
        ports = set()
        for s in self.sentinels:
            try:
                with s.client(socket_timeout=1) as c:
                    ports.add(int(c.sentinel_get_master_addr_by_name(self.service)[1]))
            except redis.RedisError:
                pass
        return ports


def sentinel_group(topology: Topology, replicas: int = 1, sentinels: int = 3, service: str = "mymaster",
                   down_after_ms: int = 1000) -> SentinelGroup:
    """A primary, its replicas and sentinels (quorum: a majority) watching them; returns once
    every replica is in sync and every sentinel knows every replica and every other sentinel,
    so that a failover can start as soon as the primary is gone."""
    primary = topology.start(*DATA_NODE)
    copies = [topology.start(*DATA_NODE, "--replicaof", "127.0.0.1", str(primary.port)) for _ in range(replicas)]
    conf = (f"sentinel monitor {service} 127.0.0.1 {primary.port} {sentinels // 2 + 1}\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} {max(3 * down_after_ms, 3000)}\n")
    watchers = [topology.start("--sentinel", conf=conf) for _ in range(sentinels)]

    def in_sync(r: Node) -> bool:
        with r.client() as c:
            return c.info("replication")["master_link_status"] == "up"

    def known(s: Node) -> bool:
        with s.client() as c:
            m = c.sentinel_master(service)
        return m["num-slaves"] == replicas and m["num-other-sentinels"] == sentinels - 1

    for r in copies:
        wait_for(lambda r=r: in_sync(r), what=f"replica {r.port} in sync")

    for s in watchers:
        wait_for(lambda s=s: known(s), what=f"sentinel {s.port} to know the replicas and the other sentinels")
    return SentinelGroup(primary, copies, watchers, service)


@dataclass
class Cluster:
    """The nodes of a Redis Cluster we started: `primaries`, each serving a share of the
    slots, and `replicas` (none, or each replicating one primary: replicas[i] primaries[i]'s,
    as redis_cluster() built it; a failover swaps the roles, the lists stay as built)."""

    primaries: list[Node]
    replicas: list[Node] = field(default_factory=list)

    @property
    def nodes(self) -> list[Node]:
        return self.primaries + self.replicas

    def url(self) -> str:
        """The redis+cluster:// URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def slots(self) -> list[tuple[int, int, int]]:
        """CLUSTER SLOTS as the first node that answers reports it: (first slot, last slot,
        port of the primary serving them)."""
        for node in self.nodes:
            if node.proc.poll() is None:
                try:
                    with node.client(socket_timeout=2) as c:
                        return [(start, end, int(port)) for start, end, (_, port, *_), *_ in
                                c.execute_command("CLUSTER", "SLOTS")]
                except redis.ConnectionError:
                    continue
        raise LookupError("no node of the cluster answers")

    def owner(self, key: str) -> Node:
        """The primary that serves the slot of `key`."""
        slot = key_slot(key)
        for start, end, port in self.slots():
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def move_slot(self, key: str, to: Node) -> None:
        """Reshard: the slot of `key`, with every key in it, to primary `to` (the steps of
        `redis-cli --cluster reshard`: IMPORTING, MIGRATING, MIGRATE, then SETSLOT NODE)."""
        source = self.owner(key)
        with source.client() as src, to.client() as dst:
            slot = src.cluster("keyslot", key)
            src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)
        for node in self.primaries:
            with node.client() as c:
                c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)


def key_slot(key: str) -> int:
    """The hash slot of `key` (redis-py computes it as the server does: CRC16 of its hash tag)."""
    from redis.crc import key_slot as crc_slot

    return crc_slot(key.encode())


def redis_cluster(topology: Topology, primaries: int = 3, replicas: int = 0,
                  node_timeout_ms: int | None = None) -> Cluster:
    """`primaries` nodes with --cluster-enabled (each with a cluster bus port of its own),
    the slots split evenly between them, joined by CLUSTER MEET: what `redis-cli --cluster
    create --cluster-replicas N` does, without its fixed waits. With `replicas` (0 or 1),
    as many more nodes, each a replica of one primary (CLUSTER REPLICATE). Returns once
    every node reports cluster_state:ok and knows every other, every replica is in sync
    and every node agrees on who replicates whom, so that a failover can start as soon as
    a primary is gone. `node_timeout_ms`: --cluster-node-timeout (Redis's default, 15 s,
    unless given): how long a node may not answer before it counts as failing."""
    if replicas not in (0, 1):
        raise ValueError(f"replicas: 0 or 1 per primary, not {replicas}")
    timeout = ("--cluster-node-timeout", str(node_timeout_ms)) if node_timeout_ms else ()
    total = primaries * (1 + replicas)
    nodes, buses = [], []
    while len(nodes) < total:
        bus = free_port()
        try:
            nodes.append(topology.start(*DATA_NODE, "--cluster-enabled", "yes", "--cluster-port", str(bus),
                                        "--cluster-config-file", "nodes.conf", *timeout, attempts=1))
            buses.append(bus)
        except RuntimeError:
            if len(topology.nodes) > 5 * total:  # not a port clash now and then: give up
                raise
    firsts, copies = nodes[:primaries], nodes[primaries:]
    join_cluster([n.client for n in firsts], firsts[0].port, buses[0])
    if copies:
        replicate(firsts, copies, buses[0])
    return Cluster(firsts, copies)


def replicate(primaries: list[Node], copies: list[Node], first_bus: int) -> None:
    """Make each of `copies` (fresh --cluster-enabled nodes) a replica of the primary in
    its place: it MEETs the first primary, waits to know its primary, CLUSTER REPLICATE.
    Returns once each replica is in sync and every node knows every replica as one."""
    ids = []
    for node in primaries:
        with node.client() as c:
            ids.append(c.execute_command("CLUSTER", "MYID"))
    for copy in copies:
        with copy.client() as c:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", primaries[0].port, first_bus)
    for copy, primary_id in zip(copies, ids):
        with copy.client() as c:
            wait_for(lambda c=c, i=primary_id: any(n["node_id"] == i for n in c.cluster("nodes").values()),
                     what=f"node {copy.port} to know its primary")
            c.execute_command("CLUSTER", "REPLICATE", primary_id)
    for copy in copies:
        with copy.client() as c:
            wait_for(lambda c=c: c.info("replication")["master_link_status"] == "up",
                     what=f"replica {copy.port} in sync")
    expected = {copy.port: primary_id for copy, primary_id in zip(copies, ids)}
    for node in primaries + copies:
        wait_for(lambda n=node: replicas_seen(n) == expected and cluster_ok(n),
                 what=f"node {node.port} to know every replica")


def replicas_seen(node: Node) -> dict[int, str]:
    """The replicas `node` knows of, by port: the id of the primary each replicates."""
    with node.client() as c:
        return {int(addr.split("@")[0].rsplit(":", 1)[1]): info["master_id"]
                for addr, info in c.cluster("nodes").items() if "slave" in info["flags"]}


def cluster_ok(node: Node) -> bool:
    with node.client() as c:
        return c.cluster("info")["cluster_state"] == "ok"


def join_cluster(clients: list[Callable[[], redis.Redis]], first_port: int, first_bus: int) -> None:
    """Make one cluster of fresh --cluster-enabled nodes (`clients`: a client of each, with
    decoded replies; the first's port and cluster bus port): the slots split evenly between
    them, the others MEET the first. Returns once every node reports cluster_state:ok and
    knows every other."""
    per = 16384 // len(clients)
    for i, client in enumerate(clients):
        with client() as c:
            last = 16383 if i == len(clients) - 1 else (i + 1) * per - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            if i:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", first_port, first_bus)

    def ready(client: Callable[[], redis.Redis]) -> bool:
        with client() as c:
            return c.cluster("info")["cluster_state"] == "ok" and len(c.cluster("nodes")) == len(clients)

    for i, client in enumerate(clients):
        wait_for(lambda client=client: ready(client), what=f"cluster node {i} to be ok and know every node")
