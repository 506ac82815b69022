"""The convergence and chaos figures, drawn from the benchmarks' JSON alone (no re-run).

    .venv/bin/python benchmarks/convergence.py --replot   # convergence_<dataset>.png
    .venv/bin/python benchmarks/chaos.py --replot         # chaos.png

Small multiples, so that no curve hides another: in ``convergence_<dataset>.png`` one panel per
algorithm (its iid and non-iid training loss over allreduce's as a reference band, a y-axis
shared by all), the large-batch comparison and the final losses relative to allreduce's; in
``chaos.png`` one row per run on that run's own clock (consensus distance left, step time
right), every event drawn and labelled on the axes where it happened, and a note where a line
ends early saying why (the reason read from the JSON).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import Bbox

IID, NON_IID = "tab:blue", "tab:orange"
#: the large-batch comparison's colors
LARGE = {"dmsgd": "tab:red", "decentlam": "tab:green"}
#: where an event label's top sits, in axes fraction, and the step between label levels
LABEL_TOP, LABEL_STEP = 0.97, 0.085


# ------------------------------------------------------------------------------ convergence


def plain_log_ticks(axis: Axis, subs: tuple[float, ...] = (1.0, 3.0)) -> None:
    """A log axis labelled in plain numbers at ``subs`` times the powers of ten (0.01, 0.03,
    0.1, 0.3, 1, ...), its minor ticks bare."""
    axis.set_major_locator(LogLocator(subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _runs(outcomes: list[dict[str, Any]], ds: str, large: bool) -> list[dict[str, Any]]:
    return [o for o in outcomes if o["spec"]["dataset"] == ds and o["spec"]["large_batch"] == large]


def _loss_panel(ax: Axes, by: dict[str, dict[str, Any]], ref: dict[str, dict[str, Any]],
                label: str) -> None:
    """One algorithm: its iid (solid) and non-iid (dashed, on top) loss curves over
    allreduce's (both splits) as a wide gray band."""
    for split in ("iid", "non-iid"):
        if split in ref and label != "allreduce":
            losses = ref[split]["losses"]
            ax.plot(range(1, len(losses) + 1), losses, color="0.55", lw=7, alpha=0.3,
                    solid_capstyle="butt")
    for split, color, style in (("iid", IID, "-"), ("non-iid", NON_IID, (0, (4, 2.5)))):
        if split in by:
            losses = by[split]["losses"]
            ax.plot(range(1, len(losses) + 1), losses, color=color, lw=1.7, ls=style)
    first = next(iter(by.values()))
    accs = " / ".join(f"{by[s]['avg_model_acc']:.1f}" if s in by else "-"
                      for s in ("iid", "non-iid"))
    ax.set_title(f"{label}  ({first['topology']})", fontsize=9.5, loc="left")
    ax.text(0.97, 0.95, f"test acc. iid / non-iid:\n{accs} %", transform=ax.transAxes,
            ha="right", va="top", fontsize=7.5, color="0.25")
    ax.grid(alpha=0.3)


def _large_panel(ax: Axes, runs: list[dict[str, Any]]) -> None:
    """The large-batch comparison: every seed thin, the mean over the seeds bold."""
    import numpy as np

    for label in dict.fromkeys(o["spec"]["label"] for o in runs):
        group = [o for o in runs if o["spec"]["label"] == label]
        color = LARGE.get(label, "tab:gray")
        for o in group:
            ax.plot(range(1, len(o["losses"]) + 1), o["losses"], color=color, lw=0.6, alpha=0.3)
        mean = np.mean([o["losses"] for o in group], axis=0)
        acc = np.mean([o["avg_model_acc"] for o in group])
        ax.plot(range(1, len(mean) + 1), mean, color=color, lw=2.2,
                label=f"{label}: mean of {len(group)} seeds (final loss {mean[-1]:.3f}, "
                      f"test acc. {acc:.1f} %)")
    spec = runs[0]["spec"]
    ax.set_title(f"large batch, non-iid: softmax regression, weight decay "
                 f"{spec['weight_decay']:g}, lr {spec['lr']:g}, hypercube; thin: one seed each",
                 fontsize=9.5, loc="left")
    ax.set_xlabel("step (each worker's whole shard)")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis, (1.0, 2.0, 5.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)


def _ratio_panel(ax: Axes, labels: list[str], rows: list[dict[str, Any]]) -> None:
    """Each algorithm's final training loss divided by allreduce's, iid and non-iid."""
    ref = {o["spec"]["split"]: o["losses"][-1] for o in rows if o["spec"]["label"] == "allreduce"}
    for offset, (split, color, marker) in zip((-0.15, 0.15), (("iid", IID, "o"),
                                                              ("non-iid", NON_IID, "s")),
                                              strict=True):
        points = [(i + offset, o["losses"][-1] / ref[split]) for i, label in enumerate(labels)
                  for o in rows if o["spec"]["label"] == label and o["spec"]["split"] == split
                  and split in ref]
        ax.plot([v for _, v in points], [y for y, _ in points], marker, color=color, ms=5)
    ax.axvline(1.0, color="0.4", lw=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis, (1.0, 1.5, 2.0, 3.0, 5.0, 7.0))
    ax.set_xlabel("final training loss ÷ allreduce's (same split; 1 = as good)")
    ax.set_title("where each algorithm ends", fontsize=9.5, loc="left")
    ax.grid(alpha=0.3, axis="x")


def convergence_figure(outcomes: list[dict[str, Any]], ds: str, ncols: int = 4) -> Figure:
    """``ds``'s figure: a panel per algorithm (shared axes), the large batch, the end points."""
    rows = _runs(outcomes, ds, large=False)
    labels = list(dict.fromkeys(o["spec"]["label"] for o in rows))
    large = _runs(outcomes, ds, large=True)
    grid_rows = math.ceil(len(labels) / ncols)
    fig = plt.figure(figsize=(3.6 * ncols, 2.5 * grid_rows + 4.6))
    gs = fig.add_gridspec(grid_rows + 1, ncols, height_ratios=[1] * grid_rows + [1.5],
                          left=0.07, right=0.98, top=1 - 0.8 / fig.get_figheight(),
                          bottom=1.15 / fig.get_figheight(), hspace=0.42, wspace=0.12)
    ref = {o["spec"]["split"]: o for o in rows if o["spec"]["label"] == "allreduce"}
    first: Axes | None = None
    for i, label in enumerate(labels):
        ax = fig.add_subplot(gs[i // ncols, i % ncols], sharex=first, sharey=first)
        first = first or ax
        _loss_panel(ax, {o["spec"]["split"]: o for o in rows if o["spec"]["label"] == label},
                    ref, label)
        ax.set_yscale("log")
        plain_log_ticks(ax.yaxis)
        ax.tick_params(labelbottom=i + ncols >= len(labels), labelleft=i % ncols == 0)
        if i % ncols == 0:
            ax.set_ylabel("training loss", fontsize=8.5)
        if i + ncols >= len(labels):
            ax.set_xlabel("epoch", fontsize=8.5)
    bottom = gs[grid_rows, :].subgridspec(1, 2, wspace=0.3)
    if large:
        _large_panel(fig.add_subplot(bottom[0, 0]), large)
    _ratio_panel(fig.add_subplot(bottom[0, 1]), labels, rows)
    spec = rows[0]["spec"]
    fig.suptitle(f"{ds}: loss on the whole training set (mean of the workers' models) per "
                 f"algorithm, {len(rows[0]['worker_acc'])} workers, {spec['epochs']} epochs, "
                 f"batch {spec['batch']}/worker, lr {spec['lr']:g}; test acc. = averaged model",
                 fontsize=11)
    fig.legend(handles=[Line2D([], [], color=IID, lw=1.7, label="iid"),
                        Line2D([], [], color=NON_IID, lw=1.7, ls=(0, (4, 2.5)),
                               label="non-iid (dashed: drawn over iid where they coincide)"),
                        Line2D([], [], color="0.55", lw=7, alpha=0.3,
                               label="allreduce, iid and non-iid: the reference in every panel")],
               loc="upper center", bbox_to_anchor=(0.5, 1 - 0.34 / fig.get_figheight()),
               ncol=3, fontsize=8.5, frameon=False)
    return fig


def write_convergence(outcomes: list[dict[str, Any]], out: Path) -> list[Path]:
    """``convergence_<dataset>.png`` for every dataset of ``outcomes``; their paths."""
    paths = []
    for ds in dict.fromkeys(o["spec"]["dataset"] for o in outcomes):
        fig = convergence_figure(outcomes, ds)
        path = out / f"convergence_{ds}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------ chaos events


def label_events(ax: Axes, events: Sequence[tuple[float, str, str]]) -> int:
    """Draw each event ``(t, label, color)`` as a vertical line on ``ax``, its label at the
    top, labels that would overlap moved down a level (an event before the axis begins: its
    label at the left edge, no line). Returns the number of levels used."""
    renderer = ax.figure.canvas.get_renderer()  # type: ignore[attr-defined]
    frame = ax.get_window_extent(renderer)
    levels: list[list[Bbox]] = []
    left = ax.get_xlim()[0]
    # the events on the axis first, in time order; those before it last, at its left edge
    for t, label, color in sorted(events, key=lambda e: (e[0] < left, e[0])):
        if t >= left:
            ax.axvline(t, color=color, lw=1.1, ls="--")
        else:  # before the axis begins: said at its left edge
            t, label = left, f"◂ {label}"
        for level in range(20):
            y = LABEL_TOP - level * LABEL_STEP
            text = ax.text(t, y, f" {label} ", transform=ax.get_xaxis_transform(), ha="left",
                           va="top", fontsize=7.5, color=color,
                           bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 0.4})
            box = text.get_window_extent(renderer)
            if box.x1 > frame.x1:  # near the right edge: the label goes left of its line
                text.set_horizontalalignment("right")
                box = text.get_window_extent(renderer)
            levels += [[]] * (level + 1 - len(levels))
            if not any(box.overlaps(other) for other in levels[level]):
                levels[level] = [*levels[level], box]
                break
            text.remove()
    return len(levels)


def headroom(ax: Axes, lo: float, hi: float, levels: int) -> None:
    """A log y-axis from ``lo`` to above ``hi``, so that ``levels`` label levels fit above
    the data."""
    frac = max(0.3, LABEL_TOP - levels * LABEL_STEP - 0.03)
    low, high = math.log10(lo) - 0.05, math.log10(hi) + 0.05
    ax.set_ylim(10 ** low, 10 ** (low + (high - low) / frac))


def _short_error(text: str | None) -> str:
    """An exception's type and first sentence, source paths dropped."""
    if not text:
        return "no error recorded"
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h|py):\d+\]\s*", "", text.splitlines()[0])
    return text.split(". ")[0]


def run_events(res: dict[str, Any], name: str) -> list[tuple[float, str, str]]:
    """Every event of the run ``name``: ``events_s`` and what it measured about them, as
    ``(seconds since the run's first step, label, color)``."""
    c, run = res["config"], res["scenarios"][name]
    v, f = c["kill_rank"], c["flap_rank"]
    names = {"kill": (f"rank {v} killed", "red"), "restart": (f"rank {v} restarted", "darkorange"),
             "in_sync": (f"rank {v}'s first step with neighbors", "green"),
             "in_range": (f"rank {v}'s distance within the survivors'", "darkgreen"),
             "flap_down": (f"rank {f}'s link down", "purple"),
             "flap_up": (f"rank {f}'s link up", "mediumorchid"),
             "averaged_again": (f"averaged with rank {f} again", "green")}
    out = [(t, *names.get(k, (k.replace("_", " "), "black")))
           for k, t in run["events_s"].items() if k != "spawn" and t is not None]
    if run["events_s"].get("spawn") is not None:
        out.append((run["events_s"]["spawn"], f"spawned {-run['events_s']['spawn']:.1f} s "
                    "before t = 0", "0.3"))
    det = run.get("detection") or {}
    start = run["events_s"].get("kill", run["events_s"].get("flap_down"))
    if det.get("detect_s") is not None and start is not None:
        who = v if name == "kill" else f
        out.append((start + det["detect_s"], f"rank {who} declared down (+{det['detect_s']:.2f} s"
                    f", {det['detect_heartbeats']:.1f} heartbeats)", "firebrick"))
    kill = run["events_s"].get("kill")
    for key, what in (("first_error_s", "first survivor error"),
                      ("last_exit_s", "last survivor exited")):
        if run.get(key) is not None and kill is not None:
            out.append((kill + run[key], f"{what} (+{run[key]:.2f} s)", "saddlebrown"))
    return out


# ------------------------------------------------------------------------------ chaos figure

#: the runs, top to bottom, and the color of each one's lines
RUNS = {"baseline": "0.35", "kill": "tab:blue", "flap": "tab:purple", "gloo": "tab:brown"}
TITLES = {"baseline": "baseline: no fault", "kill": "kill: rank {v} killed, then restarted",
          "flap": "flap: rank {f}'s link down for {flap_s:g} s",
          "gloo": "gloo (data-parallel SGD over all_reduce): rank {v} killed"}


def _survivors(res: dict[str, Any], name: str) -> str:
    c = res["config"]
    if name in ("kill", "gloo"):
        return f"median over the {c['nodes'] - 1} survivors"
    return f"median over all {c['nodes']} ranks"


def early_end(res: dict[str, Any], name: str) -> str | None:
    """Why the run's step-time line stops before its last step, from the JSON; None when it
    does not."""
    c, run = res["config"], res["scenarios"][name]
    series = run["series"]["step_ms"]
    last = series[-1]["k"] if series else 0
    if last >= c["steps"]:
        return None
    if name != "gloo":
        why = "; ".join(f"{w}: {_short_error(t.splitlines()[-1] if t else None)}"
                        for w, t in (run.get("failed_workers") or {}).items())
        return f"stopped at step {last} of {c['steps']}: {why or 'no reason recorded'}"
    survivors, hung = c["nodes"] - 1, run.get("survivors_hung") or []
    within = "" if run.get("last_error_s") is None else f" within {run['last_error_s']:.1f} s"
    cost = run.get("restart_cost") or {}
    return "\n".join([
        f"gloo stopped at step {last} of {c['steps']}: the job failed when rank "
        f"{c['kill_rank']} was killed;",
        f"{run['survivors_failed']} of {survivors} survivors raised{within}, {len(hung)} hung:",
        textwrap.shorten(_short_error(run.get("error_sample")), 90),
        *([f"a restart would cost {cost['total_s']:.0f} s (declared dead + cold start + redo "
           "half a checkpoint interval)"] if cost.get("total_s") is not None else [])])


def _consensus_panel(ax: Axes, res: dict[str, Any], name: str) -> list[float]:
    """The run's mean consensus distance over time and its faulty rank's own; the values."""
    c, run = res["config"], res["scenarios"][name]
    cons = run["series"]["consensus"]
    ax.plot([p["t"] for p in cons], [p["mean"] for p in cons], color=RUNS[name], lw=1.6)
    values = [p["mean"] for p in cons]
    who = {"kill": c["kill_rank"], "flap": c["flap_rank"]}.get(name)
    if who is not None:
        mine = [p for p in cons if str(who) in p["dist"]]
        ax.plot([p["t"] for p in mine], [p["dist"][str(who)] for p in mine], "x",
                color="black", ms=5)
        values += [p["dist"][str(who)] for p in mine]
        if mine and mine[-1] is not cons[-1]:  # its markers end before the run does
            ax.annotate(f"rank {who}: no snapshot within half a step of rank 0's\nfrom here on "
                        f"(it saves one every {c['snapshot_every']} of its own steps)",
                        (mine[-1]["t"], mine[-1]["dist"][str(who)]), xytext=(-8, -22),
                        textcoords="offset points", ha="right", va="top", fontsize=7.5,
                        arrowprops={"arrowstyle": "->", "color": "0.3"},
                        bbox={"fc": "white", "ec": "0.6", "pad": 2})
    ax.set_title(f"{TITLES[name].format(v=c['kill_rank'], f=c['flap_rank'], **c)}: consensus "
                 "distance", fontsize=10, loc="left")
    ax.set_yscale("log")
    ax.set_ylabel("||x_i - mean||²", fontsize=8.5)
    return values


def _gloo_text(ax: Axes, res: dict[str, Any]) -> None:
    """The gloo run's left cell: what happened to it, in words, from the JSON."""
    c, g = res["config"], res["scenarios"]["gloo"]
    ax.set_axis_off()
    ax.set_title(f"{TITLES['gloo'].format(v=c['kill_rank'])}: what happened", fontsize=10,
                 loc="left")
    lines = ["no consensus distance: every rank applies the same all_reduced gradient",
             f"rank {c['kill_rank']} killed {g['events_s']['kill']:.1f} s after the first step",
             early_end(res, "gloo") or "it did not stop early"]
    ax.text(0.0, 0.95, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=9.5,
            linespacing=1.6, bbox={"fc": "#fbf3ee", "ec": RUNS["gloo"], "pad": 8})


def _step_panel(ax: Axes, res: dict[str, Any], name: str) -> list[float]:
    """The run's step time over time; a note where its line stops early. The values."""
    c, series = res["config"], res["scenarios"][name]["series"]["step_ms"]
    ts, ms = [p["t"] for p in series], [p["ms"] for p in series]
    ax.plot(ts, ms, color=RUNS[name], lw=0.9, drawstyle="steps-pre")
    note = early_end(res, name)
    if note and ts:
        ax.plot(ts[-1], ms[-1], "o", color=RUNS[name], ms=6)
        ax.annotate(note.split(";")[0] + ":\nsee the left panel" if name == "gloo" else note,
                    (ts[-1], ms[-1]), xytext=(12, 14), textcoords="offset points", fontsize=8,
                    color=RUNS[name], arrowprops={"arrowstyle": "->", "color": RUNS[name]},
                    bbox={"fc": "white", "ec": RUNS[name], "pad": 2})
    ax.set_title(f"{TITLES[name].format(v=c['kill_rank'], f=c['flap_rank'], **c)}: step time, "
                 f"{_survivors(res, name)}", fontsize=10, loc="left")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set_ylabel("ms per step (waits included)", fontsize=8.5)
    return ms


def _spans(ax: Axes, res: dict[str, Any], name: str) -> None:
    """Shade the outages: the killed rank dead, then restarting; the link down."""
    ev = res["scenarios"][name]["events_s"]
    for a, b, color in (("kill", "restart", "red"), ("restart", "in_sync", "orange"),
                        ("flap_down", "flap_up", "purple")):
        if ev.get(a) is not None and ev.get(b) is not None:
            ax.axvspan(ev[a], ev[b], color=color, alpha=0.07, lw=0)
    if name == "gloo" and ev.get("kill") is not None:
        ax.axvspan(ev["kill"], ax.get_xlim()[1], color="red", alpha=0.07, lw=0)


def _time_range(res: dict[str, Any]) -> float:
    """The latest moment any run's line or event reaches, for one x range across the rows."""
    ends = [p["t"] for run in res["scenarios"].values() for s in run["series"].values()
            for p in s[-1:]]
    ends += [t for name in res["scenarios"] for t, _, _ in run_events(res, name)]
    return max(ends, default=1.0) * 1.1  # room for the labels of the last events


def chaos_figure(res: dict[str, Any]) -> Figure:
    """One row per run, on its own clock: consensus distance left, step time right; every
    event a labelled line on both; one y range per column, one x range for all."""
    names = [n for n in RUNS if n in res["scenarios"]]
    fig, axes = plt.subplots(len(names), 2, figsize=(17, 3.3 * len(names) + 1.3), squeeze=False)
    fig.subplots_adjust(left=0.055, right=0.985, top=1 - 0.95 / fig.get_figheight(),
                        bottom=0.95 / fig.get_figheight(), hspace=0.42, wspace=0.13)
    xmax = _time_range(res)
    column: dict[int, list[float]] = {0: [], 1: []}
    levels = {0: 1, 1: 1}
    for row, name in zip(axes, names, strict=True):
        for j, ax in enumerate(row):
            ax.set_xlim(0, xmax)
            if j == 0 and "consensus" not in res["scenarios"][name]["series"]:
                _gloo_text(ax, res)
                continue
            column[j] += (_consensus_panel if j == 0 else _step_panel)(ax, res, name)
            _spans(ax, res, name)
            levels[j] = max(levels[j], label_events(ax, run_events(res, name)))
            ax.grid(alpha=0.3)
    for j in (0, 1):
        for ax in axes[:, j]:
            if ax.axison and column[j]:
                headroom(ax, min(column[j]), max(column[j]), levels[j])
    for ax in axes[-1]:
        ax.set_xlabel("seconds since this run's first step (each run on its own clock)")
    _chaos_legend(fig, res)
    return fig


def _chaos_legend(fig: Figure, res: dict[str, Any]) -> None:
    """The title, and one legend for the whole figure, outside the panels."""
    c = res["config"]
    fig.suptitle(f"Chaos, {c['nodes']} nodes, D-SGD on the exponential graph ({c['steps']} "
                 f"steps, heartbeat {c['heartbeat']:g} s, peer dead after {c['dead_after']:g} "
                 "s): one run per row", fontsize=12)
    fig.legend(handles=[
        Line2D([], [], color="0.2", lw=1.6, label="mean over the ranks with a snapshot"),
        Line2D([], [], color="black", marker="x", ls="none",
               label="the faulty rank's own distance"),
        Line2D([], [], color="0.2", lw=1.1, ls="--", label="an event (labelled)"),
        Patch(color="red", alpha=0.15, label="rank dead (gloo: the job)"),
        Patch(color="orange", alpha=0.2, label="restarting"),
        Patch(color="purple", alpha=0.15, label="link down")],
        loc="upper center", bbox_to_anchor=(0.5, 1 - 0.4 / fig.get_figheight()), ncol=6,
        fontsize=8.5, frameon=False)


def write_chaos(res: dict[str, Any], path: Path) -> None:
    """``chaos.png`` from ``chaos.json``'s contents."""
    fig = chaos_figure(res)
    fig.savefig(path, dpi=100)
    plt.close(fig)
