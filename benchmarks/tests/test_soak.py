"""``make soak``'s figures come out as claimed: the churn run's analysis on records whose answers
are known, its report and plot, and the load run end to end (short settings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import soak, soak_analysis, soak_report

REPO = Path(__file__).resolve().parents[2]


def step(t: float, src: list[int], k: int = 1) -> dict[str, Any]:
    return {"inc": 0, "k": k, "t": t, "dur": 0.1, "src": src}


def churn_run(start: float) -> dict[str, Any]:
    """Three ranks in a ring for 100 s; rank 2's daemon killed at 20 s and restarted at 21 s,
    back in rank 0's averages at 24 s and in rank 1's at 26 s; rank 1 fails a step at 50 s
    (no fault struck it), rank 2 one at 20.5 s (its own fault)."""
    recs: list[list[dict[str, Any]]] = [[], [], []]
    for t in range(100):
        for r in range(3):
            others = [q for q in range(3) if q != r]
            gone = 20 <= t < {0: 24, 1: 26, 2: 26}[r]
            src = [q for q in others if not (gone and (q == 2 or r == 2))]
            recs[r].append(step(start + t + 0.5, src))
    recs[1].append({"inc": 0, "k": 3, "t": start + 50, "error": "x"})
    recs[2].append({"inc": 0, "k": 3, "t": start + 20.5, "error": "x"})
    samples = [{"t": start + t, "daemons": {
        "0": {"pid": 10, "rss_mb": 100 + t / 100, "fds": 30, "epoch": 5, "live": [0, 1, 2],
              "cpu_s": t},
        "2": {"pid": 12 if t < 21 else 13, "rss_mb": 90, "fds": 31, "epoch": 5,
              "live": [0, 1, 2], "cpu_s": t}}} for t in range(0, 100, 2)]
    return {"name": "soak", "start": start, "until": start + 100, "samples": samples,
            "events": [{"t": start + 20, "kind": "kill_daemon", "node": 2},
                       {"t": start + 21, "kind": "restart_daemon", "node": 2},
                       {"t": start + 21.5, "kind": "restart_worker", "node": 2}],
            "records": recs, "final": samples[-1]["daemons"], "starts": {"decentd-2": 1},
            "results": [{"rank": r, "inc": 0, "accuracy": 97.0} for r in range(3)]}


def test_the_churn_figures_are_those_of_known_records() -> None:
    run = churn_run(1000.0)
    back = soak_analysis.back_in_neighbors(run)
    # the worker of the restarted daemon is counted from the daemon's restart
    assert [(b["kind"], b["node"]) for b in back] == [("restart_daemon", 2)]
    assert back[0]["back_s"] == pytest.approx(26.5 - 21)  # rank 1 is the last to average it
    assert soak_analysis.lost_steps(run) == {"0": 0, "1": 1, "2": 0}
    assert soak_analysis.flatness(run, 60) == {"0": {"rss_mb": [100.6, 101.0], "fds": [30, 30]},
                                      "2": {"rss_mb": [90, 90], "fds": [31, 31]}}
    assert soak_analysis.views_agree(run["final"])
    assert not soak_analysis.views_agree({"0": {"epoch": 5, "live": [0, 1]},
                                 "1": {"epoch": 6, "live": [0, 1]}})
    assert soak_analysis.steps_per_second(run, 1000, 1100) == 3.0


def test_the_report_and_plot_are_written_from_the_json_alone(tmp_path: Path) -> None:
    soak_run = churn_run(1000.0)
    base = {**churn_run(2000.0), "events": [], "name": "baseline"}
    a = soak.build_parser().parse_args(["--nodes", "3", "--duration", "100"])
    res = {"date": "d", "cpus": 2, "config": vars(a) | {"out": "x"},
           **soak_analysis.analyze(soak_run, base, a),
           "series": {"soak": soak_analysis.series(soak_run),
                      "baseline": soak_analysis.series(base)}}
    res = json.loads(json.dumps(res, default=str))  # as soak.json holds it
    assert res["verdicts"]["survivors_steps_lost"] == {"value": 1, "met": False}
    assert res["verdicts"]["worst_back_in_neighbors_s"]["met"] is True
    text = soak_report.markdown(res)
    assert "| survivors' failed steps | 1 | 0 | MISSED |" in text, text
    soak_report.write_png(res, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_load_run_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "decentd.tools.launcher", "-np", "2", "--nodes", "2", "--set",
         "memory.arena_bytes=67108864", "--", sys.executable,
         str(REPO / "benchmarks" / "soak_load.py"), "--small-s", "1", "--large-s", "1",
         "--large-mib", "8", "--sample-s", "0.3",
         "--json", str(out)], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [p["name"] for p in res["phases"]] == ["4 KiB", "8 MiB"]
    for p in res["phases"]:
        assert p["ops_per_s"] > 0 and 0 < p["p50_ms"] <= p["p99_ms"], p
        assert len(p["daemons"]) == 2, p
        for d in p["daemons"]:
            assert len(d["rss_mb"]) == 3 and d["rss_mb"][0] > 0 and len(d["rss_series"]) >= 3, d
    assert "## Load held" in "\n".join(soak_report.load_markdown(res))
