"""What security costs: a 64 MiB ``neighbor_allreduce_`` between 2 daemons in every mode, one run.

::

    .venv/bin/python benchmarks/security_cost.py [--repeats 160] [--warmup 3] [--mbytes 64]
        [--json benchmarks/results/security_cost.json] [--png benchmarks/results/security_cost.png]

Four clusters of 2 daemons on loopback (ring topology: each rank averages with the other), one
per mode, all started before anything is timed and kept up to the end:

* ``insecure``: ``--security-mode insecure`` (no proof of anything);
* ``secret``: ``--security-mode secret --secret-file F`` (challenge-response handshakes, bulk
  HELLOs prove a session key; the bulk data in clear);
* ``mtls-clear``: ``--security-mode mtls --no-encrypt-bulk`` (gRPC over TLS 1.3 with client
  certificates; bulk in clear, its HELLO bound by a key handed over TLS);
* ``mtls-tls``: ``--security-mode mtls --encrypt-bulk`` (the bulk connections over TLS too).

Two worker processes (ranks 0 and 1) each connect to their daemon of every cluster and hold one
float32 tensor per mode in torch shared memory (``share_memory_()``: registered with the daemon
at the first call, never copied after), filled with ``(arange % 1024) + rank + 1`` so that the
average ``(arange % 1024) + 1.5`` is exact; every result is compared with ``torch.equal`` and
the tensor refilled, untimed.

Method (same host conditions for every mode): the calls are interleaved in rounds, one call per
mode and round, in orders from a Williams square (``--repeats`` a multiple of 4: every mode in
every position, and right after every other mode, equally often; with a plain rotation the
cheapest mode would always follow the most expensive one); ``--warmup`` untimed rounds first. Before
each call both workers meet at a barrier; each times its call from the barrier's exit to its
return, and the call's time is the slower rank's. Reported per mode: the median (p10-p90) and
throughput (tensor bytes / median); ratios are medians over insecure's median, and as a check
the median of the per-round ratios (each call over insecure's call of the same round). The
daemons' CPU per call (both daemons, from /proc, rank 0 reads it around each call) shows where
a difference goes.

Targets: secret / insecure and mtls-clear / insecure at most 1.05 (authentication without bulk
encryption costs at most 5%); mtls-tls / insecure is reported (no target). Exit code 0 when the
targets are met, 3 when one is missed, 1 on a failure or a wrong result.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/security_cost.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.hostprobe import memmove_ms  # noqa: E402
from benchmarks.netns_dsgd import (  # noqa: E402
    BenchError,
    console,
    cpu_fractions,
    decent_source,
    proc_cpu_seconds,
    signals_raise,
    system_cpu,
    tail,
    write_json,
)
from decentd.security.auth import write_secret  # noqa: E402
from decentd.security.certs import write_cluster  # noqa: E402
from decentd.tools.launcher import free_ports, stop_processes  # noqa: E402

MODES = ("insecure", "secret", "mtls-clear", "mtls-tls")
LABELS = {"insecure": "insecure", "secret": "secret (HMAC handshakes, bulk in clear)",
          "mtls-clear": "mtls, bulk in clear (--no-encrypt-bulk)",
          "mtls-tls": "mtls, bulk over TLS (--encrypt-bulk)"}
#: how each mode's daemons describe themselves at start (their log: proof of what ran)
LOGGED = {"insecure": "insecure", "secret": "secret, bulk in clear",
          "mtls-clear": "mtls, bulk in clear", "mtls-tls": "mtls, bulk over TLS"}
#: ratio key -> (mode, target: at most this over insecure; None: reported only)
RATIOS: dict[str, tuple[str, float | None]] = {
    "secret_over_insecure": ("secret", 1.05),
    "mtls_clear_over_insecure": ("mtls-clear", 1.05),
    "mtls_tls_over_insecure": ("mtls-tls", None)}
DEFAULT_JSON = REPO / "benchmarks" / "results" / "security_cost.json"
METHOD = ("4 clusters of 2 daemons up at once; calls interleaved in rounds, one per mode and "
          "round, the orders from a Williams square (every mode in every position and after "
          "every other mode equally often); a barrier before each call, a call's time is the "
          "slower rank's")


def mode_flags(mode: str, rank: int, secret: Path, pki: Path) -> list[str]:
    """The daemon flags of ``mode`` for ``rank``."""
    if mode == "insecure":
        return ["--security-mode", "insecure"]
    if mode == "secret":
        return ["--security-mode", "secret", "--secret-file", str(secret)]
    return ["--security-mode", "mtls", "--ca", str(pki / "ca.crt"),
            "--cert", str(pki / f"node-{rank}.crt"), "--key", str(pki / f"node-{rank}.key"),
            "--encrypt-bulk" if mode == "mtls-tls" else "--no-encrypt-bulk"]


def order(rnd: int) -> list[str]:
    """The modes in round ``rnd``: rows of a Williams square (0 1 3 2, then + 1 mod 4 per
    round), so that over 4 rounds every mode takes every position once and follows every
    other mode once: a call right after mtls-tls's (the heaviest) is no mode's lot alone."""
    n = len(MODES)
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    return [MODES[(i + rnd) % n] for i in first]


def stats(values: Sequence[float]) -> dict[str, float]:
    """median, p10, p90, min, mean of ``values``."""
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"median": statistics.median(s), "p10": q(0.1), "p90": q(0.9), "min": s[0],
            "mean": statistics.fmean(s)}


# ------------------------------------------------------------------------------ workers


def worker_main(rank: int, cfg: dict[str, Any], barrier: Any, out: Any) -> None:
    """One worker: a client and a shared-memory tensor per mode, the rounds of calls."""
    try:
        out.put(("result", rank, _worker(rank, cfg, barrier, out)))
    except BaseException:  # the driver reports it and stops everything
        out.put(("error", rank, traceback.format_exc()))
        barrier.abort()


def _worker(rank: int, cfg: dict[str, Any], barrier: Any, out: Any) -> dict[str, Any]:
    import torch

    import decent.torch as dt

    torch.set_num_threads(1)
    n = cfg["nbytes"] // 4
    base = torch.arange(n, dtype=torch.int64).remainder_(1024).to(torch.float32)
    src, expected = base + (rank + 1), base + 1.5
    clients = {m: dt.connect(f"unix://{cfg['sockets'][m][rank]}", 60, job="security-cost",
                             local_rank=0) for m in MODES}
    tensors = {m: src.clone().share_memory_() for m in MODES}
    pids = cfg["daemon_pids"]
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, float] = dict.fromkeys(MODES, 0.0)
    errors: list[str] = []
    warm = cfg["warmup"]
    for rnd in range(warm + cfg["repeats"]):
        for m in order(rnd):
            t = tensors[m]
            c0 = sum(proc_cpu_seconds(p) for p in pids[m]) if rank == 0 else 0.0
            barrier.wait()
            t0 = time.perf_counter()
            clients[m].neighbor_allreduce_(t, name="security_cost")
            dt_s = time.perf_counter() - t0
            if not torch.equal(t, expected):
                bad = int((t != expected).sum())
                errors.append(f"{m} rank {rank} round {rnd}: {bad} of {n} values wrong "
                              f"({float(t.min())}..{float(t.max())})")
            t.copy_(src)
            if rnd >= warm:
                times[m].append(dt_s)
                if rank == 0:
                    cpu[m] += sum(proc_cpu_seconds(p) for p in pids[m]) - c0
            if rank == 0:
                out.put(("call", m, rnd >= warm, dt_s))
    barrier.wait()
    for c in clients.values():
        c.close()
    return {"times": times, "daemon_cpu_s": cpu, "errors": errors}


# ------------------------------------------------------------------------------ driver


class Clusters:
    """The four 2-daemon clusters on loopback, one per mode, in ``run_dir``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[str, list[subprocess.Popen[bytes]]] = {}
        self.sockets: dict[str, list[str]] = {}

    def start(self) -> None:
        """Secret, certificates, 8 daemons; wait for every worker socket."""
        secret = write_secret(self.run_dir / "secret")
        pki = self.run_dir / "pki"
        write_cluster(pki, 2, "decent", None, None, 2, False)
        ports = free_ports(2 * len(MODES))  # at once: no two clusters get the same port
        for k, mode in enumerate(MODES):
            peers = ",".join(f"127.0.0.1:{p}" for p in ports[2 * k:2 * k + 2])
            self.sockets[mode] = [str(self.run_dir / f"{mode}-{i}.sock") for i in (0, 1)]
            self.procs[mode] = []
            for i in (0, 1):
                with (self.run_dir / f"{mode}-{i}.log").open("ab") as log:
                    self.procs[mode].append(subprocess.Popen(
                        [sys.executable, "-m", "decentd", "--rank", str(i), "--peers",
                         peers, "--socket", self.sockets[mode][i], "--topology", "ring",
                         "--cluster-id", "decent", "--log-level", "info",
                         "--set", "timeouts.start=90", *mode_flags(mode, i, secret, pki)],
                        stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 90
        while not all(Path(s).exists() for socks in self.sockets.values() for s in socks):
            self.check()
            if time.monotonic() > deadline:
                raise BenchError("daemons not up after 90 s\n" + self.tails())
            time.sleep(0.1)

    def check(self) -> None:
        """Raise when a daemon has exited."""
        died = {f"{m}-{i}": p.returncode for m, ps in self.procs.items()
                for i, p in enumerate(ps) if p.poll() is not None}
        if died:
            raise BenchError(f"daemon exited: {died}\n" + self.tails())

    def pids(self) -> dict[str, list[int]]:
        """Daemon pids per mode."""
        return {m: [p.pid for p in ps] for m, ps in self.procs.items()}

    def tails(self, lines: int = 8) -> str:
        """The end of every daemon's log."""
        return "\n".join(f"--- {p.stem}:\n{tail(p, lines)}"
                         for p in sorted(self.run_dir.glob("*.log")))

    def security_lines(self) -> dict[str, list[str]]:
        """Per mode, what each daemon logged about its security at start."""
        out: dict[str, list[str]] = {}
        for m in MODES:
            for i in (0, 1):
                text = (self.run_dir / f"{m}-{i}.log").read_text(errors="replace")
                found = [ln.split("security: ", 1)[1].rstrip(")") for ln in text.splitlines()
                         if "security: " in ln]
                out.setdefault(m, []).append(found[0] if found else "not logged")
        return out

    def stop(self) -> dict[str, int | None]:
        """Stop every daemon; their exit codes."""
        stop_processes([p for ps in self.procs.values() for p in ps])
        return {f"{m}-{i}": p.returncode for m, ps in self.procs.items() for i, p in enumerate(ps)}


def drive(a: argparse.Namespace, clusters: Clusters) -> dict[str, Any]:
    """Start the two workers, show progress, collect their results."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    cfg = {"nbytes": a.nbytes, "warmup": a.warmup, "repeats": a.repeats,
           "sockets": clusters.sockets, "daemon_pids": clusters.pids()}
    workers = [ctx.Process(target=worker_main, args=(r, cfg, barrier, out), daemon=True)
               for r in (0, 1)]
    for w in workers:
        w.start()
    results: dict[int, dict[str, Any]] = {}
    seen: dict[str, list[float]] = {m: [] for m in MODES}
    deadline = time.monotonic() + 120 + 4 * (a.warmup + a.repeats) * 5.0
    try:
        with Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            tasks = {m: progress.add_task(f"{m:<10} warm-up", total=a.warmup + a.repeats)
                     for m in MODES}
            while len(results) < 2:
                if time.monotonic() > deadline:
                    raise BenchError("workers did not finish in time\n" + clusters.tails())
                try:
                    msg = out.get(timeout=1.0)
                except queue.Empty:
                    clusters.check()
                    dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                    if dead:
                        raise BenchError(f"a worker died (exit {dead})") from None
                    continue
                if msg[0] == "error":
                    raise BenchError(f"worker {msg[1]} failed:\n{msg[2]}\n" + clusters.tails())
                if msg[0] == "result":
                    results[msg[1]] = msg[2]
                    continue
                _, m, timed, secs = msg
                if timed:
                    seen[m].append(secs)
                text = (f"median {statistics.median(seen[m]) * 1e3:6.1f} ms" if seen[m]
                        else "warm-up")
                progress.update(tasks[m], advance=1, description=f"{m:<10} {text}")
    finally:
        for w in workers:
            w.join(timeout=20)
            if w.is_alive():
                w.kill()
                w.join()
    return {"ranks": [results[0], results[1]]}


def summarize(a: argparse.Namespace, ranks: list[dict[str, Any]],
              logged: dict[str, list[str]]) -> dict[str, Any]:
    """Per mode: the slower rank's time per call, its statistics, GB/s, daemon CPU, what its
    daemons said they run (a mode whose daemons did not say so counts as wrong); ratios."""
    modes: dict[str, Any] = {}
    for m in MODES:
        per_call = [max(x) for x in zip(*(r["times"][m] for r in ranks), strict=True)]
        st = stats(per_call)
        errs = [e for r in ranks for e in r["errors"] if e.startswith(m + " ")]
        errs += [f"{m} daemon {i} logged 'security: {line}', not '{LOGGED[m]}'"
                 for i, line in enumerate(logged[m]) if not line.startswith(LOGGED[m])]
        modes[m] = {"label": LABELS[m], **{f"{k}_s": v for k, v in st.items()},
                    "gbps": a.nbytes / st["median"] / 1e9, "per_call_s": per_call,
                    "daemon_cpu_ms_per_call": ranks[0]["daemon_cpu_s"][m] / a.repeats * 1e3,
                    "daemons_logged": logged[m],
                    "correct": not errs, "errors": errs[:10]}
    base = modes["insecure"]
    ratios = {}
    for key, (m, target) in RATIOS.items():
        value = modes[m]["median_s"] / base["median_s"]
        paired = [x / y for x, y in zip(modes[m]["per_call_s"], base["per_call_s"], strict=True)]
        ps = stats(paired)
        ratios[key] = {"mode": m, "value": value, "target": target,
                       "met": None if target is None else value <= target,
                       "paired_median": ps["median"], "paired_p10": ps["p10"],
                       "paired_p90": ps["p90"]}
    return {"modes": modes, "ratios": ratios,
            "correct": all(v["correct"] for v in modes.values()),
            "meets_targets": all(r["met"] for r in ratios.values() if r["met"] is not None)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    """The four clusters, the workers, the summary; everything stopped and removed after."""
    started = time.perf_counter()
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "benchmarks/security_cost.py", *sys.argv[1:]]),
        "nbytes": a.nbytes, "repeats": a.repeats, "warmup": a.warmup, "modes_order": MODES,
        "method": METHOD, "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()),
        "memmove_64mib_ms": memmove_ms(), "decent_source": decent_source()}
    run_dir = Path(tempfile.mkdtemp(prefix="decent-seccost-"))
    clusters = Clusters(run_dir)
    try:
        with signals_raise():
            console.print(f"starting 4 x 2 daemons ({', '.join(MODES)}) in {run_dir}")
            clusters.start()
            cpu0 = system_cpu()
            out = drive(a, clusters)
            res["busy_frac"], res["irq_frac"], res["steal_frac"] = cpu_fractions(cpu0,
                                                                                 system_cpu())
            res.update(summarize(a, out["ranks"], clusters.security_lines()))
    finally:
        res["daemon_exit_codes"] = clusters.stop()
        if "modes" in res:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            res["run_dir"] = str(run_dir)  # kept: the daemons' logs say what failed
    res["loadavg_end"] = list(os.getloadavg())
    res["total_s"] = time.perf_counter() - started
    return res


# ------------------------------------------------------------------------------ output


def print_report(res: dict[str, Any]) -> None:
    """Rich table of the modes and the ratios against their targets."""
    from rich.console import Console
    from rich.table import Table

    out = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    t = Table(title=f"{res['nbytes'] >> 20} MiB neighbor_allreduce_ between 2 daemons on "
                    f"loopback, share_memory_() tensors, {res['repeats']} calls per mode "
                    "(interleaved)")
    for col in ("mode", "median ms", "p10-p90", "GB/s", "/insecure", "per-round",
                "daemon CPU ms", "exact"):
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    ratios = {r["mode"]: r for r in res["ratios"].values()}
    for m in MODES:
        s, r = res["modes"][m], ratios.get(m)
        t.add_row(m, f"{s['median_s'] * 1e3:.1f}",
                  f"{s['p10_s'] * 1e3:.1f}-{s['p90_s'] * 1e3:.1f}", f"{s['gbps']:.2f}",
                  f"{r['value']:.3f}x" if r else "1", f"{r['paired_median']:.3f}x" if r else "1",
                  f"{s['daemon_cpu_ms_per_call']:.0f}",
                  "yes" if s["correct"] else "[red]NO[/]")
    out.print(t)
    for key, r in res["ratios"].items():
        verdict = ("(reported)" if r["met"] is None else "[green]met[/]" if r["met"]
                   else "[red]missed[/]")
        target = f"target <= {r['target']:.2f}x" if r["target"] is not None else "no target"
        out.print(f"{key.replace('_over_', ' / ')}: {r['value']:.3f}x ({target}) {verdict}")
    out.print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}; 64 MiB memmove "
                  f"{res['memmove_64mib_ms']:.1f} ms; steal {res['steal_frac']:.0%}; total "
                  f"{res['total_s']:.0f} s")
    for m in MODES:
        for e in res["modes"][m]["errors"]:
            out.print(f"[red]{e}[/]")


def write_png(res: dict[str, Any], path: Path) -> None:
    """Two panels: median (p10-p90) per mode with ratio and GB/s; every timed call in order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    xs = list(range(len(MODES)))
    med = [res["modes"][m]["median_s"] * 1e3 for m in MODES]
    lo = [med[i] - res["modes"][m]["p10_s"] * 1e3 for i, m in enumerate(MODES)]
    hi = [res["modes"][m]["p90_s"] * 1e3 - med[i] for i, m in enumerate(MODES)]
    colors = ["tab:gray", "tab:blue", "tab:green", "tab:red"]
    ax1.bar(xs, med, color=colors, yerr=[lo, hi], capsize=4)
    for x, m in zip(xs, MODES, strict=True):
        s = res["modes"][m]
        ax1.annotate(f"{s['median_s'] / res['modes']['insecure']['median_s']:.3f}x\n"
                     f"{s['gbps']:.2f} GB/s", (x, med[x] + hi[x]), ha="center", va="bottom",
                     fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax1.set_xticks(xs, [LABELS[m].replace(" (", "\n(").replace(", ", ",\n") for m in MODES],
                   fontsize=7)
    ax1.set_ylabel("ms per call (median, p10-p90; slower rank)")
    ax1.set_ylim(0, max(m + h for m, h in zip(med, hi, strict=True)) * 1.3)
    ax1.set_title(f"{res['nbytes'] >> 20} MiB neighbor_allreduce_, 2 daemons, ratio to insecure",
                  fontsize=9)
    for m, c in zip(MODES, colors, strict=True):
        ax2.plot([v * 1e3 for v in res["modes"][m]["per_call_s"]], marker=".", color=c,
                 linewidth=0.8, label=m)
    ax2.set_xlabel("round (one call per mode, balanced orders)")
    ax2.set_ylabel("ms per call")
    ax2.set_title(f"every timed call (load {res['loadavg_start'][0]:.2f}, steal "
                  f"{res['steal_frac']:.0%})", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--repeats", type=int, default=160,
                   help="timed calls per mode (rounds); a multiple of 4 puts every mode in "
                   "every position of a round equally often")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--mbytes", type=float, default=64.0, help="tensor size in MiB (float32)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--png", type=Path, help="default: the JSON's path with .png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: exit 0 targets met, 3 a target missed, 1 a failure or a wrong result."""
    a = build_parser().parse_args(argv)
    a.nbytes = int(a.mbytes * (1 << 20)) // 4 * 4
    if a.repeats < 1 or a.warmup < 1 or a.nbytes < 4:
        raise SystemExit("--repeats and --warmup must be >= 1, --mbytes > 0")
    try:
        res = run(a)
    except BenchError as exc:
        console.print(f"[red]failed:[/] {exc}")
        write_json({"error": str(exc).splitlines()[0][:300]}, a.json)
        return 1
    except KeyboardInterrupt:
        console.print("interrupted: daemons and workers stopped")
        return 130
    write_json(res, a.json)
    png = a.png or a.json.with_suffix(".png")
    print_report(res)
    write_png(res, png)
    console.print(f"wrote {a.json} and {png}")
    if not res["correct"]:
        return 1
    return 0 if res["meets_targets"] else 3


if __name__ == "__main__":
    sys.exit(main())
