"""``decentctl status --cluster``: one table of every daemon, asked through the local one."""

from __future__ import annotations

import json

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc

#: seconds for the whole round (each peer gets 5)
CLUSTER_TIMEOUT = 20.0
COLUMNS = ("rank", "address", "version", "uptime (s)", "epoch", "live", "workers", "in flight",
           "sent (B)", "received (B)", "heartbeat age (s)", "security")


def row(s: pb.StatusReply) -> dict[str, object]:
    """One daemon's line: the columns above, and its error if it could not be asked."""
    ages = [p.last_heartbeat_age_s for p in s.peers if p.last_heartbeat_age_s >= 0]
    line: dict[str, object] = {
        "rank": s.rank, "address": s.address, "version": s.version,
        "uptime (s)": round(s.uptime_s, 1), "epoch": s.view_epoch,
        "live": ",".join(str(r) for r in s.live_daemons), "workers": s.workers,
        "in flight": s.ops_in_flight, "sent (B)": sum(p.bytes_sent for p in s.peers),
        "received (B)": sum(p.bytes_received for p in s.peers),
        "heartbeat age (s)": round(max(ages), 2) if ages else None,
        "security": s.security_mode}
    if s.error.code != pb.OK:
        line = {"rank": s.rank, "address": s.address,
                "error": f"{pb.ErrorCode.Name(s.error.code)}: {s.error.message}"}
    return line


def cluster_status(address: str, console: Console, as_json: bool) -> int:
    """Print every daemon's line (a table, or JSON); 1 when one of them could not be asked."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply: pb.StatusReply = pb_grpc.WorkerStub(channel).Status(
                pb.StatusRequest(cluster=True), timeout=CLUSTER_TIMEOUT)
        except grpc.RpcError as exc:
            console.print(f"[red]cannot reach decentd at {address}: {exc.code().name}[/red]")
            return 1
    lines = [row(s) for s in reply.cluster]
    if as_json:
        print(json.dumps({"daemons": lines,
                          "raw": [MessageToDict(s) for s in reply.cluster]}, indent=1))
    else:
        table = Table(*COLUMNS, "error", title=f"cluster {reply.cluster_id!r}: "
                      f"{len(lines)} daemons; rank {reply.rank}'s view: epoch "
                      f"{reply.view_epoch}, live daemons {list(reply.live_daemons)}, live "
                      f"ranks {list(reply.live_ranks)}")
        for line in lines:
            table.add_row(*(escape("" if line.get(c) is None else str(line.get(c)))
                            for c in (*COLUMNS, "error")))
        # piped (a script, a log): wide enough that no column is cut
        (console if console.is_terminal else Console(width=240)).print(table)
    return 1 if any("error" in line for line in lines) else 0
