"""Validates the WAN emulation (``benchmarks/wan``): ping RTT, one TCP flow against the math, CPU.

Needs root (it creates network namespaces)::

    sudo .venv/bin/python benchmarks/wan_link.py [--rtts 10,50,100] [--rates 100mbit,1gbit]
        [--windows 256K,1M,4M,auto] [--seconds 8] [--warm 3] [--pings 20]
        [--json benchmarks/results/wan_link.json] [--md PATH] [--png PATH]
    sudo .venv/bin/python benchmarks/wan_link.py --cleanup   # remove leftovers of a killed run

For every rate and RTT it builds a :class:`benchmarks.wan.link.WanNetwork` of 2 nodes (fresh
namespaces each time) and measures, from node 0 to node 1, with the probes of
:mod:`benchmarks.wan.probes` (run at nice :data:`PROBE_NICE`, the line at ``SCHED_FIFO``, so
that other load on the host delays neither; the CPU it took in the second before each
configuration is reported):

* RTT: ``--pings`` ICMP echoes (a raw socket, one at a time, 20 ms apart) on the idle link; the
  median must be within :data:`RTT_TOLERANCE` of the setting;
* throughput: one TCP flow for ``--seconds``, measured at the receiver after the first
  ``--warm`` seconds, with the receive buffer pinned by ``SO_RCVBUFFORCE`` to each of
  ``--windows`` (``auto``: the kernel's autotuning up to ``tcp_rmem``'s maximum, 64 MiB in the
  nodes), against ``expected = min(rate x MSS / (MTU + 14), W / RTT)``, within
  :data:`FLOW_TOLERANCE`. The first term is tbf's rate in payload bytes: tbf counts each
  1448-byte segment as the 1514 bytes of its frame (Ethernet 14, IP 20, TCP 20, timestamps 12).
  ``W`` is the window the receiver advertised, read as the sender's ``tcpi_snd_wnd`` (median
  over the measured seconds). What Linux (6.6 and later: no ``tcp_adv_win_scale`` any more)
  makes of ``setsockopt(SO_RCVBUF, B)``: ``sk_rcvbuf = 2B`` (the read-back is exactly 2B), and
  the window offered is at most ``sk_rcvbuf x scaling_ratio / 256``, ``scaling_ratio`` learned
  from the received packets' ``len / truesize`` (128 = 1/2 before the first packet, the
  ``tcp_adv_win_scale = 1`` of older kernels). On this path it settles at about 0.66, so
  ``W = 2B x 0.66 = 1.32 B`` (the table's ``W / SO_RCVBUF``); as the ratio depends on the packets
  (driver, GRO, MTU), the expected throughput takes W as advertised rather than from a formula;
* CPU: the delay line's user + system seconds (``/proc/<pid>/stat``; the kernel's forwarding
  work that each of its writes runs included) over the configuration, pings and flows, per GB
  it forwarded (both directions, GSO packets counted whole), and how late its packets left.

Writes ``--json``, a markdown table (``--md``) and a plot of measured against expected
throughput (``--png``). Exit code 0 when every check passes, 3 when one misses, 1 on a failure.
Whatever happens (exceptions, Ctrl-C, SIGTERM), processes started here are stopped and the
namespaces deleted; without root it prints why it skips and exits 0, writing ``{"skipped": ...}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/wan_link.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import (  # noqa: E402
    BenchError,
    Runner,
    Skip,
    begin_run,
    cpu_fractions,
    leftover_namespaces,
    parse_rate,
    signals_raise,
    skip_reason,
    system_cpu,
    tear_down,
    write_json,
)
from benchmarks.netns_dsgd import (  # noqa: E402
    cleanup_leftovers as netns_cleanup_leftovers,
)
from benchmarks.wan.link import WanNetwork  # noqa: E402

PREFIX = "dwan"
PROBES = REPO / "benchmarks" / "wan" / "probes.py"
RESULTS = REPO / "benchmarks" / "results"
#: a configuration's median ping RTT must be this close to its setting (relative)
RTT_TOLERANCE = 0.10
#: a flow's measured throughput must be this close to min(rate, W / RTT) (relative)
FLOW_TOLERANCE = 0.10
#: bytes tbf counts per TCP segment besides its payload: MTU - MSS + the Ethernet header
ETHERNET_HEADER = 14
#: the probes' nice value: the endpoints get a CPU before other load on the host (what is
#: validated is the link, not how a busy host schedules its endpoints)
PROBE_NICE = -10
#: seconds the host's CPU is sampled before each configuration (the other load on it)
BACKGROUND_S = 1.0


# ------------------------------------------------------------------------------ small helpers


def parse_size(text: str) -> int | None:
    """Bytes of a size such as ``256K``, ``4M`` or ``65536`` (powers of 1024); None for auto."""
    if text.strip().lower() == "auto":
        return None
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)i?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r} is not like 256K, 4M or auto")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def size_label(size: int | None) -> str:
    """``256 KiB``, ``4 MiB`` or ``auto``."""
    if size is None:
        return "auto"
    return f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size / 1024:g} KiB"


def expected_bps(rate_bps: float, mss: int, mtu: int, window: float, rtt_s: float) -> float:
    """Payload bits per second of one flow: the smaller of tbf's rate in payload bytes and one
    window per round trip."""
    return min(rate_bps * mss / (mtu + ETHERNET_HEADER), window * 8 / rtt_s)


def within(measured: float, target: float, tolerance: float) -> bool:
    """``measured`` is within ``tolerance`` (relative) of ``target``."""
    return abs(measured - target) <= tolerance * target


# ------------------------------------------------------------------------------ workers


# ------------------------------------------------------------------------------ measurement


def start_worker(runner: Runner, i: int, kind: str,
                 args: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start probe ``kind`` (:mod:`benchmarks.wan.probes`) in node ``i`` (log ``<kind>-<i>.log``,
    JSON ``<kind>-<i>.json`` in the run directory)."""
    out = runner.run_dir / f"{kind}-{i}.json"
    out.unlink(missing_ok=True)
    return runner.spawn(i, f"{kind}-{i}", ["nice", "-n", str(PROBE_NICE), sys.executable,
                                           str(PROBES), kind, "--out", str(out), *args])


def worker_result(runner: Runner, i: int, kind: str) -> dict[str, Any]:
    """The JSON a finished worker wrote."""
    return dict(json.loads((runner.run_dir / f"{kind}-{i}.json").read_text()))


def measure_ping(runner: Runner, pings: int, rtt_ms: float) -> dict[str, Any]:
    """Ping node 1 from node 0 on the idle link; median, range and the verdict."""
    procs = {"ping-0": start_worker(runner, 0, "ping",
                                    ["--host", runner.net.ip(1), "--pings", str(pings)])}
    runner.wait_all(procs, timeout=30 + pings * (2 + rtt_ms / 1e3))
    res = worker_result(runner, 0, "ping")
    rtts = res["rtt_ms"]
    if not rtts:
        raise BenchError(f"no ping answered on the {rtt_ms:g} ms link")
    median = statistics.median(rtts)
    return {"rtt_ms": rtts, "lost": res["lost"], "median_ms": median, "min_ms": min(rtts),
            "max_ms": max(rtts), "error": median / rtt_ms - 1 if rtt_ms else 0.0,
            "ok": res["lost"] == 0 and within(median, rtt_ms, RTT_TOLERANCE)}


def steady(samples: list[dict[str, Any]], begin: float, end: float) -> list[dict[str, Any]]:
    """The samples taken between ``begin`` and ``end``."""
    return [s for s in samples if begin <= s["t"] <= end]


def measure_flow(runner: Runner, rcvbuf: int | None, seconds: float, warm: float,
                 line_cpu: Callable[[], float]) -> dict[str, Any]:
    """One TCP flow node 0 -> node 1 with the receive buffer pinned (or autotuned); the
    throughput after ``warm`` seconds against min(rate, W / RTT), and the line's CPU."""
    net = runner.net
    assert isinstance(net, WanNetwork)
    cpu0, host0 = line_cpu(), system_cpu()
    procs = {"recv-1": start_worker(runner, 1, "recv", ["--rcvbuf", str(rcvbuf or 0)]),
             "send-0": start_worker(runner, 0, "send",
                                    ["--host", net.ip(1), "--seconds", str(seconds)])}
    runner.wait_all(procs, timeout=seconds + 60)
    cpu, (busy, _irq, steal) = line_cpu() - cpu0, cpu_fractions(host0, system_cpu())
    recv, send = worker_result(runner, 1, "recv"), worker_result(runner, 0, "send")
    begin, end = send["start"] + warm, send["start"] + seconds
    got = steady(recv["samples"], begin, end)
    sent = steady(send["samples"], begin, end)
    if len(got) < 2 or not sent:
        raise BenchError(f"too few samples in the measured {seconds - warm:g} s")
    measured = (got[-1]["bytes"] - got[0]["bytes"]) * 8 / (got[-1]["t"] - got[0]["t"])
    low = statistics.median_low  # of integer series: an integer
    window = low(s["snd_wnd"] for s in sent)
    mss = sent[-1]["snd_mss"]
    rate, rtt_s = parse_rate(net.rate), net.rtt_ms / 1e3
    expected = expected_bps(rate, mss, net.mtu, window, rtt_s)
    rcv_wnd = [s["rcv_wnd"] for s in got if "rcv_wnd" in s]
    return {
        "so_rcvbuf": rcvbuf, "window": size_label(rcvbuf), "rcvbuf_read_back": recv["rcvbuf"],
        "advertised_window": window, "rcv_wnd": low(rcv_wnd) if rcv_wnd else None,
        "window_over_so_rcvbuf": window / rcvbuf if rcvbuf else None,
        "rcv_ssthresh": low(s["rcv_ssthresh"] for s in got if "rcv_ssthresh" in s),
        "mss": mss, "srtt_ms": statistics.median(s["rtt_us"] for s in sent) / 1e3,
        "min_rtt_ms": sent[-1]["min_rtt_us"] / 1e3, "cwnd": low(s["snd_cwnd"] for s in sent),
        "retransmits": send["samples"][-1]["total_retrans"],
        # bytes in flight against the window, and the share of the sender's busy time that the
        # window held it back (the rest: cwnd, TSO deferral, a sender waiting for a CPU)
        "inflight_over_window": statistics.median(s["unacked"] for s in sent) * mss / window,
        "rwnd_limited_frac": (sent[-1]["rwnd_limited_us"] - sent[0]["rwnd_limited_us"])
        / max(sent[-1]["busy_us"] - sent[0]["busy_us"], 1),
        "window_limited": window * 8 / rtt_s < rate * mss / (net.mtu + ETHERNET_HEADER),
        "measured_bps": measured, "expected_bps": expected, "ratio": measured / expected,
        "ok": within(measured, expected, FLOW_TOLERANCE), "bytes": recv["bytes"],
        "line_cpu_s": cpu, "host_busy": busy, "host_steal": steal}


def measure_config(runner: Runner, a: argparse.Namespace,
                   step: Callable[[str], None]) -> dict[str, Any]:
    """Ping, then one flow per window, on one network; then the line's counters and CPU."""
    net = runner.net
    assert isinstance(net, WanNetwork)
    label = f"{net.rate} {net.rtt_ms:g} ms"
    step(f"{label}: ping")
    out: dict[str, Any] = {"rate": net.rate, "rtt_ms": net.rtt_ms,
                           "ping": measure_ping(runner, a.pings, net.rtt_ms), "flows": []}
    for w in a.windows:
        step(f"{label}: flow, window {size_label(w)}")
        out["flows"].append(measure_flow(runner, w, a.seconds, a.warm, net.line_cpu_seconds))
    cpu = net.line_cpu_seconds()
    assert net.line is not None
    out["line"] = {**net.stop_line(), "cpu_s": cpu, "pid": net.line.pid}
    out["line"]["cpu_s_per_gb"] = cpu / (out["line"]["tx_bytes"] / 1e9)
    return out


def run(a: argparse.Namespace, step: Callable[[str], None]) -> dict[str, Any]:
    """Every configuration on fresh namespaces, torn down after each; the result dict (or
    ``{"skipped": reason}``)."""
    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    started = time.perf_counter()
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nodes": 2, "rates": a.rates, "rtts_ms": a.rtts, "windows": [size_label(w) for w in
                                                                    a.windows],
        "seconds": a.seconds, "warm": a.warm, "pings": a.pings, "cpus": os.cpu_count(),
        "kernel": os.uname().release, "loadavg_start": list(os.getloadavg()),
        "rtt_tolerance": RTT_TOLERANCE, "flow_tolerance": FLOW_TOLERANCE, "configs": [],
        "leftover_processes": [], "leftover_namespaces": []}
    prefix = res["prefix"] = f"{PREFIX}{os.getpid()}"
    for rate in a.rates:
        for rtt in a.rtts:
            before = system_cpu()
            time.sleep(BACKGROUND_S)
            background = cpu_fractions(before, system_cpu())
            run_dir, cleanup = begin_run(prefix)
            ok = False
            try:
                with signals_raise():
                    net = WanNetwork(prefix, 2, rate, cleanup, rtt_ms=rtt, mtu=a.mtu)
                    step(f"{rate} {rtt:g} ms: namespaces and delay line")
                    try:
                        net.up()
                    except Skip as exc:
                        res["skipped"], ok = str(exc), True
                        return res
                    config = measure_config(Runner(net, run_dir, cleanup), a, step)
                    config["background_busy"], config["background_steal"] = (
                        background[0], background[2])
                    config["tbf"] = {"burst_bytes": net.burst, "limit_bytes": net.limit,
                                     "flow_steering": net.steered}
                    res["configs"].append(config)
                    ok = True
            finally:
                res["leftover_processes"] += tear_down(cleanup, run_dir, ok)
                res["leftover_namespaces"] += leftover_namespaces(prefix)
    res["loadavg_end"] = list(os.getloadavg())
    res["ok"] = all(c["ping"]["ok"] and all(f["ok"] for f in c["flows"]) for c in res["configs"])
    res["total_s"] = time.perf_counter() - started
    return res


def cleanup_leftovers() -> list[str]:
    """Delete ``dwan*`` namespaces and run directories whose run is no longer alive."""
    return netns_cleanup_leftovers(PREFIX, Path(__file__).name)


# ------------------------------------------------------------------------------ output


def mbit(bps: float) -> str:
    """Bits per second as Mbit/s."""
    return f"{bps / 1e6:.1f}"


def markdown(res: dict[str, Any]) -> str:
    """The three tables: RTT, throughput against the math, the line's CPU."""
    lines = [f"WAN emulation check ({res['date']}, kernel {res['kernel']}, {res['cpus']} CPUs; "
             f"{res['pings']} pings, flows of {res['seconds']:g} s measured after "
             f"{res['warm']:g} s)", "",
             "| rate | RTT set | ping median | min / max | error | | other load (CPU busy "
             "before) |", "|:--|--:|--:|--:|--:|:--|--:|"]
    for c in res["configs"]:
        p = c["ping"]
        lines.append(f"| {c['rate']} | {c['rtt_ms']:g} ms | {p['median_ms']:.2f} ms | "
                     f"{p['min_ms']:.2f} / {p['max_ms']:.2f} | {p['error'] * 100:+.1f}% | "
                     f"{'PASS' if p['ok'] else 'MISS'} | {c['background_busy'] * 100:.0f}% |")
    lines += ["", "| rate | RTT | SO_RCVBUF | read back | advertised W | W / SO_RCVBUF | TCP srtt "
              "| expected Mbit/s | measured Mbit/s | measured / expected | |",
              "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|:--|"]
    for c in res["configs"]:
        for f in c["flows"]:
            ratio = f"{f['window_over_so_rcvbuf']:.2f}" if f["window_over_so_rcvbuf"] else "-"
            bound = "W / RTT" if f["window_limited"] else "rate"
            lines.append(
                f"| {c['rate']} | {c['rtt_ms']:g} ms | {f['window']} | "
                f"{f['rcvbuf_read_back'] if f['so_rcvbuf'] else '-'} | "
                f"{f['advertised_window']} | {ratio} | {f['srtt_ms']:.1f} ms | "
                f"{mbit(f['expected_bps'])} ({bound}) | {mbit(f['measured_bps'])} | "
                f"{f['ratio']:.3f} | {'PASS' if f['ok'] else 'MISS'} |")
    lines += ["", "| rate | RTT | line CPU s | GB forwarded | CPU s per GB | packets | mean "
              "packet | CPU us per packet | late mean / max | dropped |",
              "|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for c in res["configs"]:
        ln = c["line"]
        pkts = max(ln["tx_packets"], 1)
        lines.append(f"| {c['rate']} | {c['rtt_ms']:g} ms | {ln['cpu_s']:.2f} | "
                     f"{ln['tx_bytes'] / 1e9:.2f} | {ln['cpu_s_per_gb']:.2f} | "
                     f"{ln['tx_packets']} | {ln['tx_bytes'] / pkts:.0f} B | "
                     f"{ln['cpu_s'] / pkts * 1e6:.0f} | {ln['late_mean_us']:.0f} / "
                     f"{ln['late_max_us'] / 1e3:.1f} ms | {ln['dropped_packets']} |")
    return "\n".join(lines) + "\n"


def write_png(res: dict[str, Any], path: Path) -> None:
    """Two panels: median ping RTT against its setting, and each flow's measured throughput
    against min(rate, W / RTT), both with the tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rtt_ax, ax) = plt.subplots(1, 2, figsize=(11, 4.8),
                                     gridspec_kw={"width_ratios": [1, 1.4]})
    markers = dict(zip(res["rates"], "os^Dv", strict=False))
    colors = {t: f"C{k}" for k, t in enumerate(res["rtts_ms"])}

    def band(axis: Any, lo: float, hi: float, tolerance: float, label: str) -> None:
        axis.plot([lo, hi], [lo, hi], "k-", lw=0.8, label=label)
        axis.fill_between([lo, hi], [lo * (1 - tolerance), hi * (1 - tolerance)],
                          [lo * (1 + tolerance), hi * (1 + tolerance)], color="0.88",
                          label=f"±{tolerance * 100:.0f}%", zorder=0)

    for c in res["configs"]:
        color = colors[c["rtt_ms"]]
        # the first rate's points filled, the others' hollow and larger: they overlap
        first = c["rate"] == res["rates"][0]
        style = {"marker": markers[c["rate"]], "s": 30 if first else 90, "zorder": 3,
                 "edgecolors": color, "facecolors": color if first else "none"}
        rtt_ax.scatter([c["rtt_ms"]], [c["ping"]["median_ms"]], **style, label=c["rate"]
                       if c["rtt_ms"] == res["rtts_ms"][0] else None)
        ax.scatter([f["expected_bps"] / 1e6 for f in c["flows"]],
                   [f["measured_bps"] / 1e6 for f in c["flows"]], **style,
                   label=f"{c['rate']}, RTT {c['rtt_ms']:g} ms")
    rtts = [c["rtt_ms"] for c in res["configs"]]
    band(rtt_ax, min(rtts) / 1.3, max(rtts) * 1.3, RTT_TOLERANCE, "measured = setting")
    flows = [f["expected_bps"] / 1e6 for c in res["configs"] for f in c["flows"]]
    band(ax, min(flows) / 1.5, max(flows) * 1.5, FLOW_TOLERANCE, "measured = min(rate, W / RTT)")
    for axis in (rtt_ax, ax):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.legend(fontsize=7, loc="upper left")
    rtt_ax.set_xlabel("RTT set (ms)")
    rtt_ax.set_ylabel(f"median of {res['pings']} pings (ms)")
    rtt_ax.set_title("round trip")
    ax.set_xlabel("expected Mbit/s: min(rate x MSS / 1514, W / RTT)")
    ax.set_ylabel("measured Mbit/s (one TCP flow)")
    ax.set_title("one TCP flow against the window math")
    fig.suptitle(f"WAN emulation (delay line + tbf), {res['date'][:10]}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(res: dict[str, Any]) -> None:
    """The markdown tables on the terminal, through rich."""
    from rich.console import Console
    from rich.markdown import Markdown

    Console().print(Markdown(markdown(res)))


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",") if x.strip()]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rtts", type=floats, default=[10.0, 50.0, 100.0], help="RTTs in ms")
    p.add_argument("--rates", type=lambda t: t.split(","), default=["100mbit", "1gbit"],
                   help="tc tbf rates per link and direction")
    p.add_argument("--windows", type=lambda t: [parse_size(x) for x in t.split(",")],
                   default=[256 << 10, 1 << 20, 4 << 20, None],
                   help="SO_RCVBUF values pinned at the receiver (auto: autotuning)")
    p.add_argument("--seconds", type=float, default=8.0, help="each flow's duration")
    p.add_argument("--warm", type=float, default=3.0,
                   help="seconds of each flow left out of the measurement (slow start)")
    p.add_argument("--pings", type=int, default=20)
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--json", type=Path, default=RESULTS / "wan_link.json")
    p.add_argument("--md", type=Path, default=RESULTS / "wan_link.md")
    p.add_argument("--png", type=Path, default=RESULTS / "wan_link.png")
    p.add_argument("--cleanup", action="store_true",
                   help=f"delete leftover namespaces named {PREFIX}* from earlier runs and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the validation (or the cleanup)."""
    a = build_parser().parse_args(argv)
    if a.cleanup:
        reason = skip_reason()
        removed = [] if reason else cleanup_leftovers()
        print(reason or f"removed {len(removed)} leftover namespace(s)/run dir(s): "
              f"{' '.join(removed) or '-'}")
        return 0
    if not 0 <= a.warm < a.seconds:
        raise SystemExit("--warm must be >= 0 and below --seconds")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    total = len(a.rates) * len(a.rtts) * (2 + len(a.windows))
    try:
        with Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=Console(stderr=True)) as prog:
            task = prog.add_task("starting", total=total)
            res = run(a, lambda msg: prog.update(task, description=msg, advance=1))
    except BenchError as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: processes stopped and namespaces deleted", file=sys.stderr)
        return 130
    write_json(res, a.json)
    if "skipped" in res:
        print(res["skipped"])
        return 0
    a.md.parent.mkdir(parents=True, exist_ok=True)
    a.md.write_text(markdown(res))
    print_report(res)
    write_png(res, a.png)
    print(f"wrote {a.json}, {a.md} and {a.png}", file=sys.stderr)
    return 0 if res["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
