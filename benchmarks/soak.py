"""Soak under churn: D-SGD on 8 network namespaces for 10 minutes while a seeded random fault
strikes a random node every 15-30 s, against a run without faults.

    .venv/bin/python benchmarks/soak.py [--duration 600] [--baseline-s 180] [--seed 0]
    .venv/bin/python benchmarks/soak.py --replot        # soak.png again, from soak.json

The network, daemons and workers are :mod:`benchmarks.chaos`'s (exponential graph, ``on_peer_loss:
reweight``, the digits CNN, compute padded to ``--pad-ms``); the workers train until a
wall-clock deadline. From the time every rank has trained a step, the faults (:data:`FAULTS`):
SIGKILL of a node's daemon (its worker goes with it, as when the node dies); SIGKILL of its
worker alone; SIGSTOP of both for 5 s; its link down for 5 s; an outsider (a ninth namespace)
holding 128 unauthenticated connections to its bulk port for 20 s. A supervisor loop restarts
what died: the daemon with the same config, then the worker (after a daemon restart it takes
its state from the live ranks; restarted alone, it starts from its own initial model). Every
2 s each daemon's status (view, RSS) and its open descriptors and CPU time are sampled.

Reported (``soak.json``, ``.md``, ``.png``: steps per second, live set, RSS and descriptors over
time, faults marked): the survivors' failed steps (target 0); the throughput kept against the run
without faults (target >= 90%); per fault, the time from the restart or resume to the node being
back in every out-neighbor's averages (target <= 10 s; the worst is reported); whether the
daemons' views agree at the end; the final accuracy against the run without faults (target within
1 point; the digits CNN is saturated long before either run ends); RSS and descriptors of the
daemons that lived through the run, from the end of the first minute to the end (flat: RSS within
10%, at most 4 descriptors more). Exit 0 when the run completes (a missed target says MISSED), 1
when it crashes; without root it says why and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/soak.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

import benchmarks.chaos_run as cr  # noqa: E402
import benchmarks.netns_dsgd as nd  # noqa: E402
from benchmarks import cli  # noqa: E402
from benchmarks.soak_analysis import FAULTS, analyze, series  # noqa: E402
from decent_wire.v1 import decent_pb2 as pb  # noqa: E402
from decent_wire.v1 import decent_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PREFIX = "dsok"
DATA_PORT = 7701
#: seconds a SIGSTOP or a link down lasts, and an outsider holds its connections
PAUSE_S, OUTSIDER_S, OUTSIDER_CONNECTIONS = 5.0, 20.0, 128
console = Console(stderr=True)


class SoakJob(cr.Job):
    """A chaos job whose daemons take bulk connections on a known port (the outsider's
    target)."""

    def config(self, i: int) -> Path:
        """Node ``i``'s ``node.yaml``: chaos's, with ``transport.data_port``."""
        cfg = super().config(i)
        cfg.write_text(cfg.read_text() + f"transport: {{data_port: {DATA_PORT}}}\n")
        return cfg


def outsider_main(argv: list[str]) -> int:
    """``soak.py --outsider IP SECONDS COUNT SOURCES``: hold COUNT connections to IP's bulk
    port from the comma-separated SOURCES in turn that never say HELLO, opening again each
    one the daemon closes, for SECONDS."""
    ip, seconds, count = argv[0], float(argv[1]), int(argv[2])
    sources = argv[3].split(",")
    deadline, held = time.monotonic() + seconds, list[socket.socket]()
    opened = 0
    while time.monotonic() < deadline:
        alive = []
        for s in held:
            try:
                s.setblocking(False)
                gone = s.recv(1) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                s.close()
            else:
                alive.append(s)
        held = alive
        while len(held) < count and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(
                    (ip, DATA_PORT), timeout=1, source_address=(sources[opened % len(sources)], 0)))
                opened += 1
        time.sleep(0.2)
    print(json.dumps({"opened": opened, "held_at_end": len(held)}))
    return 0


def outsider_sources(net: nd.Network, n: int) -> list[str]:
    """The outsider's addresses: its namespace's (node ``n``'s) and four more on its link."""
    return [net.ip(n)] + [f"{nd.SUBNET}.{200 + k}" for k in range(4)]


def add_outsider_addresses(net: nd.Network, n: int) -> None:
    """Give the outsider's namespace its extra addresses."""
    for ip in outsider_sources(net, n)[1:]:
        nd.sh("ip", "-n", net.ns[n], "addr", "add", f"{ip}/24", "dev", nd.NODE_IF)


class Churn:
    """One run: the job, its supervisor, the faults it injects and what it samples."""

    def __init__(self, runner: nd.Runner, a: argparse.Namespace, name: str,
                 faults: bool) -> None:
        self.runner, self.a, self.faults = runner, a, faults
        self.job = SoakJob(runner, a, name)
        self.n = a.nodes
        self.rng = random.Random(a.seed)
        self.events: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.starts = {f"{k}-{i}": 0 for i in range(self.n) for k in ("decentd", "worker")}
        #: nodes the supervisor leaves alone until the time given (a stopped node)
        self.hold: dict[int, float] = {}
        self.pending: list[tuple[float, str, int]] = []  #: (when, what, node) to undo a fault

    def event(self, kind: str, node: int, **extra: Any) -> None:
        self.events.append({"t": time.time(), "kind": kind, "node": node, **extra})

    # -------------------------------------------------------------- processes

    def _signal(self, key: str, sig: int) -> None:
        proc = self.job.procs.get(key)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            if sig == signal.SIGKILL:
                proc.wait()

    def _restart(self, what: str, i: int) -> None:
        key = f"{what}-{i}"
        self.starts[key] += 1
        if what == "decentd":
            self.job.start_daemon(i, inc=self.starts[key])
        else:
            self.job.start_worker(i, inc=self.starts[key])
        self.event(f"restart_{'daemon' if what == 'decentd' else 'worker'}", i)

    def supervise(self) -> None:
        """Restart a dead daemon (its worker goes with it) and then a dead worker, as a
        process supervisor would."""
        now = time.time()
        for i in range(self.n):
            if self.hold.get(i, 0) > now:
                continue
            daemon = self.job.procs.get(f"decentd-{i}")
            if daemon is None or daemon.poll() is not None:
                self._signal(f"worker-{i}", signal.SIGKILL)
                self._restart("decentd", i)
                continue
            worker = self.job.procs.get(f"worker-{i}")
            if (worker is None or worker.poll() is not None) and now < self.a.until - 30 \
                    and self.job.sockets[i].exists():
                self._restart("worker", i)

    # -------------------------------------------------------------- faults

    def strike(self) -> None:
        """One fault of a seeded random kind on a seeded random node."""
        kind, i = self.rng.choice(self.a.faults), self.rng.randrange(self.n)
        self.event(kind, i)
        if kind == "kill_daemon":
            self._signal(f"decentd-{i}", signal.SIGKILL)
        elif kind == "kill_worker":
            self._signal(f"worker-{i}", signal.SIGKILL)
        elif kind == "stop":
            for key in (f"decentd-{i}", f"worker-{i}"):
                self._signal(key, signal.SIGSTOP)
            self.hold[i] = time.time() + PAUSE_S + 1
            self.pending.append((time.time() + PAUSE_S, "cont", i))
        elif kind == "link":
            self.job.set_link(i, up=False)
            self.pending.append((time.time() + PAUSE_S, "link_up", i))
        else:
            self.job.spawn(f"outsider-{len(self.events)}", self.n, 0, [
                sys.executable, str(Path(__file__).resolve()), "--outsider",
                self.runner.net.ip(i), str(OUTSIDER_S), str(OUTSIDER_CONNECTIONS),
                ",".join(outsider_sources(self.runner.net, self.n))])
            self.pending.append((time.time() + OUTSIDER_S, "outsider_end", i))

    def undo_due(self) -> None:
        """End the faults whose time is up."""
        now, left = time.time(), []
        for when, what, i in self.pending:
            if when > now:
                left.append((when, what, i))
                continue
            if what == "cont":
                for key in (f"decentd-{i}", f"worker-{i}"):
                    self._signal(key, signal.SIGCONT)
            elif what == "link_up":
                self.job.set_link(i, up=True)
            self.event(what, i)
        self.pending = left

    # -------------------------------------------------------------- sampling

    def status(self, i: int) -> pb.StatusReply | None:
        with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(
                f"unix://{self.job.sockets[i]}") as channel:
            reply: pb.StatusReply = pb_grpc.WorkerStub(channel).Status(pb.StatusRequest(),
                                                                       timeout=0.5)
            return reply
        return None

    def sample(self) -> None:
        """Each daemon's view, RSS, descriptors and CPU time now (None: it did not answer)."""
        row: dict[str, Any] = {"t": time.time(), "daemons": {}}
        for i in range(self.n):
            if self.hold.get(i, 0) > time.time():
                continue
            st = self.status(i)
            if st is None:
                continue
            with contextlib.suppress(OSError):
                row["daemons"][str(i)] = {
                    "pid": st.pid, "rss_mb": st.rss_bytes / 2**20, "epoch": st.view_epoch,
                    "live": list(st.live_daemons), "fds": len(os.listdir(f"/proc/{st.pid}/fd")),
                    "cpu_s": nd.proc_cpu_seconds(st.pid)}
        self.samples.append(row)

    # -------------------------------------------------------------- the run

    def run(self, progress: Progress) -> dict[str, Any]:
        """Start, churn until the deadline, collect; the run's raw record."""
        a, job = self.a, self.job
        task = progress.add_task(job.name, total=a.until - time.time())
        start = time.time()
        next_fault = float("inf")  # once every rank has trained a step
        next_sample = start
        try:
            job.start_all()
            while time.time() < a.until:
                job.tail.poll()
                self.undo_due()
                self.supervise()
                if next_fault == float("inf") and all(k > 0 for k in job.tail.step):
                    next_fault = time.time() + self.rng.uniform(a.fault_min_s, a.fault_max_s)
                if self.faults and time.time() >= next_fault and time.time() < a.until - 40:
                    self.strike()
                    next_fault = time.time() + self.rng.uniform(a.fault_min_s, a.fault_max_s)
                if time.time() >= next_sample:
                    self.sample()
                    next_sample += a.sample_s
                progress.update(task, completed=time.time() - start)
                time.sleep(0.1)
            while self.pending:
                self.undo_due()
                time.sleep(0.1)
            job.wait(lambda: job.workers_done(), "the workers", 120, failing=True)
            self.sample()
            end = self.samples[-1]["daemons"]
        finally:
            job.stop()
        return {"name": job.name, "start": start, "until": a.until, "events": self.events,
                "samples": self.samples, "records": job.tail.records, "final": end,
                "results": job.results(), "starts": self.starts}


# ------------------------------------------------------------------------------ the run


def run(a: argparse.Namespace) -> dict[str, Any]:
    """The network (the nodes and the outsider's namespace), the run without faults, then the
    soak; torn down after. BenchError when something crashed."""
    started, prefix = time.perf_counter(), f"{PREFIX}{os.getpid()}"
    run_dir, cleanup = nd.begin_run(prefix)
    ok, runs = False, dict[str, dict[str, Any]]()
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {k: v for k, v in vars(a).items() if k not in ("out", "replot", "outsider")},
        "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()),
        "decent_source": nd.decent_source()}
    try:
        with nd.signals_raise(), Progress(TextColumn("{task.description:>9}"), BarColumn(),
                                          TimeRemainingColumn(), console=console) as progress:
            net = nd.Network(prefix, a.nodes + 1, a.rate, cleanup)
            net.up()
            add_outsider_addresses(net, a.nodes)
            runner = nd.Runner(net, run_dir, cleanup)
            for name, seconds, faults in (("baseline", a.baseline_s, False),
                                          ("soak", a.duration, True)):
                a.until = time.time() + seconds
                runs[name] = Churn(runner, a, name, faults).run(progress)
        res.update(analyze(runs["soak"], runs["baseline"], a))
        res["series"] = {k: series(r) for k, r in runs.items()}
        ok = True
    finally:
        left = nd.tear_down(cleanup, run_dir, ok and not a.keep_logs)
    res["leftover_processes"] = left
    res["leftover_namespaces"] = nd.leftover_namespaces(prefix)
    res["loadavg_end"], res["total_s"] = list(os.getloadavg()), time.perf_counter() - started
    return res


OPTIONS: list[cli.Option] = [
    ("nodes", int, 8, "namespaces, one daemon and worker each"),
    ("duration", float, 600.0, "seconds of churn"),
    ("baseline-s", float, 180.0, "seconds of the run without faults"),
    ("fault-min-s", float, 15.0, "shortest gap between faults"),
    ("fault-max-s", float, 30.0, "longest gap between faults"),
    ("sample-s", float, 2.0, "seconds between samples of the daemons"),
    *cli.training_options("faults, data, model", 30.0),
    ("out", Path, RESULTS, "where soak.json, .md and .png go")]


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = cli.parser_of(__doc__, OPTIONS)
    p.add_argument("--faults", type=lambda v: v.split(","), default=list(FAULTS),
                   help=f"the kinds of fault, comma-separated ({','.join(FAULTS)})")
    p.add_argument("--keep-logs", action="store_true", help="keep the run directory")
    p.add_argument("--replot", action="store_true",
                   help="redraw --out/soak.png and .md from --out/soak.json and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the soak (exit 0 when it completes, 1 when it crashes), or redraw its report."""
    from benchmarks import soak_report

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--outsider"]:
        return outsider_main(argv[1:])
    a = build_parser().parse_args(argv)
    if not a.replot:
        reason = nd.skip_reason()
        if reason:
            print(reason)
            return 0
        # the workers' settings chaos's job reads (no step limit: they stop at the deadline)
        a.steps, a.snapshot_every, a.snapshots, a.gloo_timeout = 10**9, 10**9, False, 60.0
        try:
            res = run(a)
        except nd.BenchError as exc:
            print(f"failed: {exc}", file=sys.stderr)
            return 1
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "soak.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    res = json.loads((a.out / "soak.json").read_text())
    load = a.out / "soak_load.json"  # make soak's load run, when it ran first
    if load.exists():
        res["load"] = json.loads(load.read_text())
    (a.out / "soak.md").write_text(soak_report.markdown(res))
    soak_report.write_png(res, a.out / "soak.png")
    console.print(soak_report.markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
