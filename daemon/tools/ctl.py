"""``decentctl``: look at a running daemon, or at a topology.

    decentctl status [--cluster [--json]] [--daemon unix://$XDG_RUNTIME_DIR/decentd.sock]
    decentctl topology KIND -n N [--step T] [--weights metropolis] [--option K=V] [--png F]
    decentctl topology --config node.yaml [-n N] [--step T] [--png F]
    decentctl certs --out DIR --nodes N [--cluster-id ID] [--hosts H0,H1,...]
                    [--dns-pattern 'decent-{i}.decent.default.svc'] [--days 365] [--force]
    decentctl certs --check DIR
    decentctl timeline FILE... [--png OUT] [--merge OUT] [--window FROM:TO]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
import networkx as nx
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from decent_wire import topology
from decent_wire.local import default_socket
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.errors import StartupError
from decentd.service.config import load_config
from decentd.tools import cluster_table as cluster_view
from decentd.tools import timeline_plot


def _address(arg: str | None) -> str:
    address = arg or os.environ.get("DECENT_DAEMON") or default_socket()
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
                  f"MiB)  registered worker memory {s.registered_bytes / 2**20:.1f} MiB  arena "
                  f"spills {s.arena_spills} ({s.arena_spill_bytes / 2**20:.1f} MiB mapped)  "
                  f"streamed inputs {s.inputs_streamed} "
                  f"({s.inputs_streamed_early_bytes / 2**20:.1f} MiB sent while copied in)  "
                  f"inputs left out {s.inputs_left_out}")
    console.print(f"membership: epoch {s.view_epoch}, live daemons {list(s.live_daemons)}, "
                  f"live ranks {list(s.live_ranks)} (on peer loss: {s.on_peer_loss})")
    cluster_view.print_uncut(console, peer_table(s))
    workers = cluster_view.uncut_table("worker rank", "local rank", "pid", "framework", "job",
                                       "in flight",
                                       title=f"local workers ({s.workers_per_node} per node)")
    for w in s.local_workers:
        workers.add_row(*map(cluster_view.cell, (w.rank, w.local_rank, w.pid, w.framework, w.job,
                                                 w.ops_in_flight)))
    cluster_view.print_uncut(console, workers)
    return 0


def peer_table(s: pb.StatusReply) -> Table:
    """A daemon's peers, one row each, no address ever cut (see ``cluster_view.uncut_table``)."""
    table = cluster_view.uncut_table("peer", "address", "state", "heartbeat age (s)", "sent (B)",
                                     "received (B)", "reconnects", "connections (RTT)")
    for p in s.peers:
        state = Text(p.state) if p.state == "up" else \
            Text.assemble((p.state, "red"), f": {p.down_reason}")
        table.add_row(*map(cluster_view.cell, (p.rank, p.address)), state,
                      *map(cluster_view.cell, (f"{p.last_heartbeat_age_s:.1f}", p.bytes_sent,
                                               p.bytes_received, p.reconnects,
                                               f"{p.stripes} ({p.connect_rtt_ms:.1f} ms)"
                                               if p.stripes else "-")))
    return table


def _option(text: str) -> tuple[str, int | str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, int(value) if value.lstrip("-").isdigit() else value


def show_topology(kind: str, n: int, step: int, console: Console, scheme: str = "uniform",
                  options: dict[str, int | str] | None = None, png: str | None = None,
                  config: str | None = None) -> int:
    """Print W, rho, degrees and properties of a topology (a kind, or the one a node.yaml
    configures); ``png``: draw its graph there."""
    try:
        if config is not None:
            cfg = load_config(config)
            n = n or len(cfg.peers)
            topo = cfg.topology.build(n)
            kind, scheme = topo.kind, topo.scheme
        else:
            topo = topology.build_topology(kind, n, None, scheme, **(options or {}))
        w = topo.matrix(step)
        failed = topo.failures(step)
    except (topology.TopologyError, StartupError) as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    console.print(f"{kind}, n={n}, {scheme} weights, step {step % topo.period} of "
                  f"{topo.period}: rho = {topo.rho(step):.4f}")
    with np.printoptions(precision=3, suppress=True, linewidth=200):
        console.print(str(w), markup=False)
    d_in, d_out = topo.degree(step)
    console.print(f"degree: in {d_in}, out {d_out}")
    for prop in topology.PROPERTIES:
        console.print(f"{prop}: " + ("yes" if prop not in failed else f"no ({failed[prop]})"))
    if png:
        draw(topo, step, png)
        console.print(f"drew {png}")
    return 0


def draw(topo: topology.Topology, step: int, path: str) -> None:
    """The graph at ``step`` as a PNG: ranks on a circle, arrows for one-way edges."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # an extra, not a dependency of the daemon
        raise SystemExit("decentctl topology --png needs matplotlib: pip install "
                         "'decent[examples]'") from exc
    g = topo.graph(step)
    two_way = [(a, b) for a, b in g.edges if g.has_edge(b, a) and a < b]
    one_way = [(a, b) for a, b in g.edges if not g.has_edge(b, a)]
    pos = nx.circular_layout(g)
    fig, ax = plt.subplots(figsize=(6, 6))
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color="#4c72b0", node_size=420)
    nx.draw_networkx_labels(g, pos, ax=ax, font_color="white", font_size=9)
    nx.draw_networkx_edges(g.to_undirected(), pos, edgelist=two_way, ax=ax, edge_color="#555")
    nx.draw_networkx_edges(g, pos, edgelist=one_way, ax=ax, edge_color="#c44e52",
                           arrows=True, arrowstyle="-|>", arrowsize=12, node_size=420)
    ax.set_title(f"{topo.kind}, n={topo.size}, step {step % topo.period}: "
                 f"rho = {topo.rho(step):.3f}")
    ax.set_axis_off()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def certs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``decentctl certs``: write a CA and one certificate per node into ``--out``, or check
    the certificates of ``--check`` (exit 1 when one fails)."""
    from decentd.security import certs as mtls  # cryptography is imported only by this subcommand

    if args.check is not None:
        lines, ok = mtls.check_dir(Path(args.check))
        print("\n".join(lines))
        return 0 if ok else 1
    if args.nodes is None:
        parser.error("--out needs --nodes N")
    hosts = [h.strip() for h in args.hosts.split(",")] if args.hosts is not None else None
    try:
        written = mtls.write_cluster(Path(args.out), args.nodes, args.cluster_id, hosts,
                                     args.dns_pattern, args.days, args.force)
    except mtls.CertError as exc:
        parser.error(str(exc))
    except OSError as exc:  # FileExistsError: the directory already holds certificates
        print(f"decentctl certs: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files into {args.out}: ca.crt and node-0..{args.nodes - 1}"
          ".crt/.key (give node i ca.crt, node-i.crt and node-i.key; keep ca.key offline)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``decentctl`` console script."""
    p = argparse.ArgumentParser(prog="decentctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="a running daemon's counters and peers")
    st.add_argument("--daemon", help="daemon address (default $DECENT_DAEMON or the socket)")
    st.add_argument("--cluster", action="store_true",
                    help="every daemon, one line each (asked through this one)")
    st.add_argument("--json", action="store_true", help="with --cluster: JSON for scripts")
    tp = sub.add_parser("topology", help="print a topology's mixing matrix, rho and degree")
    tp.add_argument("kind", nargs="?", choices=topology.kinds())
    tp.add_argument("-n", type=int, help="number of ranks (with --config: default the number "
                    "of peers)")
    tp.add_argument("--config", help="the topology section of this node.yaml (e.g. a custom "
                    "weighted edge list) instead of KIND")
    tp.add_argument("--step", type=int, default=0, help="step of a dynamic schedule")
    tp.add_argument("--weights", choices=topology.SCHEMES, default="uniform")
    tp.add_argument("--option", type=_option, action="append", default=[],
                    metavar="KEY=VALUE", help="a kind's option (rows, seed, group_size, mean)")
    tp.add_argument("--png", help="draw the graph into this PNG file")
    ce = sub.add_parser("certs", help="make or check the mutual-TLS certificates of a cluster")
    what = ce.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", metavar="DIR", help="write ca.crt, ca.key, node-<i>.crt and "
                      "node-<i>.key (keys mode 0600) into DIR")
    what.add_argument("--check", metavar="DIR", help="print each certificate of DIR and "
                      "whether it verifies against DIR/ca.crt and is unexpired")
    ce.add_argument("--nodes", type=int, metavar="N", help="number of daemons (ranks 0..N-1)")
    ce.add_argument("--cluster-id", default="decent", help="the cluster_id of node.yaml "
                    "(default: %(default)s), written into each decent://ID/rank/I URI SAN")
    ce.add_argument("--hosts", metavar="H0,H1,...", help="one address per rank, a SAN of its "
                    "certificate (an IP address or a DNS name)")
    ce.add_argument("--dns-pattern", metavar="PATTERN", help="a DNS SAN per rank, {i} the "
                    "rank, e.g. 'decent-{i}.decent.default.svc'")
    ce.add_argument("--days", type=int, default=365, help="validity (default: %(default)s)")
    ce.add_argument("--force", action="store_true", help="replace the certificates in DIR")
    tl = timeline_plot.add_parser(sub)
    args = p.parse_args(argv)
    console = Console()
    if args.cmd == "timeline":
        return timeline_plot.run(args, tl)
    if args.cmd == "certs":
        return certs(args, ce)
    if args.cmd == "status":
        if args.cluster:
            return cluster_view.cluster_status(_address(args.daemon), console, args.json)
        return status(_address(args.daemon), console)
    if (args.kind is None) == (args.config is None):
        tp.error("give a topology KIND or --config node.yaml (one of them)")
    if args.config is None and not args.n:
        tp.error("-n is required with a KIND")
    return show_topology(args.kind or "", args.n or 0, args.step, console, args.weights,
                         dict(args.option), args.png, args.config)


if __name__ == "__main__":
    sys.exit(main())
