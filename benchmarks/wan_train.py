"""Time to a target loss across a WAN: gradient allreduce over gloo against decent's
decentralized methods, 8 nodes whose every link is emulated (``benchmarks/wan``: a true RTT in
user space, ``tc tbf`` for the rate). Needs root::

    sudo .venv/bin/python benchmarks/wan_train.py                 # make wan: both settings
    sudo .venv/bin/python benchmarks/wan_train.py --settings b --steps 100   # a quicker look

Settings: (a) 1 Gbit/s with 50 ms RTT, (b) 100 Mbit/s with 100 ms RTT. In each, one daemon and
one rank per namespace; every rank runs every method of :data:`benchmarks.wan.training.METHODS`
in turn (same model, data, seed and inner optimizer, AdamW; see that module) on one workload
(``--workload``, :mod:`benchmarks.wan.workloads`: the character-level transformer LM of
``examples/train_charlm.py`` by default, or the digits MLP): the baseline (gradients averaged
by a gloo allreduce every step, as DDP does), D-SGD on the one-peer exponential graph, CHOCO
int8 on the hypercube, DiLoCo (allreduce mix), decentralized DiLoCo (neighbor mix, one-peer
exponential) and streaming decentralized DiLoCo with int8 public copies (hypercube, 3
fragments, each exchange merged ``--overlap`` inner steps after it starts: by default half of
H, tens of steps, far more than a 100 ms round trip takes). The DiLoCo forms run with the
workload's H, outer lr and outer momentum: for the language model the library's defaults (H =
50; the published outer lr 0.7 and Nesterov momentum 0.9).

Reported per method and setting: wall time to the target loss (the baseline's held-out loss after
the step budget; a method's loss at an evaluation is that of the ranks' averaged model, the model
a decentralized run ends with after one last average; the mean of the ranks' own losses is shown
beside it),
the final loss after the same budget of inner steps (a target "within 2%" means at most 2% above
the baseline's), the bytes each node sent (its interface's
counter), compute utilisation (forward, backward and inner-optimizer time / the loop's wall
time, evaluations excluded) beside the share of the loop spent in the wrapper's step outside the
inner optimizer ("waiting": the algorithm's own work and its waits) and the share blocked on
exchanges not yet finished (``client.blocked_seconds``; decent's methods), time per step, and
the speedups over the baseline. Writes
``--json``, ``--md`` (the table) and ``--png`` (held-out loss against wall time and against
bytes sent).
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

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/wan_train.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import (  # noqa: E402
    PREFIX,
    Runner,
    begin_run,
    skip_reason,
    tear_down,
)
from benchmarks.wan.link import WanNetwork, sysctl  # noqa: E402
from benchmarks.wan.training import METHODS, averaged_losses, rank_main  # noqa: E402
from benchmarks.wan.workloads import WORKLOADS  # noqa: E402

#: the issue's two links: rate, RTT in ms
SETTINGS = {"a": ("1gbit", 50.0), "b": ("100mbit", 100.0)}
DECENT_PORT, TORCH_PORT = 7710, 29510
#: targets (issue 44): at (b) streaming int8 vs the baseline: time to target, bytes, final loss,
#: utilisation; at (a): per-step speedups
TARGETS = {"b": {"streaming-diloco-int8": {"speedup": 10.0, "fewer_bytes": 100.0,
                                           "final_within": 0.02, "utilisation": 0.9}},
           "a": {"dsgd": {"step_speedup": 1.5}, "choco-int8": {"step_speedup": 3.0}}}
BASELINE = "gloo-allreduce"


def run_setting(a: argparse.Namespace, key: str) -> dict[str, Any]:
    """One setting: namespaces, the line, daemons, the ranks; every rank's results."""
    rate, rtt = SETTINGS[key]
    prefix = f"{PREFIX}{os.getpid()}"
    run_dir, cleanup = begin_run(prefix)
    ok = False
    try:
        net = WanNetwork(prefix, a.nodes, rate, cleanup, rtt_ms=rtt)
        net.up()
        for ns in net.ns if a.no_slow_start_after_idle else ():
            sysctl(ns, "net.ipv4.tcp_slow_start_after_idle=0")
        runner = Runner(net, run_dir, cleanup)
        # no security: gloo has none either
        daemons = runner.start_daemons(DECENT_PORT, "wan-bench",
                                       "log_level: warning\nsecurity: {mode: insecure}\n")
        line_cpu = net.line_cpu_seconds()
        began = time.monotonic()
        ranks = {f"rank-{i}": runner.spawn(i, f"rank-{i}", [
            sys.executable, str(Path(__file__).resolve()), "--rank-of", key,
            "--out", str(run_dir / f"rank-{i}.json"), *rank_args(a)], {
            "DECENT_DAEMON": str(run_dir / f"decentd-{i}.sock"), "RANK": str(i),
            "WORLD_SIZE": str(a.nodes), "MASTER_ADDR": net.ip(0),
            "MASTER_PORT": str(TORCH_PORT), "GLOO_SOCKET_IFNAME": "veth0"})
            for i in range(a.nodes)}
        show_progress(run_dir / "rank-0.log", f"({key}) {rate}, RTT {rtt:g} ms", a.methods,
                      [*ranks.values(), *daemons.values()], began + a.timeout)
        runner.wait_all(ranks, timeout=a.timeout, watch=daemons)
        elapsed = time.monotonic() - began
        per_rank = [json.loads((run_dir / f"rank-{i}.json").read_text())
                    for i in range(a.nodes)]
        averaged = {m: averaged_losses(a.workload, [np.load(run_dir / f"{m}-{i}.npy")
                                                    for i in range(a.nodes)])
                    for m in a.methods}
        ok = True
        return {"rate": rate, "rtt_ms": rtt, "ranks": per_rank, "averaged": averaged,
                "line_cpu_s": net.line_cpu_seconds() - line_cpu, "elapsed_s": elapsed}
    finally:
        tear_down(cleanup, run_dir, ok)


def show_progress(log: Path, title: str, methods: list[str], procs: list[Any],
                  deadline: float) -> None:
    """A progress bar of the methods rank 0 has finished (it logs each), until every process
    has exited, one has failed, or the deadline."""
    from rich.progress import Progress

    with Progress() as bar:
        task = bar.add_task(title, total=len(methods))
        while time.monotonic() < deadline and any(p.poll() is None for p in procs) and \
                not any(p.poll() not in (None, 0) for p in procs):
            text = log.read_text(errors="replace") if log.exists() else ""
            bar.update(task, completed=sum(line.startswith("method ")
                                           for line in text.splitlines()))
            if all(line_done in text for line_done in (f"method {m} done" for m in methods)):
                break
            time.sleep(1.0)


def rank_args(a: argparse.Namespace) -> list[str]:
    """The options a rank needs, as arguments."""
    return ["--workload", a.workload, "--steps", str(a.steps), "--long-steps",
            str(a.long_steps), "--batch", str(a.batch), "--lr", str(a.lr),
            "--seed", str(a.seed), "--eval-every", str(a.eval_every),
            "--local-steps", str(a.local_steps), "--outer-lr", str(a.outer_lr),
            "--outer-momentum", str(a.outer_momentum), "--overlap", str(a.overlap),
            "--methods", ",".join(a.methods),
            *(f"--option={o}" for o in a.option)]


# ------------------------------------------------------------------------------ the figures


def curve(ranks: list[dict[str, Any]], method: str, averaged: list[float]
          ) -> list[tuple[float, int, float, float]]:
    """(time, step, mean of the ranks' held-out losses, the averaged model's) at each
    evaluation: the slowest rank's time."""
    evals = [r["methods"][method]["evals"] for r in ranks]
    return [(max(e[k][0] for e in evals), int(evals[0][k][1]),
             statistics.fmean(e[k][2] for e in evals), averaged[k])
            for k in range(len(evals[0]))]


def summarize(run: dict[str, Any], budget: int) -> dict[str, dict[str, Any]]:
    """Per method: time to the baseline's loss after ``budget`` steps (over the whole run: the
    DiLoCo family runs longer), and at the budget: the loss, bytes, time per step; compute
    utilisation over the run; the ratios to the baseline."""
    ranks = run["ranks"]
    methods = list(ranks[0]["methods"])
    curves = {m: curve(ranks, m, run["averaged"][m]) for m in methods}
    at_budget = {m: next(e for e in curves[m] if e[1] == budget) for m in methods}
    target = at_budget[BASELINE][3] if BASELINE in methods else None
    rows: dict[str, dict[str, Any]] = {}
    for m in methods:
        c = curves[m]
        per = [r["methods"][m] for r in ranks]
        wall = max(p["budget"]["wall_s"] for p in per)
        reached = [t for t, _, _, loss in c if target is not None and loss <= target]
        rows[m] = {"time_to_target_s": reached[0] if reached else None,
                   "steps_run": per[0]["steps"], "run_s": max(p["wall_s"] for p in per),
                   "final_loss": at_budget[m][3], "final_own_loss": at_budget[m][2],
                   "wall_s": wall, "step_s": wall / budget,
                   "tx_bytes_per_node": statistics.fmean(p["budget"]["tx_bytes"] for p in per),
                   "utilisation": statistics.fmean(p["compute_s"] / p["wall_s"] for p in per),
                   "waiting": statistics.fmean(p["exchange_wait_s"] / p["wall_s"] for p in per),
                   "blocked": None if m == BASELINE else
                   statistics.fmean(p["blocked_s"] / p["wall_s"] for p in per),
                   "curve": c}
    base = rows.get(BASELINE)
    for row in rows.values():
        if base is None:
            break
        got, want = row["time_to_target_s"], base["time_to_target_s"]
        row["speedup"] = want / got if got and want else None
        row["step_speedup"] = base["step_s"] / row["step_s"]
        row["fewer_bytes"] = base["tx_bytes_per_node"] / max(row["tx_bytes_per_node"], 1.0)
        row["final_vs_baseline"] = row["final_loss"] / base["final_loss"] - 1.0
    return rows


def verdicts(key: str, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of setting ``key``: each with what was measured and whether it is met."""
    out = []
    for method, wants in TARGETS.get(key, {}).items():
        row = rows.get(method, {})
        for what, bound in wants.items():
            field = "final_vs_baseline" if what == "final_within" else what
            got = row.get(field)
            # final_within: at most ``bound`` above the baseline's loss (below is better)
            met = got is not None and (got <= bound if what == "final_within"
                                       else got >= bound)
            out.append({"method": method, "what": what, "target": bound, "got": got,
                        "met": met})
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: one table per setting, then the targets."""
    lines = [f"WAN training ({result['date']}, {result.get('workload', 'digits')}, "
             f"{result['nodes']} nodes, {result['steps']} inner steps, command: "
             f"`{result['command']}`)", ""]
    for key, setting in result["settings"].items():
        lines += [f"### ({key}) {setting['rate']}, RTT {setting['rtt_ms']:g} ms "
                  f"(delay line CPU {setting['line_cpu_s']:.0f} s of {setting['elapsed_s']:.0f} s)",
                  "", "| method | time to target | final loss (own) | sent per node | "
                  "utilisation (waiting; blocked) | step | speedup (target) | speedup (step) | "
                  "fewer bytes |", "|:--|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for m, r in setting["summary"].items():
            ttt = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] else \
                f"not in {r['steps_run']} steps"
            sp = f"{r['speedup']:.1f}x" if r.get("speedup") else "-"
            blocked = "-" if r.get("blocked") is None else f"{r['blocked']:.1%}"
            lines.append(f"| {m} | {ttt} | {r['final_loss']:.4f} ({r['final_own_loss']:.4f}) | "
                         f"{r['tx_bytes_per_node'] / 1e6:.2f} MB | {r['utilisation']:.0%} "
                         f"({r['waiting']:.0%}; {blocked}) | "
                         f"{r['step_s'] * 1e3:.0f} ms | {sp} | {r.get('step_speedup', 1):.1f}x | "
                         f"{r.get('fewer_bytes', 1):.0f}x |")
        for v in setting["targets"]:
            got = "-" if v["got"] is None else f"{v['got']:.3g}"
            lines.append(f"\n- {v['method']} {v['what']}: {got} (target {v['target']:g}): "
                         f"{'MET' if v['met'] else 'MISSED'}")
        lines.append("")
    return "\n".join(lines)


def draw(result: dict[str, Any], png: Path) -> None:
    """Held-out loss against wall time and against bytes sent, one row per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = result["settings"]
    fig, axes = plt.subplots(len(settings), 2, figsize=(11, 4 * len(settings)), squeeze=False)
    for row, (key, setting) in zip(axes, settings.items(), strict=True):
        for m, r in setting["summary"].items():
            c = r["curve"]
            sent, budget = r["tx_bytes_per_node"], result["steps"]
            row[0].plot([e[0] for e in c], [e[3] for e in c], label=m)
            row[1].plot([max(sent * e[1] / budget, 1.0) for e in c], [e[3] for e in c],
                        label=m)
        title = f"({key}) {setting['rate']}, RTT {setting['rtt_ms']:g} ms"
        row[0].set(xscale="log", xlabel="wall time (s)", ylabel="held-out loss, averaged model",
                   title=title)
        row[1].set(xscale="log", xlabel="bytes sent per node (pro rata)", title=title)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--settings", default="a,b", help="comma-separated: a, b")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--steps", type=int, default=200,
                   help="inner steps per method: the budget every method is compared at")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="charlm",
                   help="what every method trains (default charlm: the example's "
                        "character-level transformer LM; digits: the MLP)")
    p.add_argument("--long-steps", type=int,
                   help="inner steps of the DiLoCo family (their time to the target loss; "
                        "default: the workload's)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, help="AdamW's, every method (default: the workload's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--local-steps", type=int, help="DiLoCo's H (default: the workload's)")
    p.add_argument("--outer-lr", type=float, help="(default: the workload's)")
    p.add_argument("--outer-momentum", type=float, help="(default: the workload's)")
    p.add_argument("--overlap", type=int,
                   help="streaming DiLoCo's tau: inner steps a fragment's exchange may take "
                        "(default: half of --local-steps)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--option", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="change one option of a method (VALUE in JSON), e.g. "
                        "streaming-diloco-int8:alpha=0.0; repeatable")
    p.add_argument("--no-slow-start-after-idle", action="store_true",
                   help="hosts tuned for long links: net.ipv4.tcp_slow_start_after_idle=0 in "
                        "every node (TCP keeps its window across the pauses between "
                        "exchanges instead of starting again from 10 segments)")
    p.add_argument("--timeout", type=float, default=1800.0)
    for suffix in ("json", "md", "png"):
        p.add_argument(f"--{suffix}", type=Path, help="default: benchmarks/results/wan."
                       f"{suffix} (the digits workload: wan_digits.{suffix})")
    p.add_argument("--rank-of", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.methods = [m for m in a.methods.split(",") if m]
    a.options = {}
    for o in a.option:
        method, _, setting = o.partition(":")
        key, _, value = setting.partition("=")
        if method not in METHODS or not key or not value:
            p.error(f"--option {o!r}: want METHOD:KEY=VALUE with METHOD one of "
                    f"{', '.join(METHODS)}")
        a.options.setdefault(method, {})[key] = json.loads(value)
    recipe = WORKLOADS[a.workload][1]
    for key, value in vars(recipe).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    stem = "wan" if a.workload == "charlm" else f"wan_{a.workload}"
    for suffix in ("json", "md", "png"):
        if getattr(a, suffix) is None:
            setattr(a, suffix, REPO / "benchmarks" / "results" / f"{stem}.{suffix}")
    if a.steps % a.eval_every or a.long_steps < a.steps:
        p.error("--steps must be a multiple of --eval-every, and --long-steps >= --steps")
    if a.overlap is None:
        a.overlap = a.local_steps // 2
    unknown = sorted(set(a.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    """Every setting asked for, then the table, the JSON and the plot."""
    a = parse(argv)
    if a.rank_of:
        return rank_main(a)
    reason = skip_reason()
    if reason:
        print(reason)
        return 3
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nodes": a.nodes, "steps": a.steps, "cpus": os.cpu_count(), "workload": a.workload,
        "tcp_slow_start_after_idle": 0 if a.no_slow_start_after_idle else "default (1)",
        "command": " ".join(["benchmarks/wan_train.py", *(argv or sys.argv[1:])]),
        "settings": {}}
    for key in [k for k in a.settings.split(",") if k]:
        run = run_setting(a, key)
        summary = summarize(run, a.steps)
        result["settings"][key] = {"rate": run["rate"], "rtt_ms": run["rtt_ms"],
                                   "line_cpu_s": run["line_cpu_s"],
                                   "elapsed_s": run["elapsed_s"], "summary": summary,
                                   "targets": verdicts(key, summary)}
        print(table({**result, "settings": {key: result["settings"][key]}}), flush=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    a.md.write_text(table(result) + "\n")
    draw(result, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
