"""The convergence and chaos figures are redrawn from small JSON files alone (``--replot``, real
matplotlib on Agg): one algorithm per panel on a shared y-axis; one run per row, every event
of the JSON labelled on that run's axes and on no other's, a note saying why a line stops early,
and no legend over the data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import convergence, plots  # noqa: E402

#: the small chaos JSON's events, and the label each must get on its own run's axes
EXPECTED = {
    "baseline": {"spawn": "spawned 5.0 s before t = 0"},
    "kill": {"spawn": "spawned 6.0 s before t = 0", "kill": "rank 2 killed",
             "restart": "rank 2 restarted", "in_sync": "rank 2's first step with neighbors",
             "in_range": "rank 2's distance within the survivors'",
             "detection": "rank 2 declared down (+0.05 s", "custom_probe": "custom probe"},
    "flap": {"spawn": "spawned 5.5 s before t = 0", "flap_down": "rank 1's link down",
             "flap_up": "rank 1's link up", "averaged_again": "averaged with rank 1 again",
             "detection": "rank 1 declared down (+1.00 s"},
    "gloo": {"spawn": "spawned 4.0 s before t = 0", "kill": "rank 2 killed",
             "first_error": "first survivor error (+0.10 s)",
             "last_exit": "last survivor exited (+0.80 s)"},
}


def series(steps: int, t_step: float = 0.15) -> dict[str, list[dict[str, Any]]]:
    """``steps`` steps of 150 ms, a consensus point every 5 (ranks 0..2)."""
    cons = [{"k": k, "t": k * t_step, "dist": {str(r): 1e-3 / k * (r + 1) for r in range(3)},
             "mean": 2e-3 / k} for k in range(5, steps + 1, 5)]
    return {"step_ms": [{"k": k, "t": k * t_step, "ms": 150.0 + (k % 3)}
                        for k in range(1, steps + 1)], "consensus": cons}


def chaos_result() -> dict[str, Any]:
    """A 3-node chaos.json: a kill at 2 s and restart at 4 s, a 2 s flap, gloo dead at step 10."""
    config = {"nodes": 3, "steps": 40, "kill_rank": 2, "flap_rank": 1, "flap_s": 2.0,
              "heartbeat": 0.5, "dead_after": 1.5, "snapshot_every": 5}
    kill = {"events_s": {"spawn": -6.0, "kill": 2.0, "restart": 4.0, "in_sync": 5.0,
                         "in_range": 5.5, "custom_probe": 3.0}, "series": series(40),
            "detection": {"detect_s": 0.05, "detect_heartbeats": 0.1}}
    flap = {"events_s": {"spawn": -5.5, "flap_down": 3.0, "flap_up": 5.0,
                         "averaged_again": 5.3}, "series": series(40),
            "detection": {"detect_s": 1.0, "detect_heartbeats": 2.0}}
    gloo = {"events_s": {"spawn": -4.0, "kill": 2.0}, "series": {"step_ms": series(10)["step_ms"]},
            "first_error_s": 0.1, "last_error_s": 0.5, "last_exit_s": 0.8,
            "survivors_failed": 2, "survivors_hung": [], "restart_cost": {"total_s": 9.0},
            "error_sample": "RuntimeError: [/src/gloo/pair.cc:553] Connection closed by peer "
                            "[10.0.0.3]:1. This is typically caused by a crash."}
    return {"config": config, "scenarios": {
        "baseline": {"events_s": {"spawn": -5.0}, "series": series(40)},
        "kill": kill, "flap": flap, "gloo": gloo}}


def texts(axes: Any) -> list[str]:
    """Every text drawn on these axes (labels, notes, titles)."""
    return [t.get_text() for ax in axes for t in [*ax.texts, ax.title]]


@pytest.mark.slow
def test_chaos_replot_draws_the_png_from_the_json(tmp_path: Path) -> None:
    (tmp_path / "chaos.json").write_text(json.dumps(chaos_result()))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--replot",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "chaos.png").stat().st_size > 10_000


def test_chaos_labels_every_event_on_its_own_run_only() -> None:
    res = chaos_result()
    fig = plots.chaos_figure(res)
    rows = {name: fig.axes[2 * i:2 * i + 2] for i, name in enumerate(plots.RUNS)}
    for name, wanted in EXPECTED.items():
        mine = texts(rows[name])
        for key, label in wanted.items():
            assert any(label in t for t in mine), (name, key, mine)
    for name in ("kill", "flap"):  # their own events on their own axes, on no other run's
        others = [t for other, axes in rows.items() if other != name for t in texts(axes)]
        for key, label in EXPECTED[name].items():
            if key not in ("spawn", "kill"):  # the same kill hits gloo too
                assert not any(label in t for t in others), (name, key)
    # gloo's line stops at step 10 of 40: said where it stops, with the reason from the JSON
    notes = texts(rows["gloo"])
    assert any("gloo stopped at step 10 of 40" in t and "rank 2 was killed" in t for t in notes)
    assert any("Connection closed by peer [10.0.0.3]:1" in t for t in notes), notes
    assert all(ax.get_legend() is None for ax in fig.axes) and fig.legends


def test_chaos_events_sit_at_their_times() -> None:
    """Each event label starts (or ends) at its line, on the run's own clock."""
    res = chaos_result()
    fig = plots.chaos_figure(res)
    kill_axes = fig.axes[2:4]
    for t, label, _ in plots.run_events(res, "kill"):
        if t < 0:
            continue
        placed = [x for ax in kill_axes for x in ax.texts if x.get_text().strip() == label]
        assert len(placed) == 2 and all(x.get_position()[0] == pytest.approx(t)
                                        for x in placed), label


def outcome(label: str, split: str, scale: float, large: bool = False,
            seed: int = 0) -> dict[str, Any]:
    """One run of convergence.json, its loss curve ``scale`` times a common decay."""
    epochs = 6
    return {"spec": {"dataset": "digits", "split": split, "label": label, "epochs": epochs,
                     "batch": 16, "lr": 0.05, "large_batch": large, "seed": seed,
                     "weight_decay": 0.01 if large else 0.0},
            "topology": "hypercube" if large else "exponential", "avg_model_acc": 95.0,
            "worker_acc": [95.0, 94.0], "losses": [scale * 2.0 / (e + 1) for e in range(epochs)]}


def convergence_outcomes() -> list[dict[str, Any]]:
    """Three algorithms, iid and non-iid, and a large-batch pair over two seeds."""
    runs = [outcome(label, split, scale) for label, scale in
            (("allreduce", 1.0), ("dsgd", 1.05), ("choco-topk", 4.0))
            for split in ("iid", "non-iid")]
    return runs + [outcome(label, "non-iid", s, large=True, seed=seed)
                   for label, s in (("dmsgd", 1.3), ("decentlam", 1.1)) for seed in (0, 1)]


def test_convergence_replot_one_algorithm_per_panel(tmp_path: Path) -> None:
    outcomes = convergence_outcomes()
    (tmp_path / "convergence.json").write_text(json.dumps({"outcomes": outcomes}))
    assert convergence.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "convergence_digits.png").stat().st_size > 10_000
    fig = plots.convergence_figure(outcomes, "digits")
    panels = [ax for ax in fig.axes if ax.get_title(loc="left").split("  ")[0] in
              ("allreduce", "dsgd", "choco-topk")]
    assert [ax.get_title(loc="left").split("  ")[0] for ax in panels] == \
        ["allreduce", "dsgd", "choco-topk"]
    assert len({ax.get_ylim() for ax in panels}) == 1  # one y-axis for all
    for ax in panels[1:]:  # its own iid and non-iid curves over allreduce's two
        lines = ax.get_lines()
        assert len(lines) == 4, [ln.get_color() for ln in lines]
        assert [ln.get_color() for ln in lines[2:]] == [plots.IID, plots.NON_IID]
    assert all(ax.get_legend() is None for ax in panels) and fig.legends
