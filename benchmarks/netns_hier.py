"""Hierarchical D-SGD vs flat D-SGD over workers vs gloo ring allreduce, across netns nodes.

Needs root (it creates network namespaces)::

    sudo .venv/bin/python benchmarks/netns_hier.py [--nodes 4] [--per-node 2] [--mbytes 25]
        [--rate 1gbit] [--repeats 12] [--json benchmarks/results/netns_hier.json] [--png PATH]
    sudo .venv/bin/python benchmarks/netns_hier.py --cleanup   # leftovers of a killed run

The network is :class:`benchmarks.netns_dsgd.Network`: ``--nodes`` namespaces on a bridge, each
link limited to ``--rate`` both ways with ``tc tbf`` (namespaces ``dchr<pid>-<i>``). Each node
runs one daemon (``--workers-per-node L``, worker topology and machine topology both
``one-peer-exponential``) and L worker processes (local ranks 0..L-1; worker rank = node * L +
local rank). Every worker runs three systems, their calls interleaved call by call (the order
rotates every 3 calls, so each system meets the same host in every position):

* ``gloo``: ``dist.all_reduce`` (SUM) over all W = nodes * L workers, ranks numbered node by
  node, so the ring crosses each node's link once (2(W-1)/W of the model per link and step);
* ``flat``: ``client.neighbor_allreduce_`` on the workers' one-peer exponential graph: a node
  sends one copy per local worker whose peer is on another node (for 4 x 2 workers: one copy
  at the first step of the period, two at the other two);
* ``hier``: ``client.hierarchical_neighbor_allreduce_``: the daemon averages its workers in
  shared memory and sends one copy to the one peer machine of the machine graph's step.

Tensors are float32 of ``--mbytes`` MB in torch shared memory (registered with the daemon),
filled with the worker's rank; every result is checked exactly (gloo: W(W-1)/2; flat: the mean
of the rank and its in-neighbor; hier: the machine graph's mix of the machines' means) and the
tensor refilled, after a barrier that follows the timed call. Timing is netns_dsgd's ``common``
start: rank 0 broadcasts an instant 250 ms ahead on the shared monotonic clock, every rank's
time runs from it to the end of its call; a repeat's time is the slowest rank's, the reported
value the median over ``--repeats``. Bytes per link: the node's ``veth0`` tx counter (all
traffic, headers and ACKs included) and, for decent, the daemon's ``bytes_sent`` to its peers
(its status counters), both read by local rank 0 around each call, per node and step.

Targets: hier at least 1.6x faster than gloo and 1.7x faster than flat (median step time).
Exit code 0: every target met; 3: a target missed; 1: a failure or a wrong result. Without
root it says why, writes ``{"skipped": ...}`` and exits 0. Processes and namespaces are removed
whatever happens (exceptions, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/netns_hier.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.hostprobe import memmove_ms  # noqa: E402
from benchmarks.netns_dsgd import (  # noqa: E402
    NODE_IF,
    QUIET_STEAL,
    BenchError,
    DecentCalls,
    GlooCalls,
    Network,
    Runner,
    TimedSystem,
    begin_run,
    decent_source,
    leftover_namespaces,
    link_test,
    numel,
    parse_rate,
    proc_cpu_seconds,
    run_and_report,
    signals_raise,
    skip_reason,
    summarize,
    tail,
    tbf_drops,
    tear_down,
    warmup_steps,
)
from benchmarks.netns_dsgd import (  # noqa: E402
    cleanup_leftovers as netns_cleanup_leftovers,
)
from decent_wire.topology import build_topology, from_spec  # noqa: E402
from decentd.security.auth import write_secret  # noqa: E402
from decentd.tools.launcher import worker_env  # noqa: E402

PREFIX = "dchr"
DECENT_PORT = 7700
KIND = "one-peer-exponential"
SYSTEMS = ("gloo", "flat", "hier")
LABELS = {"gloo": "gloo ring allreduce", "flat": "decent flat D-SGD (workers)",
          "hier": "decent hierarchical D-SGD"}
#: speedup targets: (slower system, faster system) -> at least this ratio of median step times
TARGETS = {"gloo_over_hier": ("gloo", "hier", 1.6), "flat_over_hier": ("flat", "hier", 1.7)}
DEFAULT_JSON = REPO / "benchmarks" / "results" / "netns_hier.json"
TX_BYTES = Path(f"/sys/class/net/{NODE_IF}/statistics/tx_bytes")


# ------------------------------------------------------------------------------ link theory


def link_copies(nodes: int, per_node: int) -> dict[str, list[float]]:
    """Model copies the busiest node's link carries (upload) at each step of each system's
    schedule: gloo's ring (ranks node by node), flat one-peer over the workers, hierarchical
    one-peer over the nodes."""
    world = nodes * per_node
    flat, machines = build_topology(KIND, world), build_topology(KIND, nodes)

    def remote(m: int, s: int) -> int:
        return sum(d // per_node != m for r in range(m * per_node, (m + 1) * per_node)
                   for d in flat.step(r, s).dst_ranks)

    return {
        "gloo": [2 * (world - 1) / world if nodes > 1 else 0.0],
        "flat": [float(max(remote(m, s) for m in range(nodes))) for s in range(flat.period)],
        "hier": [float(max(len(machines.step(m, s).dst_ranks) for m in range(nodes)))
                 for s in range(machines.period)],
    }


def theory(nodes: int, per_node: int, mbytes: float, rate: str) -> dict[str, Any]:
    """Link-only bounds: per system the median over its schedule of copies x model / rate."""
    copies = link_copies(nodes, per_node)
    seconds = {k: statistics.median(v) * mbytes * 8e6 / parse_rate(rate)
               for k, v in copies.items()}
    out: dict[str, Any] = {"copies_per_step": copies,
                           "step_s": seconds}
    out["speedups"] = {key: seconds[a] / seconds[b] if seconds[b] else None
                       for key, (a, b, _) in TARGETS.items()}
    return out


# ------------------------------------------------------------------------------ workers


class FlatCalls(DecentCalls):
    """``neighbor_allreduce_`` on the workers' one-peer graph, through a shared client."""

    name = "flat"

    def __init__(self, a: argparse.Namespace, client: Any) -> None:
        TimedSystem.__init__(self, a)
        self.client, self.op_name, self.opt, self.src = client, self.name, None, -1
        self.t = self.torch.full((numel(a.mbytes),), float(a.rank), dtype=self.torch.float32)
        self.t.share_memory_()

    def timed(self) -> Any:
        """One D-SGD step over the workers."""
        return self.client.neighbor_allreduce_(self.t, name=self.op_name)

    def helper_cpu(self) -> float:
        """The daemon's CPU seconds, counted by local rank 0 only (its workers share it)."""
        return proc_cpu_seconds(self.a.daemon_pid) if self.a.local == 0 else 0.0

    def close(self) -> None:
        """Nothing: the worker closes the shared client once."""


class HierCalls(FlatCalls):
    """``hierarchical_neighbor_allreduce_`` on the machine graph."""

    name = "hier"

    def __init__(self, a: argparse.Namespace, client: Any) -> None:
        super().__init__(a, client)
        self.machines = from_spec(json.loads(client.machine_topology.spec_json),
                                  client.machine_size)
        self.expected = 0.0

    def before(self, k: int) -> None:
        """The closed form of call ``k``: the machine graph's mix of the machines' means."""
        per = self.client.local_size

        def mean(m: int) -> float:
            return m * per + (per - 1) / 2

        step = self.machines.step(self.client.machine_rank, k)
        self.expected = step.self_weight * mean(self.client.machine_rank) + sum(
            w * mean(j) for j, w in step.src_weights.items())

    def timed(self) -> Any:
        """One hierarchical D-SGD step."""
        return self.client.hierarchical_neighbor_allreduce_(self.t, name=self.op_name)

    def check(self, k: int, out: Any) -> None:
        """Every element equals the closed form."""
        if not bool(self.torch.all(out == self.expected)):
            self.calls.errors.append(f"hier rank {self.a.rank} call {k}: values "
                                     f"{out.min()}..{out.max()}, expected {self.expected}")


def read_counters(client: Any) -> tuple[int, int]:
    """This node's veth tx bytes and its daemon's bytes sent to peers, so far."""
    return int(TX_BYTES.read_text()), sum(p.bytes_sent for p in client.status().peers)


def rotation(k: int, warm: int, n: int) -> int:
    """Where call ``k``'s order of the ``n`` systems starts: it rotates every ``n`` timed
    calls, so that a system's position does not follow the flat graph's step."""
    return 0 if k < warm else ((k - warm) // n) % n


def worker_main(a: argparse.Namespace) -> dict[str, Any]:
    """One worker: the three systems' calls interleaved; local rank 0 meters its node."""
    import torch

    import decent.torch as dt

    torch.set_num_threads(1)
    world = a.nodes * a.per_node
    rank = a.machine * a.per_node + a.local
    sa = argparse.Namespace(rank=rank, nodes=world, mbytes=a.mbytes, mode="registered",
                            daemon_pid=a.daemon_pid, local=a.local)
    gloo = GlooCalls(sa)
    client = dt.connect(local_rank=a.local)
    if (client.rank, client.size, client.machine_rank) != (rank, world, a.machine):
        raise SystemExit(f"daemon says rank {client.rank} of {client.size} on machine "
                         f"{client.machine_rank}, expected {rank} of {world} on {a.machine}")
    systems: list[TimedSystem] = [gloo, FlatCalls(sa, client), HierCalls(sa, client)]
    sent: dict[str, list[dict[str, int]]] = {s.name: [] for s in systems}
    warm = warmup_steps(world)
    for k in range(warm + a.repeats):
        kind = None if k < warm else "common"
        r = rotation(k, warm, len(systems))
        for system in systems[r:] + systems[:r]:
            before = read_counters(client) if a.local == 0 else (0, 0)
            system.call(k, kind)
            if a.local == 0 and kind is not None:
                after = read_counters(client)
                sent[system.name].append({"call": k, "link_tx": after[0] - before[0],
                                          "daemon_sent": after[1] - before[1]})
    for system in reversed(systems):
        system.close()
    client.close()
    return {"rank": rank, "machine": a.machine, "local": a.local, "bytes": sent,
            "ok": not any(s.calls.errors for s in systems),
            **{s.name: s.calls.result(rank) for s in systems}}


# ------------------------------------------------------------------------------ driver


def start_daemons(runner: Runner, per_node: int) -> tuple[dict[str, subprocess.Popen[bytes]],
                                                          list[Path]]:
    """One daemon per namespace serving ``per_node`` workers; waits for their sockets."""
    net, run_dir = runner.net, runner.run_dir
    peers = ",".join(f"{net.ip(i)}:{DECENT_PORT}" for i in range(net.nodes))
    sockets = [run_dir / f"decentd-{i}.sock" for i in range(net.nodes)]
    secret = str(write_secret(run_dir / "secret"))  # secret mode: what a real cluster runs
    daemons = {f"decentd-{i}": runner.spawn(i, f"decentd-{i}", [
        sys.executable, "-m", "decentd", "--rank", str(i), "--peers", peers,
        "--socket", str(sockets[i]), "--topology", KIND, "--machine-topology", KIND,
        "--workers-per-node", str(per_node), "--cluster-id", "netns-hier",
        "--log-level", "warning", "--set", f"memory.arena_bytes={128 << 20}",
        "--security-mode", "secret", "--secret-file", secret])
        for i in range(net.nodes)}
    deadline = time.monotonic() + 90
    while not all(s.exists() for s in sockets):
        died = {k: p.returncode for k, p in daemons.items() if p.poll() is not None}
        if died or time.monotonic() > deadline:
            raise BenchError(f"decentd not up (exited: {died})\n" + runner.tails(list(daemons)))
        time.sleep(0.1)
    return daemons, sockets


def run_workers(runner: Runner, a: argparse.Namespace, job: str) -> dict[str, Any]:
    """Daemons and workers in the namespaces; the per-worker results and the daemons' ends."""
    daemons, sockets = start_daemons(runner, a.per_node)
    world = a.nodes * a.per_node
    try:
        procs = {}
        for r in range(world):
            m, local = divmod(r, a.per_node)
            env = worker_env(r, world, a.per_node, str(sockets[m]), job)
            env["GLOO_SOCKET_IFNAME"] = NODE_IF
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker",
                    "--machine", str(m), "--local", str(local), "--nodes", str(a.nodes),
                    "--per-node", str(a.per_node), "--mbytes", str(a.mbytes),
                    "--repeats", str(a.repeats), "--daemon-pid", str(daemons[f"decentd-{m}"].pid),
                    "--out", str(runner.run_dir / f"worker-{r}.json")]
            procs[f"worker-{r}"] = runner.spawn(m, f"worker-{r}", argv, env)
        calls = len(SYSTEMS) * (warmup_steps(world) + a.repeats)
        runner.wait_all(procs, timeout=300 + 15 * calls, watch=daemons)
        workers = [json.loads((runner.run_dir / f"worker-{r}.json").read_text())
                   for r in range(world)]
    finally:
        runner.cleanup.stop_procs(list(daemons.values()))
    logs = {k: tail(runner.run_dir / f"{k}.log", 10) for k in daemons
            if (runner.run_dir / f"{k}.log").stat().st_size}
    return {"workers": workers, "daemon_exit_codes": {k: p.returncode for k, p in daemons.items()},
            "daemon_log_tails": logs}


def link_bytes(per_node: list[list[dict[str, int]]]) -> dict[str, Any]:
    """Bytes per link and step, per node (mean over the timed calls) and the largest call."""
    out: dict[str, Any] = {}
    for key in ("link_tx", "daemon_sent"):
        means = [statistics.mean(c[key] for c in calls) / 1e6 for calls in per_node]
        out[f"{key}_mb_per_step"] = means
        out[f"{key}_mb_mean"] = statistics.mean(means)
        out[f"{key}_mb_max_call"] = max(c[key] for calls in per_node for c in calls) / 1e6
    # the busiest node's link per timed call (flat: 1, 2, 2 copies over its period for 4 x 2)
    by_call: dict[int, float] = {}
    for calls in per_node:
        for c in calls:
            by_call[c["call"]] = max(by_call.get(c["call"], 0.0), c["link_tx"] / 1e6)
    out["link_tx_mb_by_call"] = {str(k): v for k, v in sorted(by_call.items())}
    return out


def summarize_systems(workers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system: :func:`summarize` of the common-start calls, and the bytes per link."""
    out = {}
    for name in SYSTEMS:
        rows = [dict(w[name], **w[name]["by_start"]["common"]) for w in workers]
        out[name] = summarize(rows)
        out[name]["bytes"] = link_bytes([w["bytes"][name] for w in workers if w["local"] == 0])
    return out


def verdicts(res: dict[str, Any]) -> None:
    """Speedups, targets, correctness and host conditions into ``res``."""
    sys_ = res["systems"]
    res["speedups"] = {k: sys_[a]["median_s"] / sys_[b]["median_s"]
                       for k, (a, b, _) in TARGETS.items()}
    res["targets"] = {k: {"target": t, "value": res["speedups"][k],
                          "met": res["speedups"][k] >= t} for k, (_, _, t) in TARGETS.items()}
    res["meets_targets"] = all(v["met"] for v in res["targets"].values())
    res["correct"] = all(s["correct"] for s in sys_.values())
    res["steal_frac"] = max(s["steal_frac"] for s in sys_.values())
    res["quiet_steal"] = QUIET_STEAL
    res["quiet_host"] = res["steal_frac"] <= QUIET_STEAL


def run(a: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    """Build the network, run the link test and the three systems, tear everything down."""
    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    if a.nodes < 2 or a.per_node < 1:
        raise ValueError("--nodes must be >= 2 and --per-node >= 1")
    started, prefix = time.perf_counter(), f"{PREFIX}{os.getpid()}"
    run_dir, cleanup = begin_run(prefix)
    ok = False
    try:
        with signals_raise():
            res: dict[str, Any] = {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "nodes": a.nodes, "per_node": a.per_node, "workers": a.nodes * a.per_node,
                "mbytes": a.mbytes, "rate": a.rate, "repeats": a.repeats,
                "warmup": warmup_steps(a.nodes * a.per_node), "topology": KIND,
                "cpus": os.cpu_count(), "run_dir": str(run_dir),
                "loadavg_start": list(os.getloadavg()), "memmove_64mib_ms": memmove_ms(),
                "decent_source": decent_source(),
                "theory": theory(a.nodes, a.per_node, a.mbytes, a.rate)}
            say(f"creating {a.nodes} namespaces + switch, tbf {a.rate} both ways")
            net = Network(prefix, a.nodes, a.rate, cleanup)
            net.up()
            res["tbf"] = {"rate": a.rate, "burst_bytes": net.burst, "limit_bytes": net.limit,
                          "flow_steering": net.steered}
            runner = Runner(net, run_dir, cleanup)
            say("raw TCP link test")
            res["link"] = link_test(runner)
            say(f"gloo, flat and hierarchical D-SGD of {a.mbytes:g} MB on {a.nodes} x "
                f"{a.per_node} workers, {res['warmup']}+{a.repeats} calls each")
            out = run_workers(runner, a, job=f"netns-{prefix}")
            res["systems"] = summarize_systems(out["workers"])
            res["daemons"] = {k: out[k] for k in ("daemon_exit_codes", "daemon_log_tails")}
            res["tbf_dropped_packets"] = tbf_drops(net.qdisc_stats())
            res["loadavg_end"] = list(os.getloadavg())
            verdicts(res)
            ok = True
    finally:
        say("cleaning up namespaces and processes")
        left = tear_down(cleanup, run_dir, ok)
    res["leftover_processes"] = left
    res["leftover_namespaces"] = leftover_namespaces(prefix)
    res["total_s"] = time.perf_counter() - started
    return res


def cleanup_leftovers() -> list[str]:
    """Delete ``dchr*`` namespaces and run directories whose run is no longer alive."""
    return netns_cleanup_leftovers(PREFIX, Path(__file__).name)


# ------------------------------------------------------------------------------ output


def print_report(res: dict[str, Any]) -> None:
    """Rich table: step times, link bounds, bytes per link, speedups against the targets."""
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if sys.stdout.isatty() else 140)
    th = res["theory"]
    t = Table(title=f"{res['nodes']} namespaces x {res['per_node']} workers, {res['rate']} "
                    f"tbf links, {res['mbytes']:g} MB float32 model, median of "
                    f"{res['repeats']} (slowest rank)")
    for col in ("system", "step", "link bound", "MB/link/step (veth tx)", "daemon MB/step",
                "CPU cores", "exact"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for name in SYSTEMS:
        s, b = res["systems"][name], res["systems"][name]["bytes"]
        t.add_row(LABELS[name], f"{s['median_s'] * 1e3:.0f} ms",
                  f"{th['step_s'][name] * 1e3:.0f} ms",
                  f"{b['link_tx_mb_mean']:.1f} (max {b['link_tx_mb_max_call']:.1f})",
                  "-" if name == "gloo" else f"{b['daemon_sent_mb_mean']:.1f}",
                  f"{s['cpu_cores_busy']:.2f}", "yes" if s["correct"] else "[red]NO[/]")
    out.print(t)
    for key, v in res["targets"].items():
        a, b, _ = TARGETS[key]
        mark = "[green]met[/]" if v["met"] else "[red]missed[/]"
        out.print(f"{a}/{b}: {v['value']:.2f}x (target {v['target']}x, link bound "
                  f"{th['speedups'][key]:.2f}x) {mark}")
    link = res["link"]
    out.print(f"raw TCP {link['single_gbit_s']:.3f} Gbit/s one flow; steal "
              f"{res['steal_frac']:.0%}; load average start {res['loadavg_start']} end "
              f"{res['loadavg_end']}; 64 MiB memmove {res['memmove_64mib_ms']:.1f} ms; tbf drops "
              f"{res['tbf_dropped_packets']}; total {res['total_s']:.0f} s")
    for name in SYSTEMS:
        per = " ".join(f"{v * 1e3:.0f}" for v in res["systems"][name]["per_repeat_max_s"])
        out.print(f"  {name} per repeat (ms): {per}")
        for e in res["systems"][name]["errors"]:
            out.print(f"[red]{e}[/]")


def write_png(res: dict[str, Any], path: Path) -> None:
    """Two panels: median step times with link bounds; MB per link and step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [LABELS[n].replace("decent ", "decent\n") for n in SYSTEMS]
    xs = list(range(len(SYSTEMS)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    step = [res["systems"][n]["median_s"] * 1e3 for n in SYSTEMS]
    bound = [res["theory"]["step_s"][n] * 1e3 for n in SYSTEMS]
    ax1.bar([x - 0.2 for x in xs], step, 0.4, label="measured (median of slowest rank)")
    ax1.bar([x + 0.2 for x in xs], bound, 0.4, label=f"link-only bound at {res['rate']}")
    ax1.set_xticks(xs, labels, fontsize=8)
    ax1.set_ylabel("ms per step")
    sp = res["speedups"]
    ax1.set_title(f"gloo/hier {sp['gloo_over_hier']:.2f}x, flat/hier {sp['flat_over_hier']:.2f}x")
    ax1.set_ylim(0, max(step + bound) * 1.35)
    ax1.legend(loc="upper right", fontsize=8)
    tx = [res["systems"][n]["bytes"]["link_tx_mb_mean"] for n in SYSTEMS]
    dm = [res["systems"][n]["bytes"]["daemon_sent_mb_mean"] if n != "gloo" else 0.0
          for n in SYSTEMS]
    ax2.bar([x - 0.2 for x in xs], tx, 0.4, label="veth tx (all traffic)")
    ax2.bar([x + 0.2 for x in xs], dm, 0.4, label="daemon bytes_sent to peers")
    ax2.set_xticks(xs, labels, fontsize=8)
    ax2.set_ylabel("MB per node link and step (mean)")
    ax2.set_title(f"{res['nodes']} nodes x {res['per_node']} workers, {res['mbytes']:g} MB model")
    ax2.legend(loc="upper right", fontsize=8)
    ax2.set_ylim(0, max(tx + dm) * 1.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4, help="network namespaces (daemons)")
    p.add_argument("--per-node", type=int, default=2, help="workers per namespace")
    p.add_argument("--mbytes", type=float, default=25.0, help="model size in MB (10^6 bytes)")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate per link and direction")
    p.add_argument("--repeats", type=int, default=12,
                   help="timed calls per system; a multiple of 6 weighs every step of both "
                   "graphs (periods 3 and 2 for 4 x 2 workers) equally")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--png", type=Path)
    p.add_argument("--cleanup", action="store_true",
                   help=f"delete leftover namespaces named {PREFIX}* of dead runs and exit")
    # internal: one worker inside a namespace
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--machine", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--local", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--daemon-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: the benchmark (exit 0 / 3 / 1, see the module doc), a worker, or cleanup."""
    a = build_parser().parse_args(argv)
    if a.worker:
        res = worker_main(a)
        if a.out:
            a.out.write_text(json.dumps(res))
        return 0 if res["ok"] else 1
    if a.cleanup:
        reason = skip_reason()
        removed = [] if reason else cleanup_leftovers()
        print(reason or f"removed {len(removed)}: {' '.join(removed) or '-'}")
        return 0
    outcome = run_and_report(a, lambda say: run(a, say), print_report, write_png)
    if isinstance(outcome, int):
        return outcome
    res = outcome
    if not res["correct"]:
        return 1
    return 0 if res["meets_targets"] else 3


if __name__ == "__main__":
    sys.exit(main())
