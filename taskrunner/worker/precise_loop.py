"""The event loop of a worker's loop child (loop_child.py), with timers that fire on time.

epoll_wait() takes its timeout in whole milliseconds, and Python rounds it up, so on Linux
every asyncio timer (asyncio.sleep, wait_for, call_later) fires up to 1 ms late, ~0.5 ms
on average, more when a loop wakes rarely. In bench/io_bound.py (20 ms asyncio.sleep jobs,
`-c 2 --async-slots 128`) a job's coroutine took 21.8 ms: 91% of the ideal at 256-way;
with waits to the microsecond, 97%. PreciseSelector waits with select() on the epoll
descriptor itself (readable once any descriptor it watches is ready), whose timeout counts
microseconds, then collects the events with epoll_wait() without waiting: one more system
call per wait, as many descriptors as epoll takes."""

from __future__ import annotations

import asyncio
import select
import selectors
import sys
from collections.abc import Coroutine
from typing import Any

#: select() takes descriptors below this (FD_SETSIZE); an epoll descriptor above it (a
#: process with a thousand files open first) keeps epoll's own, millisecond, timeout.
FD_SETSIZE = 1024


if hasattr(selectors, "EpollSelector"):
    class PreciseSelector(selectors.EpollSelector):
        def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            if timeout is not None and timeout > 0 and self.fileno() < FD_SETSIZE:
                select.select([self.fileno()], [], [], timeout)
                timeout = 0
            return super().select(timeout)


def run(main: Coroutine[Any, Any, None]) -> None:
    """asyncio.run(main) on a loop with PreciseSelector where there is one (Linux, Python
    3.11+: asyncio.Runner takes a loop factory); elsewhere asyncio's own loop."""
    if sys.version_info >= (3, 11) and hasattr(selectors, "EpollSelector"):
        with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(PreciseSelector())) as runner:
            runner.run(main)
    else:
        asyncio.run(main)
