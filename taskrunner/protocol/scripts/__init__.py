"""Lua scripts: each lives in its own file, gets the `_lib.lua` helpers it uses prepended, is
loaded once per server and called by EVALSHA (all reloaded transparently after a NOSCRIPT,
e.g. when Redis restarted without its script cache)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from taskrunner.errors import InvalidName, NotJSONError, PayloadTooLarge

_DIR = Path(__file__).parent
_REFUSAL = re.compile(r"taskrunner: (\w+): (.*)", re.S)
_KINDS: dict[str, type[Exception]] = {"InvalidName": InvalidName, "NotJSON": NotJSONError,
                                      "PayloadTooLarge": PayloadTooLarge}


def refusal(e: Exception) -> Exception:
    """A script's refusal of bad input ("ERR taskrunner: <Kind>: message") as the exception
    the Python checks raise for the same input (ValueError for BadValue and BadCall), so
    that a caller sees one kind of error whichever side found it; other errors unchanged."""
    m = _REFUSAL.match(str(e)) if isinstance(e, ResponseError) else None
    return _KINDS.get(m[1], ValueError)(m[2]) if m else e


#: Lua's comments, strings and names: what the names of a piece of Lua are read from (a name
#: in a comment or a string is no use of it).
_LUA_TOKEN = re.compile(r"""--\[(=*)\[.*?\]\1\]|--[^\n]*|\[(=*)\[.*?\]\2\]|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'"""
                        r"|([A-Za-z_]\w*)", re.S)
#: A line that begins one of `_lib.lua`'s top-level definitions, and the names it defines:
#: `local function f(`, `local a, b = ...` or `local a`, `f = function(` (a forward-declared one).
_LUA_DEFINITION = re.compile(r"^(?:local\s+function\s+(\w+)|local\s+([\w\s,]+?)\s*(?:=|$|--)|(\w+)\s*=\s*function\b)")


def _names(lua: str) -> set[str]:
    """The names a piece of Lua uses (or defines), outside its comments and strings."""
    return {m[3] for m in _LUA_TOKEN.finditer(lua) if m[3]}


def _definitions(lib: str) -> list[tuple[set[str], str]]:
    """`lib`'s top-level definitions in order, each with the names it defines and its text (the
    comment lines just above it included)."""
    blocks: list[tuple[set[str], list[str]]] = []
    above: list[str] = []  # comments and blank lines not yet given to a definition
    for line in lib.splitlines():
        m = _LUA_DEFINITION.match(line)
        if m:
            names = {m[1] or m[3]} if m[1] or m[3] else {n.strip() for n in m[2].split(",")}
            blocks.append((names, above + [line]))
            above = []
        elif not line.strip() or line.startswith("--"):
            above.append(line)
        elif blocks:
            blocks[-1][1].extend(above + [line])
            above = []
        else:
            raise ValueError(f"_lib.lua: a statement outside any definition: {line!r}")
    return [(names, "\n".join(lines)) for names, lines in blocks]


def prelude(lib: str, script: str) -> str:
    """The helpers of `lib` that `script` uses, directly or through other helpers, in `lib`'s
    order: all of them would be made at every call (a closure each, ~5-10 us a call for all of
    `_lib.lua`'s), before the script's first line. Whole `lib` would run the same."""
    blocks = _definitions(lib)
    wanted, taken = _names(script), [False] * len(blocks)
    grew = True
    while grew:
        grew = False
        for i, (names, text) in enumerate(blocks):
            if not taken[i] and names & wanted:
                taken[i] = grew = True
                wanted |= _names(text)
    return "\n".join(text for i, (_, text) in enumerate(blocks) if taken[i])


class Script:
    """One Lua script, called by EVALSHA: its text is the `_lib.lua` helpers it uses, a newline,
    then its own file (docs/PROTOCOL.md, Loading a script)."""

    def __init__(self, name: str) -> None:
        self.name = name
        own = (_DIR / f"{name}.lua").read_text()
        self.source = prelude((_DIR / "_lib.lua").read_text(), own) + "\n" + own
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
REINDEX = Script("reindex")
