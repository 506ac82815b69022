"""How fast this host moves memory right now, recorded with every benchmark run.

The same code gave very different loopback ratios on two VMs a day apart (a 4 KiB op at 1.57x
gloo on one, 0.97x on the other) while a 64 MiB copy took 7-15 ms on the first and 4.6 ms on the
second: tables from different runs compare only when their hosts do.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

PROBE_BYTES = 64 << 20


def memmove_ms(nbytes: int = PROBE_BYTES, repeats: int = 7) -> float:
    """Median milliseconds of one ``nbytes`` memory-to-memory copy (numpy, buffers touched
    first so that no page faults are timed)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
