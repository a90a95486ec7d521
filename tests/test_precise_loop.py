"""The loop child's event loop (taskrunner/worker/precise_loop.py): epoll, waited on with a
timeout to the microsecond. What it must keep doing is what any selector does: report what
is ready, whatever the timeout, and wait when nothing is."""

from __future__ import annotations

import asyncio
import os
import selectors
import sys

import pytest

from taskrunner.worker import precise_loop

pytestmark = pytest.mark.skipif(not hasattr(selectors, "EpollSelector"), reason="epoll: Linux")


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


@pytest.mark.parametrize("fd_setsize", [precise_loop.FD_SETSIZE, 0])  # 0: epoll's own timeout
def test_it_reports_what_is_ready_whatever_the_timeout(pipe, monkeypatch, fd_setsize):
    monkeypatch.setattr(precise_loop, "FD_SETSIZE", fd_setsize)
    r, w = pipe
    with precise_loop.PreciseSelector() as sel:
        sel.register(r, selectors.EVENT_READ, "reader")
        assert sel.select(0.0023) == []  # nothing ready: it waited, and says so
        assert sel.select(0) == []
        os.write(w, b"x")
        for timeout in (0.0023, 0, None, 5):
            assert [(k.data, ev) for k, ev in sel.select(timeout)] == [("reader", selectors.EVENT_READ)]


def test_run_runs_a_coroutine_to_its_end_on_it():
    async def main(seen: list) -> None:
        await asyncio.sleep(0.002)
        seen.append(type(asyncio.get_running_loop()._selector))  # type: ignore[attr-defined]

    seen: list = []
    precise_loop.run(main(seen))
    # Python 3.10 has no asyncio.Runner to take a loop factory: asyncio's own loop there.
    assert seen == [precise_loop.PreciseSelector if sys.version_info >= (3, 11) else selectors.EpollSelector]
