"""Chaos: D-SGD on 8 network namespaces while a node dies and comes back, and a link flaps.

    .venv/bin/python benchmarks/chaos.py [--nodes 8] [--steps 300] [--out benchmarks/results]
    .venv/bin/python benchmarks/chaos.py --cleanup     # leftovers of a killed run (as root)
    .venv/bin/python benchmarks/chaos.py --replot      # chaos.png again, from chaos.json

In :class:`benchmarks.netns_dsgd.Network`'s namespaces (links at ``--rate`` both ways, ``tc
tbf``), one ``decentd`` each (topology ``exponential``, ``on_peer_loss: reweight``, heartbeat
``--heartbeat``, ``peer_dead_after`` ``--dead-after``) and one worker (:mod:`benchmarks.chaos_run`)
training ``examples/train_digits.py``'s CNN on its shard with ``DecentralizedOptimizer(SGD(lr,
momentum 0.9), model, algorithm="dsgd")``, ``--steps`` steps, compute padded to ``--pad-ms`` (a
restart takes seconds; 16 processes share 2 cores). Four runs from cold starts: ``baseline``;
``kill`` (node ``--kill-rank``'s daemon and worker SIGKILLed at its step ``--kill-at``, restarted
with the same config at rank 0's step ``--restart-at``: its optimizer takes a donor's state);
``flap`` (node ``--flap-rank``'s veth down ``--flap-s`` s at its step ``--flap-at``); ``gloo``
(data-parallel SGD over gloo ``all_reduce``, the same kill). Measured: time to detect the death
(daemons' "rank N is down"; the first step averaged without it, from ``src_ranks``) in seconds
and heartbeats (target <= 2); steps the survivors lost (target 0); their step time before, during
and after the outage; the rejoined node's time to be in sync (first step with neighbors; distance
to the mean within the others'); mean test accuracy against the baseline (target: within 0.5
points); when gloo's job is dead and what its restart costs (this run's cold start plus half of
``--checkpoint-every`` steps). Writes ``chaos.json``, ``.md`` and ``.png`` (consensus distance
and step time over time, one run per row, events labelled; ``--replot`` redraws it from the
JSON alone) into ``--out``. Exit 0 when the run completes (a missed target says MISSED), 1 when
it crashes; without root it says why and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/chaos.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.markdown import Markdown  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn  # noqa: E402

import benchmarks.chaos_run as cr  # noqa: E402
import benchmarks.netns_dsgd as nd  # noqa: E402
from benchmarks import cli  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SCENARIOS = ("baseline", "kill", "flap", "gloo")
console = Console(stderr=True)


def step_series(recs: list[list[dict[str, Any]]], ranks: list[int],
                t0: float) -> list[dict[str, float]]:
    """Per step: the median over ``ranks`` of its end (s after ``t0``) and duration (ms)."""
    by_k: dict[int, list[tuple[float, float]]] = {}
    for r in ranks:
        for s in cr.steps_of(recs[r]):
            by_k.setdefault(s["k"], []).append((s["t"], s["wall"]))
    return [{"k": k, "t": statistics.median(t for t, _ in v) - t0,
             "ms": 1e3 * statistics.median(d for _, d in v)} for k, v in sorted(by_k.items())]


def consensus_series(run: dict[str, Any], every: int, t0: float) -> list[dict[str, Any]]:
    """At rank 0's every ``every``-th step: each rank's squared distance to the mean of the
    ranks' parameters then, their mean, and when (s after ``t0``). A rank's snapshot is its one
    nearest in time, within half a step (a rejoined rank snapshots every step: its step
    counter is not the others')."""
    import numpy as np

    recs = run["records"]
    snaps = [[(s["t"], s["k"]) for s in cr.steps_of(rr)
              if (run["out"] / f"x-{r}-{s['k']}.npy").exists()] for r, rr in enumerate(recs)]
    mine = cr.steps_of(recs[0], 0)
    half = 0.5 * statistics.median(s["dur"] for s in mine)
    out = []
    for tk, k in ((s["t"], s["k"]) for s in mine if s["k"] % every == 0):
        xs = {}
        for r, avail in enumerate(snaps):
            t, kr = min(avail, key=lambda x: abs(x[0] - tk), default=(float("inf"), 0))
            if abs(t - tk) <= half:
                xs[r] = np.load(run["out"] / f"x-{r}-{kr}.npy").astype(np.float64)
        if len(xs) < 2:
            continue
        mean = np.mean(list(xs.values()), axis=0)
        dist = {str(r): float(((x - mean) ** 2).sum()) for r, x in xs.items()}
        out.append({"k": k, "t": tk - t0, "dist": dist, "mean": statistics.mean(dist.values())})
    return out


def window(recs: list[list[dict[str, Any]]], ranks: list[int], lo: float, hi: float,
           skip: int = 5) -> dict[str, Any]:
    """Step time of ``ranks`` over the steps that ended in ``[lo, hi)`` (after step ``skip``)."""
    durs = [1e3 * s["wall"] for r in ranks for s in cr.steps_of(recs[r])
            if lo <= s["t"] < hi and s["k"] > skip]
    return {"median_ms": statistics.median(durs) if durs else None,
            "max_ms": max(durs, default=None), "steps": len(durs)}


def lost_steps(recs: list[list[dict[str, Any]]], ranks: list[int], steps: int) -> dict[str, int]:
    """Per rank: failed steps plus steps 1..``steps`` it never completed."""
    return {str(r): sum("error" in x for x in recs[r]) + len(
        set(range(1, steps + 1)) - {s["k"] for s in cr.steps_of(recs[r])}) for r in ranks}


def final_accuracy(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rank's final test accuracy (its last incarnation's) and their mean."""
    last = {x["rank"]: x for x in sorted(results, key=lambda x: x["inc"])}
    accs = [x["accuracy"] for _, x in sorted(last.items()) if x["accuracy"] is not None]
    return {"per_rank": accs, "mean": statistics.mean(accs) if accs else None}


def common(run: dict[str, Any], a: argparse.Namespace, ranks: list[int]) -> dict[str, Any]:
    """What every D-SGD scenario reports: start-up, series, lost steps, finish, accuracy."""
    recs, ev = run["records"], run["events"]
    starts = [e["t"] for r in recs if (e := cr.event_of(r, "start"))]
    t0 = min(starts)
    finished = {str(r): max((s["k"] for s in cr.steps_of(recs[r])), default=0) == a.steps
                for r in range(len(recs))}
    return {"t0": t0, "cold_start_s": max(starts) - ev["spawn"],
            "events_s": {k: v - t0 for k, v in ev.items()},
            "series": {"step_ms": step_series(recs, ranks, t0),
                       "consensus": consensus_series(run, a.snapshot_every, t0)},
            "lost_steps": lost_steps(recs, ranks, a.steps), "finished": finished,
            "daemon_log": {k: sum(e["event"] == k for e in run["daemon"])
                           for k in ("stall", "timeout", "rejoin_op")},
            "first_timeout": next((e["message"] for e in run["daemon"]
                                   if e["event"] == "timeout"), None),
            "accuracy": final_accuracy(run["results"]), "failed_workers": run["failed_workers"]}


def listeners(recs: list[list[dict[str, Any]]], rank: int) -> list[int]:
    """The ranks whose first step averaged with ``rank`` (its out-neighbors)."""
    return [r for r, rr in enumerate(recs) if r != rank and cr.steps_of(rr)
            and rank in cr.steps_of(rr)[0]["src"]]


def detection(run: dict[str, Any], victim: int, t: float, until: float,
              hb: float) -> dict[str, Any]:
    """How long after ``t`` (and before ``until``) the others noticed ``victim`` gone: their
    daemons' first "is down" and "link dropped" lines, the first step that left it out."""
    devs = [e for e in run["daemon"] if e["n"] == victim and e["daemon"] != victim
            and e["event"] in ("down", "dropped") and t - 0.002 <= e["t"] < until]
    recs = run["records"]
    left_out = [s for r in listeners(recs, victim) for s in cr.steps_of(recs[r], 0)
                if t <= s["t"] < until and victim not in s["src"]]
    down = cr.since(cr.first_t([e for e in devs if e["event"] == "down"]), t)
    op = cr.since(cr.first_t(left_out), t)
    first = min((v for v in (down, op) if v is not None), default=None)
    return {"daemon_down_s": down, "link_dropped_s": cr.since(cr.first_t(
        [e for e in devs if e["event"] == "dropped"]), t), "first_op_without_s": op,
        "detect_s": first, "detect_heartbeats": None if first is None else first / hb,
        "down_lines": [e["message"] for e in devs if e["event"] == "down"][:3]}


def analyze_kill(run: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The kill + restart scenario's numbers."""
    v, recs, ev = a.kill_rank, run["records"], run["events"]
    survivors = [r for r in range(len(recs)) if r != v]
    out = common(run, a, survivors)
    out["detection"] = detection(run, v, ev["kill"], ev["restart"], a.heartbeat)
    ready = cr.event_of(recs[v], "ready", inc=1) or {}
    mine = cr.steps_of(recs[v], 1)
    with_peers = next((s for s in mine if s["src"]), None)
    c = ready.get("iteration")
    donor = next((r for r in survivors for s in recs[r]  # a failed step's state counts too
                  if s.get("k") == (c or 0) + 1 and s.get("d") == ready.get("d")), None)
    t_sync = with_peers["t"] if with_peers else float("inf")
    dist_ok = next((p for p in out["series"]["consensus"] if str(v) in p["dist"]
                    and p["t"] + out["t0"] >= t_sync and p["dist"][str(v)] <= max(
                        d for r, d in p["dist"].items() if r != str(v))), None)
    t_dist = dist_ok["t"] + out["t0"] if dist_ok else None
    lag = max((s["k"] for s in cr.steps_of(recs[0]) if s["t"] <= t_sync), default=0) - (c or 0) \
        if with_peers else None
    out["rejoin"] = {
        "restart_to_state_s": cr.since(ready.get("t"), ev["restart"]),
        "state_transfer_s": ready.get("state_s"), "iteration": c,
        "state_taken": ready.get("taken"),
        "donor": donor, "state_equals_donor": donor is not None,
        "restart_to_first_step_s": cr.since(mine[0]["t"] if mine else None, ev["restart"]),
        "restart_to_step_with_neighbors_s": cr.since(t_sync if with_peers else None,
                                                  ev["restart"]),
        "restart_to_distance_in_range_s": cr.since(t_dist, ev["restart"]),
        "distance_in_range_at_step": dist_ok and dist_ok["k"],
        "survivor_steps_during_restart": sum(ev["restart"] <= s["t"] < t_sync for s in
                                             cr.steps_of(recs[0])) if with_peers else None,
        "counter_behind_survivors_steps": lag,
        "steps_alone": sum(not s["src"] for s in mine)}
    out["events_s"]["in_sync"] = cr.since(t_sync if with_peers else None, out["t0"])
    out["events_s"]["in_range"] = cr.since(t_dist, out["t0"])
    out["step_time"] = {"before": window(recs, survivors, 0, ev["kill"]),
                        "outage": window(recs, survivors, ev["kill"], t_sync),
                        "after_rejoin": window(recs, survivors, t_sync, float("inf"))}
    return out


def analyze_flap(run: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The link flap scenario's numbers."""
    f, recs, ev = a.flap_rank, run["records"], run["events"]
    out = common(run, a, list(range(len(recs))))
    out["detection"] = detection(run, f, ev["flap_down"], ev["flap_up"], a.heartbeat)
    back = [e for e in run["daemon"] if e["n"] == f and e["daemon"] != f
            and e["event"] == "up" and e["t"] >= ev["flap_up"]]
    with_f = [s for r in listeners(recs, f) for s in cr.steps_of(recs[r])
              if s["t"] >= ev["flap_up"] and f in s["src"]]
    alone = [s for s in cr.steps_of(recs[f]) if not s["src"]]
    t_back = cr.first_t(with_f)
    out["recovery"] = {"up_again_after_link_up_s": cr.since(cr.first_t(back), ev["flap_up"]),
                       "averaged_again_after_link_up_s": cr.since(t_back, ev["flap_up"]),
                       "steps_flapped_rank_averaged_alone": len(alone)}
    out["events_s"]["averaged_again"] = cr.since(t_back, out["t0"])
    others = [r for r in range(len(recs)) if r != f]
    end = t_back if t_back is not None else float("inf")
    out["step_time"] = {"before": window(recs, others, 0, ev["flap_down"]),
                        "flap": window(recs, others, ev["flap_down"], end),
                        "after": window(recs, others, end, float("inf"))}
    return out


def analyze_gloo(run: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """The gloo run under the same kill: when the survivors failed, what a restart costs."""
    v, recs, ev = a.kill_rank, run["records"], run["events"]
    survivors = [r for r in range(len(recs)) if r != v]
    starts = [e["t"] for r in recs if (e := cr.event_of(r, "start"))]
    errors = [x for r in survivors for x in recs[r] if "error" in x]
    exits = [ev[f"exit-{r}"] for r in survivors if f"exit-{r}" in ev]
    hung = [r for r in survivors if f"exit-{r}" not in ev]
    step = window(recs, survivors, 0, ev["kill"])
    cold = max(starts) - ev["spawn"]
    dead = cr.since(cr.first_t(errors), ev["kill"])
    redo = a.checkpoint_every / 2 * (step["median_ms"] or 0) / 1e3
    return {"t0": min(starts), "cold_start_s": cold,
            "series": {"step_ms": step_series(recs, survivors, min(starts))},
            "events_s": {k: x - min(starts) for k, x in ev.items() if not k.startswith("exit")},
            "first_error_s": dead, "last_error_s": cr.since(max(
                (x["t"] for x in errors), default=None), ev["kill"]),
            "last_exit_s": cr.since(max(exits), ev["kill"]) if exits else None,
            "survivors_failed": sum(any("error" in x for x in recs[r]) for r in survivors),
            "survivors_hung": hung, "error_sample": errors[0]["error"] if errors else None,
            "step_time_before": step, "restart_cost": {
                "declared_dead_s": dead, "cold_start_s": cold, "redo_s": redo,
                "redo_steps": a.checkpoint_every / 2, "total_s": (dead or 0) + cold + redo}}


def verdicts(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target: what it measures, the value, the target and whether it is met."""
    sc = res["scenarios"]
    kill, base = sc["kill"], sc["baseline"]
    hb = kill["detection"]["detect_heartbeats"]
    lost, rej = sum(kill["lost_steps"].values()), kill["rejoin"]
    acc = {k: (sc[k]["accuracy"]["mean"] - base["accuracy"]["mean"]  # None: a worker failed
               if sc[k]["accuracy"]["mean"] is not None else -100.0) for k in ("kill", "flap")}
    done = all(kill["finished"].values())
    table = [
        ("detect", "survivors detect the death (heartbeats)", hb, "<= 2", (hb or 9) <= 2),
        ("lost", "steps the survivors lost", lost, "0", lost == 0),
        ("finished", "every rank finished all steps (kill)", done, "true", done),
        ("rejoin", "rejoined state == a donor's at the counter it took",
         f"rank {rej['donor']} at step {rej['iteration']}", "exact", rej["state_equals_donor"]),
        ("acc_kill", "kill+restart: mean accuracy - baseline (points)", acc["kill"], ">= -0.5",
         acc["kill"] >= -0.5),
        ("acc_flap", "flap: mean accuracy - baseline (points)", acc["flap"], ">= -0.5",
         acc["flap"] >= -0.5)]
    return {k: {"what": w, "value": v, "target": t, "met": bool(m)} for k, w, v, t, m in table}


ANALYSES = {"kill": analyze_kill, "flap": analyze_flap, "gloo": analyze_gloo}


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Build the network, run every scenario, tear everything down; the result dict.
    BenchError when a step fails (after cleaning up)."""
    started, prefix = time.perf_counter(), f"{cr.PREFIX}{os.getpid()}"
    run_dir, cleanup = nd.begin_run(prefix)
    ok, runs = False, dict[str, dict[str, Any]]()
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {k: v for k, v in vars(a).items() if k not in ("out", "cleanup")},
        "faults": {"on_peer_loss": "reweight", "peer_dead_after": a.dead_after,
                   "heartbeat": a.heartbeat, "topology": "exponential"},
        "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()),
        "decent_source": nd.decent_source(), "run_dir": str(run_dir)}
    try:
        with nd.signals_raise(), Progress(TextColumn("{task.description:>9}"), BarColumn(),
                                          MofNCompleteColumn(), TextColumn("steps of rank 0"),
                                          console=console) as progress:
            net = nd.Network(prefix, a.nodes, a.rate, cleanup)
            net.up()
            runner = nd.Runner(net, run_dir, cleanup)
            for name in SCENARIOS:
                runs[name] = cr.run_scenario(runner, a, name, progress)
        res["scenarios"] = {"baseline": common(runs["baseline"], a, list(range(a.nodes)))}
        res["scenarios"].update({k: f(runs[k], a) for k, f in ANALYSES.items()})
        res["verdicts"] = verdicts(res)
        ok = True
    finally:
        left = nd.tear_down(cleanup, run_dir, ok and not a.keep_logs)
    res["leftover_processes"] = left
    res["leftover_namespaces"] = nd.leftover_namespaces(prefix)
    res["loadavg_end"], res["total_s"] = list(os.getloadavg()), time.perf_counter() - started
    return res


def fmt(v: Any, unit: str = "", digits: int = 2) -> str:
    """A value for the tables: numbers rounded, None as a dash."""
    if v is None:
        return "-"
    return f"{v:.{digits}f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def _join(d: dict[str, Any], keys: str, unit: str = " s", digits: int = 2) -> str:
    return " / ".join(fmt(d[x], unit, digits) for x in keys.split())


def _times(st: dict[str, Any]) -> str:
    return (" / ".join(fmt(w["median_ms"], " ms", 0) for w in st.values()) + " (longest "
            + " / ".join(fmt(w["max_ms"], " ms", 0) for w in st.values()) + ")")


def _lost(x: dict[str, Any]) -> str:
    first = f"; the first: {x['first_timeout'][:200]}" if x["first_timeout"] else ""
    return (f"{sum(x['lost_steps'].values())} (op timeouts logged by daemons: "
            f"{x['daemon_log']['timeout']}{first}; state transfers: "
            f"{x['daemon_log']['rejoin_op']})")


def _detect(d: dict[str, Any]) -> str:
    return (_join(d, "daemon_down_s link_dropped_s first_op_without_s", " s", 3)
            + f"; the first: {fmt(d['detect_heartbeats'])} heartbeats")


def _taken(rj: dict[str, Any]) -> str:
    t = rj.get("state_taken")
    if not t:
        return "n/a"
    donors = ", ".join(f"rank {r}: {b}" for r, b in t["bytes_from"].items())
    return f"{donors}; {t['refetched']}; {t['seconds']:.2f} s"


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    """The measured numbers, as (what, value) rows."""
    sc = res["scenarios"]
    k, f, g, b = sc["kill"], sc["flap"], sc["gloo"], sc["baseline"]
    rj, rc = k["rejoin"], g["restart_cost"]
    return [
        ("kill: survivors' daemons say 'is down' / link dropped / first step without it",
         _detect(k["detection"])),
        ("kill: steps the survivors lost", _lost(k)),
        ("kill: survivors' step time before / outage / after the rejoin (median)",
         _times(k["step_time"])),
        ("kill: restart -> state taken / first step / first step with neighbors / distance to "
         "the mean within the survivors'", _join(rj, "restart_to_state_s restart_to_first_step_s "
                                                "restart_to_step_with_neighbors_s "
                                                "restart_to_distance_in_range_s", " s", 1)),
        ("kill: state taken (bytes per donor; chunks fetched again; transfer)", _taken(rj)),
        ("kill: rejoined with the state of", f"rank {rj['donor']} at its step {rj['iteration']} "
         f"(exact: {rj['state_equals_donor']}); survivors were "
         f"{rj['survivor_steps_during_restart']} steps past the restart, its counter "
         f"{rj['counter_behind_survivors_steps']} behind theirs; {rj['steps_alone']} of its "
         "steps averaged with nobody"),
        ("mean (lowest rank's) test accuracy: baseline / kill+restart / flap", " / ".join(
            f"{fmt(sc[x]['accuracy']['mean'], '%')} ({min(sc[x]['accuracy']['per_rank']):.2f}%)"
            for x in ("baseline", "kill", "flap"))),
        ("flap: the others' daemons say 'is down' / link dropped / first step without it",
         _detect(f["detection"])),
        ("flap: link up -> it is up again / averaged with it again; its steps alone",
         _join(f["recovery"], "up_again_after_link_up_s averaged_again_after_link_up_s")
         + f"; {f['recovery']['steps_flapped_rank_averaged_alone']}"),
        ("flap: the others' step time before / during / after (median)", _times(f["step_time"])),
        ("flap: steps lost (all ranks)", _lost(f)),
        ("workers that failed (kill, flap)", "; ".join(
            f"{w}: {t.splitlines()[-1].split('| ', 1)[-1][:160].replace('|', '/')}" for x in (k, f)
            for w, t in x["failed_workers"].items()) or "none"),
        ("gloo: first / last survivor error after the kill; survivors hung",
         _join(g, "first_error_s last_error_s") + f"; {len(g['survivors_hung'])} of "
         f"{len(b['finished']) - 1}"),
        ("gloo: restart = declared dead + cold start + redo (half a checkpoint interval)",
         _join(rc, "declared_dead_s cold_start_s redo_s", " s", 1).replace("/", "+")
         + f" = {fmt(rc['total_s'], ' s', 1)}, every rank stopped"),
        ("cold start (decent: daemons + workers) / gloo step time",
         f"{fmt(b['cold_start_s'], ' s', 1)} / "
         f"{fmt(g['step_time_before']['median_ms'], ' ms', 0)}")]


def header(res: dict[str, Any]) -> str:
    """One paragraph: the setting."""
    c = res["config"]
    return (f"{res['date']}, {c['nodes']} network namespaces at {c['rate']} (tc tbf), digits CNN, "
            f"D-SGD on the exponential graph (SGD lr {c['lr']}, momentum 0.9, batch {c['batch']})"
            f", {c['steps']} steps, each step's compute padded to {c['pad_ms']:g} ms; "
            f"timeouts.heartbeat {c['heartbeat']} s, faults.peer_dead_after {c['dead_after']} s, "
            f"on_peer_loss reweight. Kill rank {c['kill_rank']} at its step {c['kill_at']}, "
            f"restart at rank 0's step {c['restart_at']}; flap rank {c['flap_rank']} for "
            f"{c['flap_s']:g} s at its step {c['flap_at']}; timeouts.op {c['op_timeout']:g} s. "
            f"{res['cpus']} CPUs, load average {res['loadavg_start'][0]:.1f} at start and "
            f"{res['loadavg_end'][0]:.1f} at the end, {res['total_s']:.0f} s in all.")


def markdown(res: dict[str, Any]) -> str:
    """``chaos.md``: the setting, the numbers, the targets."""
    lines = ["# Chaos: D-SGD through a node kill + restart and a link flap", "",
             header(res), "", "| what | measured |", "|:---|:---|"]
    lines += [f"| {w} | {v} |" for w, v in rows(res)]
    lines += ["", "| target | measured | target | |", "|:---|:---|:---|:---|"]
    lines += [f"| {v['what']} | {fmt(v['value'])} | {v['target']} | "
              f"{'met' if v['met'] else 'MISSED'} |" for v in res["verdicts"].values()]
    return "\n".join([*lines, "", "![chaos](chaos.png)", ""])


def write_png(res: dict[str, Any], path: Path) -> None:
    """``chaos.png``: one row per run on its own clock, consensus distance and step time, every
    event labelled where it happened (see :mod:`benchmarks.plots`)."""
    from benchmarks import plots

    plots.write_chaos(res, path)


#: the command line: name, type, default, help
OPTIONS: list[cli.Option] = [
    ("nodes", int, 8, "namespaces, one daemon and worker each"), ("steps", int, 300, "steps"),
    *cli.training_options("data, model", 60.0),
    ("kill-rank", int, 3, "the node killed"), ("kill-at", int, 100, "at its step"),
    ("restart-at", int, 200, "the step of rank 0 at which it restarts"),
    ("flap-rank", int, 5, "the node whose link flaps"), ("flap-at", int, 150, "at its step"),
    ("flap-s", float, 5.0, "seconds the link stays down"),
    ("snapshot-every", int, 10, "parameters saved every this many steps"),
    ("gloo-timeout", float, 60.0, "the gloo group's timeout (s)"),
    ("checkpoint-every", int, 100, "the checkpoint interval a gloo restart is costed with"),
    ("out", Path, RESULTS, "where chaos.json, .md and .png go")]


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = cli.parser_of(__doc__, OPTIONS)
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory")
    p.add_argument("--cleanup", action="store_true",
                   help=f"delete leftovers ({cr.PREFIX}*) of dead runs and exit")
    p.add_argument("--replot", action="store_true",
                   help="redraw --out/chaos.png from --out/chaos.json and exit (no root needed)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (exit 0 when it completes, 1 when it crashes), or the cleanup."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.replot:
        write_png(json.loads((a.out / "chaos.json").read_text()), a.out / "chaos.png")
        print(f"wrote {a.out / 'chaos.png'}")
        return 0
    if not (0 < a.kill_rank < a.nodes and 0 <= a.flap_rank < a.nodes
            and 0 < a.kill_at < a.restart_at < a.steps and 0 < a.flap_at < a.steps):
        p.error("need 0 < --kill-rank < --nodes (rank 0 is the donor and gloo's store), "
                "0 <= --flap-rank < --nodes, 0 < --kill-at < --restart-at < --steps, "
                "0 < --flap-at < --steps")
    reason = nd.skip_reason()
    if reason or a.cleanup:
        print(reason or f"removed: {' '.join(cr.cleanup_leftovers()) or '-'}")
        return 0
    try:
        res = run(a)
    except nd.Skip as exc:
        print(exc)
        return 0
    except nd.BenchError as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "chaos.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    text = markdown(res)
    Console(width=None if sys.stdout.isatty() else 140).print(Markdown(text))
    (a.out / "chaos.md").write_text(text)
    write_png(res, a.out / "chaos.png")
    console.print(f"wrote {a.out}/chaos.json, chaos.md and chaos.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
