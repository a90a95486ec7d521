"""Lua scripts: each lives in its own file and is called as a Redis Function: one library
holds `_lib.lua`'s helpers, made once when it loads, and one function per script (FUNCTION
LOAD once per server, FCALL per call; the library is loaded again, transparently, where a
server lacks it: a restart without persistence, a flush, a new node). A server without
Functions (Redis < 7.0), or a user not allowed them, gets the same scripts by EVALSHA, each
with the `_lib.lua` helpers it uses prepended (reloaded after a NOSCRIPT). docs/PROTOCOL.md,
Loading a script."""

from __future__ import annotations

import hashlib
import logging
import re
import weakref
from pathlib import Path
from typing import Any

from redis.cluster import ClusterPipeline
from redis.exceptions import AskError, ConnectionError, NoScriptError, ResponseError, TimeoutError

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


#: What a script called alone (Script.__call__) raises for an error reply: refusal() of it.
#: Batch.settle() leaves it in its place where its caller asked so, as a reply in the batch.
_ERROR_REPLIES: tuple[type[Exception], ...] = (ResponseError, ValueError, InvalidName, NotJSONError, PayloadTooLarge)


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
    """One Lua script. Called as the function `function` of the library (LIBRARY, below); by
    EVALSHA of `source` (the `_lib.lua` helpers it uses, a newline, then its own file) where
    the server has no Functions. Both run the same code (docs/PROTOCOL.md, Loading a script)."""

    def __init__(self, name: str, frees: bool = False) -> None:
        self.name = name
        #: It frees memory (deletes jobs, trims what expired): its function runs while Redis is
        #: over maxmemory (flag allow-oom), where the others are refused, so that a full Redis
        #: can be emptied with taskrunner's own commands.
        self.frees = frees
        self.body = (_DIR / f"{name}.lua").read_text()
        self.source = prelude(_LIB, self.body) + "\n" + self.body
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()
        self.function = ""  # its function's name, once the library is composed (below)
        ALL.append(self)

    def command(self, client: Any, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
        """The command that calls it on `client`'s server: FCALL, or EVALSHA there."""
        if client in _EVALSHA:
            return ("EVALSHA", self.sha, len(keys), *keys, *args)
        return ("FCALL", self.function, len(keys), *keys, *args)

    def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            try:
                return client.execute_command(*self.command(client, keys, args))
            except ResponseError as e:
                if not missing(e):
                    raise
                load(client, e)
                return client.execute_command(*self.command(client, keys, args))
        except ResponseError as e:
            raise refusal(e) from None


#: Every script, as defined below.
ALL: list[Script] = []

#: Clients whose server has no Functions, or whose user may not load or call them: they call
#: every script by EVALSHA (decided by the first refusal; a log line says so, once).
_EVALSHA: weakref.WeakSet[Any] = weakref.WeakSet()
_log = logging.getLogger("taskrunner.scripts")


def missing(e: Exception) -> bool:
    """An answer to FCALL or EVALSHA that says the script did not run, as the server lacks it
    (a restart without persistence, FUNCTION FLUSH or SCRIPT FLUSH, a new cluster node; not
    FLUSHALL, which leaves Functions) or lacks Functions altogether (Redis < 7.0; a user
    without FCALL): load() then."""
    return isinstance(e, NoScriptError) or isinstance(e, ResponseError) and (
        str(e).startswith("Function not found") or _refused(e))


#: Redis's refusals of FCALL or FUNCTION LOAD themselves (redis-py drops the ERR/NOPERM
#: prefix): unknown (Redis < 7.0, or renamed away) or not the user's ("this user" in 7.0,
#: "User <name>" in later versions). Anchored and naming the command: a refusal from inside a
#: function ("ACL failure in script" of a command it called, after its earlier writes were
#: done) or a script's own refusal that quotes the caller's text must not read as one, as
#: the call would be run again by EVALSHA.
_REFUSAL_OF_FUNCTIONS = re.compile(r"(?:unknown command '(?:fcall|function)'|(?:this user|user \S+) has no "
                                   r"permissions to run the '(?:fcall|function(?:\|load)?)' command)", re.I)


def _refused(e: ResponseError) -> bool:
    """Functions refused: an unknown command (Redis < 7.0) or one the user may not run."""
    return bool(_REFUSAL_OF_FUNCTIONS.match(str(e)))


def loading(client: Any, answer: Exception | None = None) -> list[tuple[Any, ...]]:
    """The commands that give `client`'s server (every primary of a cluster) the scripts,
    after `answer` (if any) said it lacks them: the library (FUNCTION LOAD REPLACE: one name
    holds one text, so a load racing another's is harmless), or, where Functions are refused,
    every script for EVALSHA. All at once: a server that knew some of the scripts and not others
    would run a batch out of order (a progress report re-run after the finish that ended its
    job: its last log lines lost)."""
    if isinstance(answer, ResponseError):
        refused(client, answer)
    if client in _EVALSHA:
        return [("SCRIPT", "LOAD", script.source) for script in ALL]
    return [("FUNCTION", "LOAD", "REPLACE", LIBRARY)]


def refused(client: Any, e: ResponseError) -> bool:
    """Does `e` refuse Functions (Redis < 7.0; a user without FCALL or FUNCTION)? `client`
    then calls the scripts by EVALSHA, from now on."""
    if not _refused(e):
        return False
    if client not in _EVALSHA:
        _EVALSHA.add(client)
        _log.warning("Redis refused Functions (%s): calling the scripts by EVALSHA", str(e).split("\n")[0])
    return True


def load(client: Any, answer: Exception | None = None) -> None:
    """Run loading()'s commands: where FUNCTION LOAD is refused, the scripts for EVALSHA."""
    for command in loading(client, answer):
        try:
            client.execute_command(*command)
        except ResponseError as e:
            if command[0] != "FUNCTION" or not refused(client, e):
                raise
            for again in loading(client, e):
                client.execute_command(*again)
            return


class Batch:
    """Commands and script calls sent in one round trip (a non-transactional pipeline;
    on a Redis Cluster one per node, redis-py's ClusterPipeline sending each call to the
    primary of its keys' slot). A script the server did not know (a restart, a promoted
    replica, a node new to the cluster) did not run, so the scripts are loaded (load()) and
    it is run again alone; any other error is raised after the whole batch ran. A MOVED or
    ASK answer (a batch sent past redis-py, links.ClusterChannel, to a slot that has
    moved or is moving) fails the whole batch as a lost connection does, before anything is
    run again (see settle())."""

    def __init__(self, client: Any, direct: Any = None) -> None:
        self.client = client
        self.direct = direct  # a links.Direct for send()
        self.sent = 0  # commands sent by send() whose answers are still to be read
        self.pipe = client.pipeline(transaction=False)
        self._scripts: list[tuple[int, Script, list[str], list[Any]]] = []

    def call(self, script: Script, keys: list[str], args: list[Any]) -> None:
        self._scripts.append((len(self.pipe), script, keys, args))
        # execute_command(): ClusterPipeline refuses pipe.evalsha(), yet routes the command by
        # its keys (FCALL's too: connection.py tells it where they are).
        self.pipe.execute_command(*script.command(self.client, keys, args))

    def __len__(self) -> int:
        return len(self.pipe)

    def send(self) -> None:
        """Send the batch now on the Direct connection, if there is one, and return at once:
        execute() reads the answers. For idempotent calls only: if reading fails, execute()
        sends the batch again, the usual way (with redis-py's retries)."""
        if self.direct is not None and len(self.pipe):
            commands = self.commands()
            self.sent = len(commands)  # first: interrupted as they go, execute() or abandon() still knows
            self.direct.send(commands)

    def abandon(self) -> None:
        """Give up what send() sent, its answers unread: its link is closed (Direct.drop()),
        so nothing is waited for nor sent again (Redis may still run it, or may have)."""
        if self.sent:
            self.direct.drop()
            self.sent = 0

    def commands(self) -> list[tuple[Any, ...]]:
        """The batch's commands, to send another way (then settle() their answers)."""
        if isinstance(self.pipe, ClusterPipeline):  # PipelineCommand objects, since 6.3 its strategy's
            strategy = getattr(self.pipe, "_execution_strategy", None)
            commands = [c.args for c in (self.pipe.command_stack if strategy is None else strategy.command_queue)]
            if len(commands) != len(self.pipe):  # redis-py's internals moved: never send a batch short
                raise RuntimeError(f"read {len(commands)} of the batch's {len(self.pipe)} commands from redis-py")
            return commands
        return [args for args, _ in self.pipe.command_stack]

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """The batch's results (settle()); `raise_on_error` False: each error in its place."""
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
        return self.settle(results, raise_on_error)

    def settle(self, results: list[Any], raise_on_error: bool = True) -> list[Any]:
        """The batch's results from its answers: scripts the server did not know are loaded
        and run again; an error is raised. A redirection (MOVED, ASK) raises ConnectionError
        first: the caller then counts the batch as lost (what else it held may have run: it
        reconciles, and sends its finishes again, which are idempotent) and its channel reads
        the cluster's layout anew. Not followed: a command run again through redis-py may be
        sent twice (its retries), and blocks the caller meanwhile; and an ASK (a slot being
        migrated) would run a script on a node that holds only the keys moved so far, since
        our scripts name their queue's prefix as their key, not the keys they touch.
        `raise_on_error` False: each other error is left in its place, a script's refusal as
        refusal() says it (a caller that must tell which calls of the batch went through)."""
        for r in results:
            if isinstance(r, AskError) or (isinstance(r, ResponseError) and str(r).startswith(("MOVED ", "ASK "))):
                raise ConnectionError(f"the cluster's layout changed under a sync ({r})")
        for index, script, keys, args in self._scripts:
            if isinstance(results[index], Exception) and missing(results[index]):
                try:
                    results[index] = script(self.client, keys, args)
                except _ERROR_REPLIES as e:  # in its place, as had it run in the batch: the others run too
                    if raise_on_error:
                        raise
                    results[index] = e
        self._scripts = []
        for k, r in enumerate(results):
            if isinstance(r, (ResponseError, ConnectionError)):
                if raise_on_error:
                    raise refusal(r)
                results[k] = refusal(r)
        return results


ENQUEUE = Script("enqueue")
CLAIM = Script("claim")
FINISH = Script("finish")
SWEEP = Script("sweep", frees=True)
LOSE = Script("lose")
STUCK = Script("stuck")
KILL = Script("kill")
WATCH = Script("watch")
HEARTBEAT = Script("heartbeat")
RETRY = Script("retry")
REQUEUE = Script("requeue")
DELETE = Script("delete", frees=True)
PURGE = Script("purge", frees=True)
RECOVER = Script("recover")
PROGRESS = Script("progress")
TALLY = Script("tally")
TRIM = Script("trim", frees=True)
JOIN = Script("join")
ATTACH = Script("attach")
REINDEX = Script("reindex")


ALLOW_OOM = "'allow-oom'"


def library(scripts: list[Script]) -> str:
    """The Redis Functions library of `scripts`: `_lib.lua` whole (its helpers are made once,
    when the library loads), then one function per script, its file's text as the body, with
    KEYS and ARGV its arguments, beginning with fresh_call() (`_lib.lua`: what must not live
    from one call to the next). Named `taskrunner_<hash>` of that text, as are its
    functions (`taskrunner_<hash>_<script>`): a server holds each version's library beside
    the others', so that workers of two versions on one Redis never call each other's code."""
    text = "\n".join([_LIB, *(f"redis.register_function{{function_name = 'taskrunner_@_{s.name}', "
                             f"flags = {{{ALLOW_OOM if s.frees else ''}}}, "
                             f"callback = function(KEYS, ARGV) fresh_call()\n{s.body}\nend}}" for s in scripts)])
    version = hashlib.sha1(text.encode()).hexdigest()[:16]
    for s in scripts:
        s.function = f"taskrunner_{version}_{s.name}"
    return f"#!lua name=taskrunner_{version}\n" + text.replace("'taskrunner_@_", f"'taskrunner_{version}_")


#: The library's text (FUNCTION LOAD) and name.
LIBRARY = library(ALL)
LIBRARY_NAME = LIBRARY.split("\n", 1)[0].removeprefix("#!lua name=")
