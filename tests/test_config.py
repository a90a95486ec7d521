"""Every setting is checked at start (taskrunner/config.py): a value the code or the scripts
cannot use is refused in one line naming its variable, by the library and by every command
(exit 2), instead of each enqueue failing in words about a job id the user never saw, or a
worker or dispatcher that spins, never runs a job, or dies of a traceback later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import fields

import pytest

from taskrunner import TaskRunner
from taskrunner.config import Settings
from tests.conftest import ROOT, free_port

#: (variable without TASKRUNNER_, value): each one refused.
BAD = [
    ("MAX_DURATION", "1e300"), ("MAX_DURATION", "-5"), ("MAX_DURATION", "nan"), ("MAX_DURATION", "inf"),
    ("MAX_DURATION", "0"), ("MAX_DURATION", "1e-05"),  # claim.lua cannot read "1e-05"
    ("DEAD_AFTER", "0"), ("DEAD_AFTER", "-1"), ("DEAD_AFTER", "nan"),
    ("HEARTBEAT", "0"), ("HEARTBEAT", "inf"), ("HEARTBEAT", "10"),  # not below dead_after (10)
    ("HEARTBEAT", "abc"),
    ("BUCKET_WIDTH", "0"), ("BUCKET_WIDTH", "1.5"),
    ("MAX_LOST", "0"), ("PREFETCH", "0"), ("PREFETCH", "-3"),
    ("IDLE_BLOCK", "0"), ("IDLE_BLOCK", "1e12"),
    ("KILL_GRACE", "-1"), ("KILL_GRACE", "nan"),
    ("DISPATCH_INTERVAL", "0"), ("DISPATCH_INTERVAL", "1e12"),  # a thread's wait dies of OverflowError
    ("MAX_PAYLOAD", "0"), ("RESULT_TTL", "0"), ("FAILED_TTL", "-1"), ("SHUTDOWN_GRACE", "-1"),
    ("STUCK_RECHECK", "0"), ("RETRY_BACKOFF_MAX", "-1"), ("RETRY_BACKOFF_MAX", "inf"),
    ("BLOCK_TIMEOUT", "nan"), ("BLOCK_TIMEOUT", "-1"), ("HISTORY_INTERVAL", "-1"), ("HISTORY_INTERVAL", "inf"),
    ("ENQUEUE_SPIN", "-0.1"), ("ENQUEUE_SPIN", "nan"),
    ("PREFIX", "app*"), ("PREFIX", "a[1]"), ("PREFIX", "a?"), ("PREFIX", "a\\b"), ("PREFIX", "x" * 201),
    ("EAGER", "maybe"),
]

#: Environments at the edges of the ranges: each one accepted.
GOOD = [
    {},  # the defaults
    {"MAX_DURATION": "0.0001"}, {"MAX_DURATION": str(2**53 - 1)},
    {"KILL_GRACE": "0", "SHUTDOWN_GRACE": "0", "HISTORY_INTERVAL": "0", "ENQUEUE_SPIN": "0", "BLOCK_TIMEOUT": "0",
     "RETRY_BACKOFF_MAX": "0"},
    {"PREFETCH": "1", "MAX_PAYLOAD": "1", "BUCKET_WIDTH": "1", "MAX_LOST": "1", "RESULT_TTL": "1", "FAILED_TTL": "1"},
    {"RESULT_TTL": str(2**31 - 1), "BUCKET_WIDTH": "60"},
    {"HEARTBEAT": "0.2", "DEAD_AFTER": "1.5", "IDLE_BLOCK": "0.001", "DISPATCH_INTERVAL": "0.01"},
    {"HEARTBEAT": "9.999", "DEAD_AFTER": "2147482", "IDLE_BLOCK": "2147482"},
    {"PREFIX": "my-app:tr_2.x@y"}, {"PREFIX": "x" * 200}, {"PREFIX": "team/caf\u00e9"},
    {"PREFIX": "{app}"}, {"PREFIX": "my app"},  # (review) worked before: nothing but a SCAN's glob reads it
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No setting from the environment the tests run in."""
    for f in fields(Settings):
        monkeypatch.delenv("TASKRUNNER_" + f.name.upper(), raising=False)
    return monkeypatch


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v[:20]}" for n, v in BAD])
def test_a_bad_setting_is_refused_in_one_line_naming_its_variable(clean_env: pytest.MonkeyPatch, name: str,
                                                                   value: str) -> None:
    clean_env.setenv(f"TASKRUNNER_{name}", value)
    with pytest.raises(ValueError) as e:
        Settings.from_env()
    message = str(e.value)
    assert message.startswith(f"TASKRUNNER_{name}=") and "\n" not in message, message
    assert " must be " in message or " is not a valid " in message, message


@pytest.mark.parametrize("env", GOOD, ids=lambda env: ",".join(f"{k}={v[:12]}" for k, v in env.items()) or "defaults")
def test_settings_at_the_edges_are_accepted(clean_env: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        clean_env.setenv(f"TASKRUNNER_{name}", value)
    settings = Settings.from_env()
    for name, value in env.items():
        assert getattr(settings, name.lower()) == (value if name == "PREFIX" else float(value))


def test_every_setting_has_its_range() -> None:
    """A setting added later is checked too, or this fails."""
    from taskrunner.config import _RANGES

    assert list(_RANGES) == [f.name for f in fields(Settings)]


def test_a_keyword_is_checked_as_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    """TaskRunner(...)'s keywords go through the same checks; a float where a whole number
    is wanted is refused unless it is one (result_ttl=timedelta(days=1).total_seconds(): taken
    as the whole number it is, as before the checks; review)."""
    with pytest.raises(ValueError, match=r"^TASKRUNNER_MAX_LOST=0 must be a whole number from 1 "):
        TaskRunner("kw", max_lost=0)
    with pytest.raises(ValueError, match=r"^TASKRUNNER_RESULT_TTL=3600\.5 must be a whole number"):
        TaskRunner("kw", result_ttl=3600.5)
    s = TaskRunner("kw", result_ttl=86400.0, max_lost=5.0, max_payload=1e6).settings
    assert (s.result_ttl, s.max_lost, s.max_payload) == (86400, 5, 1_000_000) and isinstance(s.result_ttl, int)
    assert TaskRunner("kw", heartbeat=1, dead_after=3).settings.heartbeat == 1


# -- the commands: one line on stderr, exit 2, before anything starts ---------------------

#: (command, variable, value): what a user would run with that mistake. Before the checks,
#: enqueue failed naming a job id, `jobs` used the prefix, the others ran (spinning, or
#: retrying a claim refused forever) until killed.
COMMANDS = [
    (["enqueue", "-A", "tests.apps", "tests.apps.add", "--args", "[1, 2]"], "MAX_DURATION", "1e300"),
    (["enqueue", "tests.apps.add", "--args", "[1, 2]"], "MAX_DURATION", "nan"),
    (["worker", "-A", "tests.apps", "-c", "1"], "BUCKET_WIDTH", "0"),
    (["worker", "-A", "tests.apps", "-c", "1"], "IDLE_BLOCK", "0"),
    (["dispatcher", "-A", "tests.apps"], "DISPATCH_INTERVAL", "0"),
    (["dashboard", "-A", "tests.apps", "--port", "0"], "MAX_PAYLOAD", "0"),
    (["up", "-A", "tests.apps", "--port", str(free_port())], "KILL_GRACE", "-1"),
    (["jobs"], "PREFIX", "app*"),
    (["enqueue", "tests.apps.add", "--args", "[1, 2]"], "HEARTBEAT", "abc"),
]


def _run(stack, args: list[str], env: dict[str, str], timeout: float = 30) -> tuple[int | None, str, str]:
    """`python -m taskrunner ARGS` in its own session; killed with its children if it has
    not ended within `timeout` (the exit code is then None)."""
    p = subprocess.Popen([sys.executable, "-m", "taskrunner", *args], cwd=ROOT, env={**stack.env, **env},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err


@pytest.mark.parametrize(("args", "name", "value"), COMMANDS, ids=[f"{a[0]}-{n}={v}" for a, n, v in COMMANDS])
def test_a_command_refuses_a_bad_setting_in_one_line_exit_2(stack, args: list[str], name: str, value: str) -> None:
    code, out, err = _run(stack, args, {f"TASKRUNNER_{name}": value})
    assert (code, out, err.count("\n")) == (2, "", 1), (code, out, err[-2000:])
    assert err.startswith(f"Error: TASKRUNNER_{name}="), err


def test_a_command_takes_settings_at_the_edges(stack) -> None:
    code, out, err = _run(stack, ["enqueue", "tests.apps.add", "--args", "[1, 2]"],
                          {"TASKRUNNER_MAX_DURATION": "0.0001", "TASKRUNNER_PREFETCH": "1",
                           "TASKRUNNER_KILL_GRACE": "0"})
    assert code == 0 and len(out.split()) == 1, (code, out, err)
