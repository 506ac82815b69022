"""How much slower this host runs now than the quiet 2-core VM the tests' waits were set on.

The session's first process measures it once (:func:`measure`: the mean wall time of ten runs
of a fixed piece of Python work, against :data:`REFERENCE_S`; a mean, so that CPU hogs beside
it show, where a best run would slip between them) and hands it to pytest-xdist's workers in
``$DECENT_TEST_HOST_FACTOR``. The waits of tests for something another process causes (a peer
seen down, a link healed, a worker's op) scale by it (:func:`scaled`), so that a loaded host (two
CPU hogs beside the suite) makes them longer instead of failing them; the daemons' own fault
detection (heartbeats, ``peer_dead_after``) is what several tests measure, and is left alone.
"""

from __future__ import annotations

import os
import time

#: the mean of ten runs of :func:`_work` on the quiet 2-core, 24 GiB VM (2026-12-06)
REFERENCE_S = 0.011
#: never shorter than the waits as written, and at most this many times longer
MAX_FACTOR = 8.0
ENV = "DECENT_TEST_HOST_FACTOR"


def _work() -> int:
    return sum(i * i % 7 for i in range(200_000))


def measure() -> float:
    """This host's factor now: the mean wall time of ten runs of the fixed work over the
    reference, between 1 and :data:`MAX_FACTOR`."""
    start = time.perf_counter()
    for _ in range(10):
        _work()
    return min(MAX_FACTOR, max(1.0, (time.perf_counter() - start) / 10 / REFERENCE_S))


def factor() -> float:
    """The session's factor (measured by its first process), or 1 outside a session."""
    return float(os.environ.get(ENV, "1"))


def scaled(seconds: float) -> float:
    """``seconds`` of waiting for another process, on this host now."""
    return seconds * factor()
