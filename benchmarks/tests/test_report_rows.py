"""The report's memory row (issue 45): a daemon's own memory, the workers' shared pages aside,
at the end of the loopback run against its start."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import report  # noqa: E402

MiB = 1 << 20


def daemon(rank: int, start: int, end: int, shared_end: int) -> dict[str, object]:
    """A daemon's samples: ``start`` and ``end`` MiB of its own, ``shared_end`` MiB shared."""
    return {"rank": rank, "start": {"VmRSS": start * MiB, "RssShmem": 0},
            "peak": {"VmRSS": 600 * MiB}, "end": {"VmRSS": (end + shared_end) * MiB,
                                                  "RssShmem": shared_end * MiB}}


def test_the_memory_row_compares_the_daemons_own_memory_and_takes_the_worst_rank() -> None:
    row = report.memory_row([daemon(0, 80, 100, 256), daemon(1, 80, 110, 256)])
    assert (row["value"], row["pass"], row["target"]) == (110 / 80, True, "<= 1.50x")
    assert "own 80.0 MiB -> 110.0 MiB (1.38x)" in row["measured"]
    assert "end 366.0 MiB" in row["measured"]
    failing = report.memory_row([daemon(0, 80, 121, 0)])
    assert (failing["value"], failing["pass"]) == (121 / 80, False)
    assert report.memory_row([])["pass"] is None
