"""The long-lived child process that runs a worker's jobs, one at a time.

Protocol with the worker (one pipe): the worker sends b"id\\0attempt\\0task\\0args\\0kwargs"
(args and kwargs as the JSON text stored in Redis); the child answers with a JSON list
[outcome, v1, v2, v3, v4] as finish.lua takes it."""

from __future__ import annotations

import ctypes
import inspect
import os
import random
import signal
import traceback
from typing import Any

from . import codec
from .errors import NotJSONError, Reject, Retry


class _Killed(BaseException):
    """Raised in the job by SIGTERM when the worker asked for it (kill or time limit)."""


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs us when the worker dies, so no orphan runs a job twice."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def child_main(conn: Any, app: Any, kill_flag: Any, parent: int, inherited: list) -> None:
    for other in inherited:
        other.close()
    signal.set_wakeup_fd(-1)  # the worker's, inherited: our signals are not its business
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the worker to handle

    def on_term(signum: int, frame: Any) -> None:
        # SIGTERM from anyone but our worker (e.g. a platform stopping every process)
        # is ignored: the worker decides when a job stops.
        if kill_flag.value:
            raise _Killed()

    signal.signal(signal.SIGTERM, on_term)
    _die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    signatures: dict[str, inspect.Signature | None] = {}
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                os._exit(0)
            reply = codec.dumps(run(app, message, signatures))
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # never half a reply
            try:
                conn.send_bytes(reply)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    except _Killed:
        os._exit(143)  # the job's finally blocks have run


def _failed(kind: str, message: str, tb: str = "") -> list:
    return ["failed", kind, message, tb, ""]


def run(app: Any, message: bytes, signatures: dict) -> list:
    """Run one job; every outcome, including bad input, becomes a reply."""
    parts = message.split(b"\0")
    if len(parts) != 5:
        return _failed("CorruptJob", "job record has a malformed field (NUL byte)")
    _, _, name, raw_args, raw_kwargs = (p.decode("utf-8", "replace") for p in parts)
    task = app.tasks.get(name)
    if task is None:
        return _failed("NotRegistered", f"unknown task {name!r}: no task of that name in app {app.name!r}")
    try:
        args, kwargs = codec.loads(raw_args), codec.loads(raw_kwargs)
    except ValueError as e:
        return _failed("BadArguments", f"args/kwargs are not valid JSON: {e}")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return _failed("BadArguments", "args must be a JSON array and kwargs a JSON object")
    if name not in signatures:
        try:
            signatures[name] = inspect.signature(task.fn)
        except (TypeError, ValueError):
            signatures[name] = None
    sig = signatures[name]
    if sig is not None:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            return _failed("BadArguments", f"{name}{sig}: {e}")
    try:
        result = task.fn(*args, **kwargs)
    except Retry as r:
        return ["requeue", str(r.delay), "", "", ""]
    except Reject as r:
        return _failed("Rejected", str(r))
    except (Exception, SystemExit) as e:
        kind = type(e).__qualname__
        if type(e).__module__ != "builtins":
            kind = f"{type(e).__module__}.{kind}"
        return ["error", kind, str(e), traceback.format_exc(), str(random.uniform(0.5, 1.0))]
    try:
        return ["completed", codec.dumps(result, "result").decode(), "", "", ""]
    except NotJSONError as e:
        return _failed("NotJSONError", str(e))
