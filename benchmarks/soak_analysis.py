"""The figures of ``make soak``'s churn run (``benchmarks/soak.py``), from its records alone:
steps per second against the run without faults, each restart's time until it is back in
every neighbour's averages, the survivors' failed steps, accuracy, the daemons' RSS and
descriptors after the first minute, whether the views agree at the end, and the series the
plot draws."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

FAULTS = ("kill_daemon", "kill_worker", "stop", "link", "outsider")


def completed(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rank's completed steps (any incarnation)."""
    return [r for r in recs if "k" in r and "error" not in r]


def victims_at(events: list[dict[str, Any]], t: float, window: float) -> set[int]:
    """Nodes that a fault struck within ``window`` s before ``t``."""
    return {e["node"] for e in events if e["kind"] in FAULTS and t - window <= e["t"] <= t}


def warm(run: dict[str, Any]) -> float:
    """When a run's throughput is measured from: after its first minute (a third of a short
    run)."""
    return run["start"] + min(60.0, (run["until"] - run["start"]) / 3)


def steps_per_second(run: dict[str, Any], lo: float, hi: float) -> float:
    """All ranks' completed steps per second between ``lo`` and ``hi`` (wall clock)."""
    n = sum(lo <= r["t"] < hi for recs in run["records"] for r in completed(recs))
    return n / max(hi - lo, 1e-9)


def back_in_neighbors(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per restart or resume: seconds until every rank that averaged with the node before
    has averaged with it again (None: one never did)."""
    recs = run["records"]
    listeners = {v: {u for u, rr in enumerate(recs) for r in completed(rr) if v in r["src"]}
                 for v in range(len(recs))}
    out = []
    for e in run["events"]:
        if e["kind"] not in ("restart_daemon", "restart_worker", "cont", "link_up",
                             "outsider_end"):
            continue
        if e["kind"] == "restart_worker" and any(
                x["kind"] == "restart_daemon" and x["node"] == e["node"]
                and 0 <= e["t"] - x["t"] < 30 for x in run["events"]):
            continue  # the worker of a restarted daemon: counted from the daemon's restart
        firsts = [next((r["t"] for r in completed(recs[u]) if r["t"] > e["t"]
                        and e["node"] in r["src"]), None) for u in listeners[e["node"]]]
        back = None if None in firsts or not firsts else max(firsts) - e["t"]  # type: ignore
        out.append({"kind": e["kind"], "node": e["node"], "t": e["t"] - run["start"],
                    "back_s": back})
    return out


def lost_steps(run: dict[str, Any]) -> dict[str, int]:
    """Failed steps of ranks no fault struck in the minute before, per rank."""
    return {str(r): sum(1 for x in recs if "error" in x
                        and r not in victims_at(run["events"], x["t"], 60))
            for r, recs in enumerate(run["records"])}


def flatness(run: dict[str, Any], after: float) -> dict[str, Any]:
    """Per daemon that kept one process from ``after`` s on: RSS and descriptors then and at
    the end."""
    out = {}
    for d in range(len(run["records"])):
        rows = [s["daemons"][str(d)] for s in run["samples"]
                if str(d) in s["daemons"] and s["t"] - run["start"] >= after]
        if len(rows) >= 2 and rows[0]["pid"] == rows[-1]["pid"] and \
                len({r["pid"] for r in rows}) == 1:
            out[str(d)] = {"rss_mb": [round(rows[0]["rss_mb"], 1), round(rows[-1]["rss_mb"], 1)],
                           "fds": [rows[0]["fds"], rows[-1]["fds"]]}
    return out


def accuracy(run: dict[str, Any]) -> dict[str, Any]:
    """The last incarnation's test accuracy per rank, and the mean."""
    last: dict[int, tuple[int, float]] = {}
    for res in run["results"]:
        if res["rank"] not in last or res["inc"] >= last[res["rank"]][0]:
            last[res["rank"]] = (res["inc"], res["accuracy"])
    per = [last[r][1] for r in sorted(last)]
    return {"mean": statistics.mean(per) if per else None, "per_rank": per}


def views_agree(final: dict[str, Any]) -> bool:
    """Whether every daemon that answered at the end has the same epoch and live set."""
    views = {(d["epoch"], tuple(d["live"])) for d in final.values()}
    return len(views) == 1 and len(final) > 0


def analyze(soak: dict[str, Any], base: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The figures and their verdicts."""
    rate = {k: steps_per_second(r, warm(r), r["until"] - 5)
            for k, r in (("soak", soak), ("baseline", base))}
    kept = rate["soak"] / max(rate["baseline"], 1e-9)
    back = back_in_neighbors(soak)
    worst = max((b["back_s"] for b in back if b["back_s"] is not None), default=None)
    never = [b for b in back if b["back_s"] is None]
    flat = flatness(soak, 60)
    rss_ratio = max((v["rss_mb"][1] / v["rss_mb"][0] for v in flat.values()), default=None)
    fds_more = max((v["fds"][1] - v["fds"][0] for v in flat.values()), default=None)
    acc, acc_base = accuracy(soak), accuracy(base)
    lost = lost_steps(soak)
    faults = [e for e in soak["events"] if e["kind"] in FAULTS]
    agree = views_agree(soak["final"])
    verdicts = {
        "survivors_steps_lost": (sum(lost.values()), sum(lost.values()) == 0),
        "throughput_kept": (round(kept, 3), kept >= 0.9),
        "worst_back_in_neighbors_s": (worst and round(worst, 1),
                                      worst is not None and worst <= 10 and not never),
        "views_agree_at_end": (agree, agree),
        "accuracy_points_below_baseline": (
            None if acc["mean"] is None or acc_base["mean"] is None
            else round(acc_base["mean"] - acc["mean"], 2),
            acc["mean"] is not None and acc_base["mean"] is not None
            and acc["mean"] >= acc_base["mean"] - 1),
        "rss_end_over_minute_one": (rss_ratio and round(rss_ratio, 3),
                                    rss_ratio is not None and rss_ratio <= 1.10),
        "fds_end_minus_minute_one": (fds_more, fds_more is not None and fds_more <= 4)}
    return {"faults": [{"kind": e["kind"], "node": e["node"], "t": round(e["t"] - soak["start"],
                                                                          1)} for e in faults],
            "fault_counts": {k: sum(e["kind"] == k for e in faults) for k in FAULTS},
            "back_in_neighbors": back, "lost_steps": lost, "flat": flat,
            "accuracy": {"soak": acc, "baseline": acc_base},
            "steps_per_s": rate,
            "restarts": soak["starts"], "final_views": soak["final"],
            "verdicts": {k: {"value": v, "met": bool(m)} for k, (v, m) in verdicts.items()}}


def series(run: dict[str, Any], bin_s: float = 10.0) -> dict[str, Any]:
    """Over time (s from the start): steps per second (all ranks, per ``bin_s``), each daemon's
    RSS and descriptors and the live set per sample, the faults and restarts."""
    t0 = run["start"]
    ends = [r["t"] - t0 for recs in run["records"] for r in completed(recs)]
    bins = int((run["until"] - t0) // bin_s) + 1
    counts = [0] * bins
    for t in ends:
        if 0 <= t < bins * bin_s:
            counts[int(t // bin_s)] += 1
    return {"steps_per_s": [[(b + 0.5) * bin_s, c / bin_s] for b, c in enumerate(counts)],
            "samples": [{"t": s["t"] - t0, **{d: {k: v[k] for k in ("rss_mb", "fds", "live")}
                                              for d, v in s["daemons"].items()}}
                        for s in run["samples"]],
            "events": [{"t": e["t"] - t0, "kind": e["kind"], "node": e["node"]}
                       for e in run["events"]]}
