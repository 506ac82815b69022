"""``decentctl``: look at a running daemon, or at a topology.

    decentctl status [--daemon unix:///tmp/decentd.sock]
    decentctl topology KIND -n N [--step T]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import grpc
import numpy as np
from rich.console import Console
from rich.table import Table

from decentd import topology
from decentd.wire import pb, pb_grpc


def _address(arg: str | None) -> str:
    address = arg or os.environ.get("DECENT_DAEMON") or os.path.join(
        tempfile.gettempdir(), "decentd.sock")
    return address if "://" in address or ":" in address else f"unix://{address}"


def status(address: str, console: Console) -> int:
    """Print a daemon's counters and peers."""
    with grpc.insecure_channel(address) as channel:
        try:
            s = pb_grpc.WorkerStub(channel).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError as exc:
            console.print(f"[red]cannot reach decentd at {address}: {exc.code().name}[/red]")
            return 1
    console.print(f"rank {s.rank}/{s.size}  cluster {s.cluster_id!r}  topology {s.topology_kind}  "
                  f"workers {s.workers}  in flight {s.ops_in_flight}  completed "
                  f"{s.ops_completed}  failed {s.ops_failed}  early bytes "
                  f"{s.early_arrival_bytes}")
    console.print(f"pid {s.pid}  rss {s.rss_bytes / 2**20:.1f} MiB  receive buffers "
                  f"{s.pool_bytes / 2**20:.1f} MiB (peak in use {s.pool_peak_bytes / 2**20:.1f} "
                  f"MiB)  registered worker memory {s.registered_bytes / 2**20:.1f} MiB")
    table = Table("peer", "address", "connected", "heartbeat age (s)", "sent (B)", "received (B)")
    for p in s.peers:
        table.add_row(str(p.rank), p.address, "yes" if p.connected else "[red]no[/red]",
                      f"{p.last_heartbeat_age_s:.1f}", str(p.bytes_sent), str(p.bytes_received))
    console.print(table)
    return 0


def show_topology(kind: str, n: int, step: int, console: Console) -> int:
    """Print W, rho and degrees of a topology."""
    try:
        topo = topology.build_topology(kind, n)
    except topology.TopologyError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    w = topo.matrix(step)
    console.print(f"{kind}, n={n}, step {step % topo.period} of {topo.period}: "
                  f"rho = {topo.rho(step):.4f}")
    with np.printoptions(precision=3, suppress=True, linewidth=200):
        console.print(str(w), markup=False)
    g = topo.graph(step)
    console.print(f"in-degree {sorted({d for _, d in g.in_degree()})}, "
                  f"out-degree {sorted({d for _, d in g.out_degree()})}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``decentctl`` console script."""
    p = argparse.ArgumentParser(prog="decentctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="a running daemon's counters and peers")
    st.add_argument("--daemon", help="daemon address (default $DECENT_DAEMON or the socket)")
    tp = sub.add_parser("topology", help="print a topology's mixing matrix")
    tp.add_argument("kind", choices=topology.kinds())
    tp.add_argument("-n", type=int, required=True)
    tp.add_argument("--step", type=int, default=0)
    args = p.parse_args(argv)
    console = Console()
    if args.cmd == "status":
        return status(_address(args.daemon), console)
    return show_topology(args.kind, args.n, args.step, console)


if __name__ == "__main__":
    sys.exit(main())
