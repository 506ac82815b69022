"""One large transfer across a long fat link: one TCP flow against a striped link (issue 44,
point 2). Needs root::

    sudo .venv/bin/python benchmarks/wan_stripes.py            # make wan-stripes
        [--rate 1gbit] [--rtt 100] [--mbytes 64] [--repeats 8] [--stripes 1,auto]
        [--buffers default,raised] [--json PATH] [--md PATH] [--png PATH]

Two nodes of :mod:`benchmarks.wan` (a true RTT: every packet is held RTT/2 each way), one
``decentd`` each. For each socket buffer setting and each ``transport.stripes`` value, fresh
daemons start, and both ranks time ``--repeats`` ``neighbor_allreduce_`` calls of ``--mbytes``
MiB over the link, one second apart (both directions carry a tensor at once). The first call
runs on a link that has carried nothing yet; the others after a second of idle, which the
kernel's ``tcp_slow_start_after_idle`` (on by default) treats as a fresh start too.

Buffer settings: ``default`` is the kernel's own maxima (``tcp_rmem`` 6 MiB, ``tcp_wmem``
4 MiB: one flow keeps about 2 MiB in flight, 20 MB/s at 100 ms); ``raised`` is 64 MiB, what a
tuned host has. Reported per case: seconds per call (the first, and the median of the rest),
the fraction of the link rate, ``(bytes x 8 / rate) / seconds`` (the call's latency counted
against it), and the connections each daemon opened and the round trip it measured (its
status). The target: at least 80% with the default buffers (:data:`TARGET`).
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/wan_stripes.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import (  # noqa: E402
    PREFIX,
    Runner,
    begin_run,
    parse_rate,
    skip_reason,
    tear_down,
)
from benchmarks.wan.link import WanNetwork, sysctl  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DECENT_PORT = 7730
#: the socket buffer maxima of each setting: (tcp_rmem, tcp_wmem) lines
BUFFERS = {"default": ("4096 131072 6291456", "4096 16384 4194304"),
           "raised": ("4096 131072 67108864", "4096 16384 67108864")}
#: the fraction of the link rate a striped link reaches with the default buffers (issue 44)
TARGET = 0.80


def run_case(a: argparse.Namespace, buffers: str, stripes: str) -> dict[str, Any]:
    """Fresh namespaces and daemons with ``buffers`` and ``stripes``; both ranks' timings."""
    prefix = f"{PREFIX}{os.getpid()}"
    run_dir, cleanup = begin_run(prefix)
    ok = False
    try:
        net = WanNetwork(prefix, 2, a.rate, cleanup, rtt_ms=a.rtt)
        net.up()
        rmem, wmem = BUFFERS[buffers]
        for ns in net.ns:
            sysctl(ns, f"net.ipv4.tcp_rmem={rmem}", f"net.ipv4.tcp_wmem={wmem}")
        runner = Runner(net, run_dir, cleanup)
        arena = max(256 << 20, 4 * a.mbytes << 20)
        daemons = runner.start_daemons(
            DECENT_PORT, "wan-stripes",
            "log_level: warning\nsecurity: {mode: insecure}\n"
            f"memory: {{arena_bytes: {arena}}}\ntransport: {{stripes: {stripes}}}\n")
        ranks = {f"rank-{i}": runner.spawn(i, f"rank-{i}", [
            sys.executable, str(Path(__file__).resolve()), "--rank-of", "case",
            "--out", str(run_dir / f"rank-{i}.json"), "--mbytes", str(a.mbytes),
            "--repeats", str(a.repeats)], {"DECENT_DAEMON": str(run_dir / f"decentd-{i}.sock")})
            for i in range(2)}
        runner.wait_all(ranks, timeout=120 + a.repeats * 30, watch=daemons)
        ok = True
        return {"ranks": [json.loads((run_dir / f"rank-{i}.json").read_text())
                          for i in range(2)],
                "retransmitted": sum(retransmitted(ns) for ns in net.ns)}
    finally:
        tear_down(cleanup, run_dir, ok)


def retransmitted(ns: str) -> int:
    """TCP segments namespace ``ns`` has retransmitted (``/proc/net/snmp``)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                         capture_output=True, text=True, check=True).stdout
    names, values = [line.split() for line in out.splitlines() if line.startswith("Tcp:")]
    return int(values[names.index("RetransSegs")])


def rank_main(a: argparse.Namespace) -> int:
    """One rank: ``--repeats`` timed calls, a second apart, after a small one that both
    ranks pass together; the timings and the daemon's view of its link."""
    import torch

    import decent.torch as dt

    client = dt.init()
    x = torch.full((a.mbytes << 18,), float(client.rank + 1))
    seconds = []
    for i in range(a.repeats):
        client.allreduce(torch.zeros(1), name=f"sync{i}")  # both ranks start from here
        time.sleep(1.0)
        start = time.perf_counter()
        client.neighbor_allreduce_(x, name="big")
        seconds.append(time.perf_counter() - start)
    peer = client.status().peers[0]
    Path(a.out).write_text(json.dumps({
        "rank": client.rank, "seconds": seconds, "stripes": peer.stripes,
        "connect_rtt_ms": peer.connect_rtt_ms, "value": float(x[0])}))
    dt.shutdown()
    return 0


def summarize(case: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Per case: first and later calls (the slower rank's, call by call), link-rate share."""
    per_call = [max(r["seconds"][i] for r in case["ranks"]) for i in range(a.repeats)]
    ideal = (a.mbytes << 20) * 8 / parse_rate(a.rate)
    warm = statistics.median(per_call[1:]) if len(per_call) > 1 else per_call[0]
    return {"first_s": per_call[0], "warm_s": warm, "calls_s": per_call,
            "first_share": ideal / per_call[0], "warm_share": ideal / warm,
            "stripes": [r["stripes"] for r in case["ranks"]],
            "connect_rtt_ms": [round(r["connect_rtt_ms"], 1) for r in case["ranks"]],
            "exact": all(r["value"] == 1.5 for r in case["ranks"]),
            "retransmitted": case["retransmitted"]}


def table(result: dict[str, Any]) -> str:
    """The markdown table of every case."""
    lines = [f"64 MiB-class transfer: `{result['command']}` ({result['date']}; "
             f"{result['rate']}, RTT {result['rtt_ms']:g} ms, {result['mbytes']} MiB, "
             "both directions at once)", "",
             "| buffers | stripes | connections (RTT measured) | first call | share | "
             "later calls (median) | share | segments retransmitted | exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        s = c["summary"]
        lines.append(
            f"| {c['buffers']} | {c['stripes']} | {s['stripes'][0]} ({s['connect_rtt_ms'][0]} ms)"
            f" | {s['first_s']:.3f} s | {s['first_share']:.0%} | {s['warm_s']:.3f} s | "
            f"{s['warm_share']:.0%} | {s['retransmitted']} | {'yes' if s['exact'] else 'NO'} |")
    lines.append("")
    lines.append(f"Target: a striped link reaches {TARGET:.0%} of the link rate with the "
                 "default buffers.")
    return "\n".join(lines)


def draw(result: dict[str, Any], path: Path) -> None:
    """Bars: seconds per call for each case, first and later."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    labels = [f"{c['buffers']}\nstripes {c['stripes']}" for c in cases]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(cases))
    ax.bar([x - 0.2 for x in xs], [c["summary"]["first_s"] for c in cases], 0.4, label="first")
    ax.bar([x + 0.2 for x in xs], [c["summary"]["warm_s"] for c in cases], 0.4,
           label="later (median)")
    ideal = (result["mbytes"] << 20) * 8 / parse_rate(result["rate"])
    ax.axhline(ideal / TARGET, color="k", ls="--", lw=1, label=f"{TARGET:.0%} of the link rate")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("seconds per call")
    ax.set_title(f"{result['mbytes']} MiB across {result['rate']}, RTT {result['rtt_ms']:g} ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--rtt", type=float, default=100.0, help="round trip in ms")
    p.add_argument("--mbytes", type=int, default=64, help="MiB per call")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--stripes", default="1,auto", help="transport.stripes values")
    p.add_argument("--buffers", default="default,raised", help=f"of {', '.join(BUFFERS)}")
    p.add_argument("--json", type=Path, default=RESULTS / "wan_stripes.json")
    p.add_argument("--md", type=Path, default=RESULTS / "wan_stripes.md")
    p.add_argument("--png", type=Path, default=RESULTS / "wan_stripes.png")
    p.add_argument("--rank-of", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Every case, then the table, the JSON and the plot."""
    a = parse(argv)
    if a.rank_of:
        return rank_main(a)
    reason = skip_reason()
    if reason:
        print(reason)
        return 3
    from rich.progress import track

    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "rate": a.rate, "rtt_ms": a.rtt, "mbytes": a.mbytes, "repeats": a.repeats,
        "command": " ".join(["benchmarks/wan_stripes.py", *(argv or sys.argv[1:])]),
        "cases": []}
    cases = [(b, s) for b in a.buffers.split(",") if b for s in a.stripes.split(",") if s]
    for buffers, stripes in track(cases, description="cases"):
        summary = summarize(run_case(a, buffers, stripes), a)
        result["cases"].append({"buffers": buffers, "stripes": stripes, "summary": summary})
        print(f"{buffers} buffers, stripes {stripes}: {summary['stripes'][0]} connection(s), "
              f"first {summary['first_s']:.3f} s, later {summary['warm_s']:.3f} s "
              f"({summary['warm_share']:.0%} of the link rate), calls "
              f"{' '.join(f'{x:.2f}' for x in summary['calls_s'])}, "
              f"{summary['retransmitted']} segments retransmitted", flush=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    a.md.write_text(table(result) + "\n")
    draw(result, a.png)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
