"""The soak's report (:mod:`benchmarks.soak` and :mod:`benchmarks.soak_load`): a markdown table
of the figures against their targets, and a plot over time with the faults marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: each verdict's line: what, target
TARGETS = {
    "survivors_steps_lost": ("survivors' failed steps", "0"),
    "throughput_kept": ("steps per second kept against the run without faults", ">= 0.9"),
    "worst_back_in_neighbors_s": ("restart/resume -> back in every out-neighbor's averages, "
                                  "worst (s)", "<= 10"),
    "views_agree_at_end": ("the daemons' views agree at the end", "yes"),
    "accuracy_points_below_baseline": ("final accuracy, points below the run without faults",
                                       "<= 1"),
    "rss_end_over_minute_one": ("daemon RSS at the end / after the first minute, worst",
                                "<= 1.10"),
    "fds_end_minus_minute_one": ("daemon descriptors at the end - after the first minute, "
                                 "worst", "<= 4"),
}
COLORS = {"kill_daemon": "tab:red", "kill_worker": "tab:orange", "stop": "tab:purple",
          "link": "tab:blue", "outsider": "tab:gray"}


def markdown(res: dict[str, Any]) -> str:
    """The churn run's figures (and the load run's, when ``res`` has them)."""
    v = res["verdicts"]
    lines = [f"# Soak ({res['date']}, {res['cpus']} CPUs, {res['config']['nodes']} nodes, "
             f"{res['config']['duration']:.0f} s of churn, seed {res['config']['seed']})", "",
             "| figure | value | target | |", "|---|---|---|---|"]
    for key, (what, target) in TARGETS.items():
        lines.append(f"| {what} | {v[key]['value']} | {target} | "
                     f"{'met' if v[key]['met'] else 'MISSED'} |")
    sps = res["steps_per_s"]
    acc = res["accuracy"]
    back = [b["back_s"] for b in res["back_in_neighbors"] if b["back_s"] is not None]
    lines += [
        "", f"Faults: {res['fault_counts']} ({len(res['faults'])} in all); restarts "
        f"{ {k: n for k, n in res['restarts'].items() if n} }.",
        f"Steps per second (all ranks, after the first minute): soak {sps['soak']:.2f}, "
        f"without faults {sps['baseline']:.2f}.",
        f"Mean test accuracy: soak {acc['soak']['mean']:.2f}%, without faults "
        f"{acc['baseline']['mean']:.2f}%.",
        f"Back in every out-neighbor's averages: {len(back)} of "
        f"{len(res['back_in_neighbors'])} restarts/resumes, median "
        f"{sorted(back)[len(back) // 2] if back else float('nan'):.1f} s.",
        f"Daemons through the whole run (RSS MB, descriptors: after minute one -> end): "
        f"{res['flat']}.", ""]
    if "load" in res:
        lines += load_markdown(res["load"])
    return "\n".join(lines) + "\n"


def load_markdown(load: dict[str, Any]) -> list[str]:
    """The load run's table."""
    lines = ["## Load held", "", "| phase | ops/s (all workers) | p50 ms | p99 ms | daemon RSS MB "
             "start, middle, end | descriptors | CPU s per s | flat (middle to end) |",
             "|---|---|---|---|---|---|---|---|"]
    for phase in load["phases"]:
        d = phase["daemons"]
        lines.append(f"| {phase['name']} | {phase['ops_per_s']:.0f} | {phase['p50_ms']:.3f} | "
                     f"{phase['p99_ms']:.3f} | "
                     + "; ".join(", ".join(f"{v:.0f}" for v in x["rss_mb"]) for x in d)
                     + " | " + "; ".join(", ".join(map(str, x["fds"])) for x in d)
                     + " | " + ", ".join(f"{x['cpu_per_s']:.2f}" for x in d) + " | "
                     + ("yes" if all(x["flat"] for x in d) else "NO") + " |")
    return [*lines, ""]


def write_png(res: dict[str, Any], path: Path) -> None:
    """Steps per second, live set, RSS and descriptors over the soak, faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, base = res["series"]["soak"], res["series"]["baseline"]
    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    axes[0].plot(*zip(*s["steps_per_s"], strict=True), label="soak")
    axes[0].plot(*zip(*base["steps_per_s"], strict=True), label="without faults", alpha=0.6)
    axes[0].set_ylabel("steps/s (all ranks)")
    axes[0].legend(loc="lower left")
    daemons = sorted({d for row in s["samples"] for d in row if d != "t"}, key=int)
    for d in daemons:
        rows = [(row["t"], row[d]) for row in s["samples"] if d in row]
        t = [r[0] for r in rows]
        axes[2].plot(t, [r[1]["rss_mb"] for r in rows], lw=0.8, label=f"daemon {d}")
        axes[3].plot(t, [r[1]["fds"] for r in rows], lw=0.8)
    live = [(row["t"], min(len(v["live"]) for k, v in row.items() if k != "t"))
            for row in s["samples"] if len(row) > 1]
    if live:
        axes[1].step(*zip(*live, strict=True), where="post")
    axes[1].set_ylabel("live daemons (fewest seen)")
    axes[2].set_ylabel("RSS (MB)")
    axes[2].legend(ncol=4, fontsize=7, loc="upper left")
    axes[3].set_ylabel("descriptors")
    axes[3].set_xlabel("seconds")
    for e in s["events"]:
        if e["kind"] in COLORS:
            for ax in axes:
                ax.axvline(e["t"], color=COLORS[e["kind"]], lw=0.6, alpha=0.6)
            axes[0].text(e["t"], 0, f"{e['kind']} {e['node']}", rotation=90, fontsize=6,
                         va="bottom", color=COLORS[e["kind"]])
    fig.suptitle("soak: D-SGD on 8 namespaces under churn (lines: faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
