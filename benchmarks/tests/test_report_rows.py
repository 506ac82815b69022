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


def test_cpu_per_gb_counts_what_each_system_sends() -> None:
    """8 ranks, a 25 MB model: a ring allreduce sends 8 x 2 x 7/8 x 25 MB = 350 MB, a
    one-peer step 8 x 25 MB = 200 MB."""
    res = {"nodes": 8, "mbytes": 25, "gloo": {"cpu_s_per_repeat": [0.3, 0.35, 0.4]},
           "decent": {"cpu_s_per_repeat": [0.5, 0.2, 0.3]}}
    gloo, decent = report.cpu_per_gb(res) or (0.0, 0.0)
    assert abs(gloo - 0.35 / 0.35) < 1e-12 and abs(decent - 0.3 / 0.2) < 1e-12
    assert report.cpu_per_gb({"nodes": 8, "mbytes": 25, "gloo": {}, "decent": {}}) is None


def test_cpu_text_is_per_gb_of_the_tensor() -> None:
    entry = {"nbytes": 64 << 20, "cpu_s_per_call": {"gloo": 0.0671088640, "nar": 0.1342177280}}
    assert report.cpu_text(entry, "nar") == "; CPU 2.00 vs 1.00 s per GB"
    assert report.cpu_text(entry, "nar_reg") == ""
