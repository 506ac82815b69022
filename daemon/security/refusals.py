"""Refused attempts, counted and logged at a bounded rate.

A door is where a caller is refused before it proved who it is: a bulk connection that never
said a valid HELLO (or was evicted to make room), a challenge, handshake or status request that
failed its check, a local worker refused. Every refusal counts in the Prometheus counter
``decent_refused_total{door}``. The first :data:`BURST` refusals at a door in each
:data:`WINDOW` seconds are logged as they happen; the rest are only counted, and one line sums
them up when the window ends. A steady stream of hostile attempts then writes a few lines a
minute per door instead of one line each (about 70 KB/s before).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("decentd.security.refusals")

#: refusals logged one by one at a door per window
BURST = 10
#: seconds of a window
WINDOW = 60.0


@dataclass
class _Door:
    """One door's current window."""

    start: float
    logged: int = 0
    unlogged: int = 0
    summary: asyncio.TimerHandle | None = None


class Refusals:
    """The refusals of one daemon, by door."""

    def __init__(self, registry: CollectorRegistry, burst: int = BURST, window: float = WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Count into ``registry``; log ``burst`` lines per door per ``window`` seconds."""
        self.counter = Counter("decent_refused", "Attempts refused before the caller proved "
                               "who it is, by door (each is logged only up to a rate)",
                               ["door"], registry=registry)
        self.burst = burst
        self.window = window
        self._clock = clock
        self._doors: dict[str, _Door] = {}
        self._totals: dict[str, int] = {}

    def refused(self, door: str, message: str, level: int = logging.WARNING) -> None:
        """Count one refusal at ``door``; log ``message`` unless this window's lines are spent
        (then the window's summary line counts it)."""
        self.counter.labels(door).inc()
        self._totals[door] = self._totals.get(door, 0) + 1
        now = self._clock()
        state = self._doors.get(door)
        if state is None or now - state.start >= self.window:
            if state is not None:
                self._summarize(door, state)
            state = self._doors[door] = _Door(now)
        if state.logged < self.burst:
            state.logged += 1
            log.log(level, "%s", message)
            return
        state.unlogged += 1
        if state.summary is None:
            state.summary = _later(state.start + self.window - now,
                                   lambda: self._summarize(door, state))

    def total(self, door: str) -> int:
        """Refusals counted at ``door`` since the daemon started."""
        return self._totals.get(door, 0)

    def _summarize(self, door: str, state: _Door) -> None:
        """The line for what ``state``'s window did not log (once)."""
        if state.summary is not None:
            state.summary.cancel()
            state.summary = None
        if state.unlogged:
            log.warning("%d more refusals at the %s were not logged in the last %gs (a "
                        "flood? decent_refused_total counts them all)", state.unlogged, door,
                        self.window)
            state.unlogged = 0


def _later(delay: float, call: Callable[[], None]) -> asyncio.TimerHandle | None:
    """``call`` after ``delay`` seconds on the running loop (None outside one: the next
    refusal after the window sums it up instead)."""
    try:
        return asyncio.get_running_loop().call_later(max(0.0, delay), call)
    except RuntimeError:
        return None
