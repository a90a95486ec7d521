"""Several redis-server processes on loopback TCP (replication, Sentinel), for tests of
what a single server on a unix socket cannot show. A Topology starts nodes and stops every
one of them, whatever the test did to them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
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
            node = Node(port, folder, subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                                                       stderr=subprocess.DEVNULL))
            self.nodes.append(node)
            wait_for(lambda n=node: n.proc.poll() is not None or _pings(n), timeout=20, what=f"redis on {port}")
            if node.proc.poll() is None:
                return node
            # Most likely another process took the port between free_port() and the bind: again.
        raise RuntimeError(f"redis-server would not start; see the logs under {self.root}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    """Primaries of a Redis Cluster we started, each serving a third of the slots."""

    primaries: list[Node]

    def url(self) -> str:
        """The redis+cluster:// URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.primaries)

    def owner(self, key: str) -> Node:
        """The primary that serves the slot of `key`."""
        with self.primaries[0].client() as c:
            slot = c.execute_command("CLUSTER", "KEYSLOT", key)
            for start, end, (_, port, *_) in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.primaries if n.port == int(port))
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


def redis_cluster(topology: Topology, primaries: int = 3) -> Cluster:
    """`primaries` nodes with --cluster-enabled (each with a cluster bus port of its own),
    the slots split evenly between them, joined by CLUSTER MEET: what `redis-cli --cluster
    create --cluster-replicas 0` does, without its fixed waits. Returns once every node
    reports cluster_state:ok and knows every other."""
    nodes, buses = [], []
    while len(nodes) < primaries:
        bus = free_port()
        try:
            nodes.append(topology.start(*DATA_NODE, "--cluster-enabled", "yes", "--cluster-port", str(bus),
                                        "--cluster-config-file", "nodes.conf", attempts=1))
            buses.append(bus)
        except RuntimeError:
            if len(topology.nodes) > 5 * primaries:  # not a port clash now and then: give up
                raise
    join_cluster([n.client for n in nodes], nodes[0].port, buses[0])
    return Cluster(nodes)


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
