"""The main job and the benchmark still run end to end (short settings), under decentrun."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-m", "decentd.launcher"]


def test_train_digits_dsgd_and_allreduce_learn() -> None:
    proc = subprocess.run(
        [*RUN, "-np", "2", "--topology", "ring", "--", sys.executable,
         str(REPO / "examples" / "train_digits.py"), "--epochs", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.search(r"│ (dsgd|allreduce)\s+│([\d. ]+)│\s+([\d.]+) │\s+([\d.]+) │\s+([\d.e-]+) │",
                      line)
        if m:
            rows[m.group(1)] = [float(v) for v in m.group(2).split()], float(m.group(4)), \
                float(m.group(5))
    assert set(rows) == {"dsgd", "allreduce"}, proc.stdout[-3000:]
    for algo, (workers, averaged, _) in rows.items():
        assert len(workers) == 2
        assert averaged > 80.0, (algo, averaged)  # 3 epochs on digits: well above chance (10%)
    assert rows["allreduce"][2] == 0.0  # allreduce keeps the replicas identical


def test_p2p_benchmark_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*RUN, "-np", "2", "--", sys.executable, str(REPO / "benchmarks" / "p2p_vs_gloo.py"),
         "--quick", "--sizes", "4K,1M", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "p2p_vs_gloo.md").read_text()
    assert "| 4 KiB |" in report and "| 1 MiB |" in report
    assert (tmp_path / "p2p_vs_gloo.png").stat().st_size > 10_000
