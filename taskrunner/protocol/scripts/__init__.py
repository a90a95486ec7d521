"""Lua scripts: each lives in its own file, gets `_lib.lua` prepended, is loaded once
per server and called by EVALSHA (all reloaded transparently after a NOSCRIPT, e.g. when
Redis restarted without its script cache)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from taskrunner.errors import InvalidName, NotJSONError, PayloadTooLarge

_DIR = Path(__file__).parent
_LIB = (_DIR / "_lib.lua").read_text()
_REFUSAL = re.compile(r"taskrunner: (\w+): (.*)", re.S)
_KINDS: dict[str, type[Exception]] = {"InvalidName": InvalidName, "NotJSON": NotJSONError,
                                      "PayloadTooLarge": PayloadTooLarge}


def refusal(e: Exception) -> Exception:
    """A script's refusal of bad input ("ERR taskrunner: <Kind>: message") as the exception
    the Python checks raise for the same input (ValueError for BadValue and BadCall), so
    that a caller sees one kind of error whichever side found it; other errors unchanged."""
    m = _REFUSAL.match(str(e)) if isinstance(e, ResponseError) else None
    return _KINDS.get(m[1], ValueError)(m[2]) if m else e


class Script:
    """One Lua script, called by EVALSHA."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _LIB + "\n" + (_DIR / f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        ALL.append(self)

    def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            try:
                return client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                load_all(client)
                return client.evalsha(self.sha, len(keys), *keys, *args)
        except ResponseError as e:
            raise refusal(e) from None


#: Every script, as defined below.
ALL: list[Script] = []


def load_all(client: Any) -> None:
    """Load every script (on every primary of a cluster): a server that answered NOSCRIPT
    lost them all (a restart, a flush, a promoted replica, a new node). Loading only the one
    met would leave it knowing some: a later batch whose first call meets NOSCRIPT while a
    later one runs would see them run out of order (progress.lua re-run after the finish.lua
    that ended its job: the job's last log lines lost)."""
    for script in ALL:
        client.script_load(script.source)


class Batch:
    """Commands and script calls sent in one round trip (a non-transactional pipeline;
    on a Redis Cluster one per node, redis-py's ClusterPipeline sending each call to the
    primary of its keys' slot). A script the server did not know (NOSCRIPT: a restart, a
    promoted replica, a node new to the cluster) did not run, so it is loaded (on every
    primary of a cluster) and run again alone; any other error is raised after the whole
    batch ran."""

    def __init__(self, client: Any, direct: Any = None) -> None:
        self.client = client
        self.direct = direct  # a connection.Direct for send()
        self.sent = 0  # commands sent by send() whose answers are still to be read
        self.pipe = client.pipeline(transaction=False)
        self._scripts: list[tuple[int, Script, list[str], list[Any]]] = []

    def call(self, script: Script, keys: list[str], args: list[Any]) -> None:
        self._scripts.append((len(self.pipe), script, keys, args))
        # Not pipe.evalsha(): ClusterPipeline refuses it, yet routes the command by its keys.
        self.pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    def __len__(self) -> int:
        return len(self.pipe)

    def send(self) -> None:
        """Send the batch now on the Direct connection, if there is one, and return at once:
        execute() reads the answers. For idempotent calls only: if reading fails, execute()
        sends the batch again, the usual way (with redis-py's retries)."""
        if self.direct is not None and len(self.pipe):
            self.sent = self.direct.send(self.commands())

    def commands(self) -> list[tuple[Any, ...]]:
        """The batch's commands, to send another way (then settle() their answers)."""
        return [args for args, _ in self.pipe.command_stack]

    def execute(self) -> list[Any]:
        if not len(self.pipe):
            return []
        results = None
        if self.sent:
            try:
                results = self.direct.read(self.sent)
            except (ConnectionError, TimeoutError):
                pass  # did it run? Again, as idempotent calls may be
            self.sent = 0
        if results is None:
            results = self.pipe.execute(raise_on_error=False)
        return self.settle(results)

    def settle(self, results: list[Any]) -> list[Any]:
        """The batch's results from its answers: scripts the server did not know are loaded
        and run again; an error is raised."""
        for index, script, keys, args in self._scripts:
            if isinstance(results[index], NoScriptError):
                results[index] = script(self.client, keys, args)
        self._scripts = []
        for r in results:
            if isinstance(r, (ResponseError, ConnectionError)):
                raise refusal(r)
        return results


ENQUEUE = Script("enqueue")
CLAIM = Script("claim")
FINISH = Script("finish")
SWEEP = Script("sweep")
LOSE = Script("lose")
STUCK = Script("stuck")
KILL = Script("kill")
WATCH = Script("watch")
HEARTBEAT = Script("heartbeat")
RETRY = Script("retry")
REQUEUE = Script("requeue")
DELETE = Script("delete")
PURGE = Script("purge")
RECOVER = Script("recover")
PROGRESS = Script("progress")
TALLY = Script("tally")
JOIN = Script("join")
ATTACH = Script("attach")
