"""Every benchmark run stops by itself, and cleans up when stopped."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any


def stop_after(seconds: float, error: Callable[[], BaseException]) -> None:
    """After `seconds`, raise error() in the main thread (SIGALRM); on SIGTERM raise
    KeyboardInterrupt, as Ctrl-C would: either way the run's finally blocks stop what it
    started."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise error()

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.alarm(max(1, int(seconds)))
