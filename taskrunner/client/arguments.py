"""A job's arguments checked against its task's signature where it is enqueued (as Celery
does at apply_async), so that `add.delay(1)` for `def add(x, y)` raises BadArguments in
the caller instead of failing later, in a worker, with a TypeError far from the mistake.

The producer knows the signature when the app declares the task (the function itself,
read once per task), or from the task's declaration in Redis (`params`: docs/PROTOCOL.md,
*Task declarations*) when it looked that up anyway, to find the task's queue: no job costs
Redis a command more. A declaration without `params` (an older worker's, a task with
`check_args=False`, or one whose signature cannot be read) checks nothing.

A job that is given a value first when it becomes pending (a chain step's parent's result,
a callback's result or error, a chord callback's results: unless immutable) is checked
with a placeholder in its place."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from taskrunner.errors import BadArguments

P = inspect.Parameter

#: A stand-in for the value a workflow step is given first (its parent's result).
_FED = object()

#: True while enqueues check nothing (unchecked()).
_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("taskrunner_unchecked", default=False)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Enqueues in the block check no arguments: the dispatcher's firing of a schedule, whose
    arguments were checked when it was added. Checked again against code deployed since, a
    schedule would be refused at every pass (an error logged, its state not kept, no job to
    see); fired, its jobs fail where they run, where they are seen and retried."""
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


def shape_of(fn: Callable) -> Shape | None:
    """The signature a job's arguments must bind to, or None where Python cannot read one
    (some builtins): then nothing is checked. A decorator made with functools.wraps is not
    read through to the function it wraps: the job is called with the wrapper's arguments,
    and a decorator may inject or take some (a database handle, a trace id), so its own
    signature is what binds, (*args, **kwargs) taking anything, as Celery's check
    (getfullargspec) reads it. A wrapper that says its signature (__signature__) is checked
    by it."""
    try:
        return Shape(inspect.signature(fn, follow_wrapped=False))
    except (TypeError, ValueError):
        return None


def params(sig: inspect.Signature) -> list[str]:
    """The signature as a declaration's `params`: Python's own notation without annotations
    nor default values, one parameter a string: "x", "y=" (has a default), "/" after the
    positional-only ones, "*args", "*" before keyword-only ones when there is no *args,
    "**kwargs". `def f(a, /, b, c=1, *, d, **kw)` is ["a", "/", "b", "c=", "*", "d", "**kw"]."""
    out: list[str] = []
    slash_due = starred = False
    for p in sig.parameters.values():
        if p.kind is P.POSITIONAL_ONLY:
            slash_due = True
        elif slash_due:
            out.append("/")
            slash_due = False
        if p.kind is P.KEYWORD_ONLY and not starred:
            out.append("*")
        if p.kind is P.VAR_POSITIONAL:
            out.append(f"*{p.name}")
        elif p.kind is P.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            out.append(p.name + ("=" if p.default is not P.empty else ""))
        starred = starred or p.kind in (P.VAR_POSITIONAL, P.KEYWORD_ONLY)
    return [*out, "/"] if slash_due else out


class _Default:
    """The default of a declared parameter: its value is not declared, only that it has one."""

    def __repr__(self) -> str:
        return "..."


_DEFAULT = _Default()


@functools.lru_cache(maxsize=1024)
def _from_params(declared: tuple[str, ...]) -> Shape | None:
    """The signature that `params` describe; None if they are not as params() writes them
    (another language's worker, a corrupt declaration): nothing is checked then."""
    mode: inspect._ParameterKind = P.POSITIONAL_ONLY if "/" in declared else P.POSITIONAL_OR_KEYWORD
    out = []
    try:
        for w in declared:
            if w == "/":
                mode = P.POSITIONAL_OR_KEYWORD
            elif w == "*":
                mode = P.KEYWORD_ONLY
            elif w.startswith("**"):
                out.append(P(w[2:], P.VAR_KEYWORD))
            elif w.startswith("*"):
                out.append(P(w[1:], P.VAR_POSITIONAL))
                mode = P.KEYWORD_ONLY
            elif w.endswith("="):
                out.append(P(w[:-1], mode, default=_DEFAULT))
            else:
                out.append(P(w, mode))
        return Shape(inspect.Signature(out))
    except (ValueError, TypeError, IndexError):  # not an identifier, a name twice, a required one after a
        return None  # default, ...; an empty name ("", "**") is an IndexError in inspect.Parameter


class Shape:
    """A signature made ready to check jobs against, once per task. A job whose arguments
    plainly fit is passed by counting its positional arguments and looking its keywords up
    (about a microsecond); any other is bound by Signature.bind (a few), which says what is
    wrong, or passes the cases counting leaves to it (a keyword caught by **kwargs)."""

    def __init__(self, sig: inspect.Signature) -> None:
        self.signature = sig
        #: As errors show it: without annotations, which say nothing a worker checks.
        self.shown = str(sig.replace(parameters=[p.replace(annotation=P.empty) for p in sig.parameters.values()],
                                     return_annotation=inspect.Signature.empty))
        ps = list(sig.parameters.values())
        #: Names of the parameters positional arguments fill, in order; None past them: *args.
        self.positional = [p.name for p in ps if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        self.most = None if any(p.kind is P.VAR_POSITIONAL for p in ps) else len(self.positional)
        #: Those a keyword argument may name, and those that must be given.
        self.named = frozenset(p.name for p in ps if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY))
        required = [p for p in ps if p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
        self.required = frozenset(p.name for p in required)
        #: Positional arguments alone fit when there are at least this many (and at most `most`),
        #: unless a keyword-only parameter must be given (`counted` False).
        self.least = sum(p.kind is not P.KEYWORD_ONLY for p in required)
        self.counted = all(p.kind is not P.KEYWORD_ONLY for p in required)

    def fits(self, n: int, kwargs: dict[str, Any]) -> bool:
        """True if `n` positional arguments and `kwargs` surely bind (False: ask bind)."""
        if self.most is not None and n > self.most:
            return False
        if not kwargs:
            return self.counted and n >= self.least
        filled = self.positional[:n]
        if any(k not in self.named or k in filled for k in kwargs):
            return False
        return all(r in kwargs or r in filled for r in self.required)

    def check(self, task: str, args: list[Any], kwargs: dict[str, Any], fed: bool) -> None:
        """Raise BadArguments, one line naming the task and what is wrong, unless `args` and
        `kwargs` bind to the signature. `fed`: the job is given a value first when it becomes
        pending (a chain step, a callback), counted as its first argument."""
        if self.fits(len(args) + fed, kwargs):
            return
        try:
            self.signature.bind(*((_FED, *args) if fed else args), **kwargs)
        except TypeError as e:
            first = (" (counting the value it is given first, its parent's result or error; an immutable step, "
                     ".si(), is given none)") if fed else ""
            raise BadArguments(f"{task}{self.shown}: {e}{first}") from None


def from_declaration(declared: dict[str, Any] | None) -> Shape | None:
    """The shape of the signature a worker declared for its task (its `params`), or None:
    no check."""
    given = (declared or {}).get("params")
    if not isinstance(given, list) or not all(isinstance(w, str) for w in given):
        return None
    return _from_params(tuple(given))


def check(task: str, shape: Shape | None, args: list[Any], kwargs: dict[str, Any], fed: bool) -> None:
    """Shape.check, where there is a shape (None: nothing to check) and the caller checks
    (unchecked())."""
    if shape is not None and not _UNCHECKED.get():
        shape.check(task, args, kwargs, fed)
