"""``decentctl status --cluster``: one table of every daemon, asked through the local one; and
how ``decentctl status`` prints a table without cutting a cell (an address above all)."""

from __future__ import annotations

import json

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc

#: seconds for the whole round (each peer gets 5)
CLUSTER_TIMEOUT = 20.0
COLUMNS = ("rank", "address", "version", "uptime (s)", "epoch", "live", "workers", "in flight",
           "sent (B)", "received (B)", "heartbeat age (s)", "security")
#: the columns a terminal keeps whole, as wide as their widest cell, while the others give way
WHOLE = ("address",)


def uncut_table(*headers: str, title: str | None = None) -> Table:
    """A table none of whose cells is ever cut: a cell too wide for its column is folded onto
    more lines, never ellipsized. Add its cells as :class:`~rich.text.Text` (see :func:`cell`)."""
    table = Table(title=None if title is None else Text(title))
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def cell(value: object) -> Text:
    """A cell shown as it is: no markup, and no emoji code (``:1234:`` in an IPv6 address
    would print as an emoji otherwise)."""
    return Text("" if value is None else str(value))


def keep_whole(console: Console, table: Table) -> bool:
    """Whether ``table`` fits ``console`` with its :data:`WHOLE` columns at their widest cell
    and the others no narrower than their longest word; if so, fix the :data:`WHOLE` columns'
    widths so that rich narrows the others (wrapping at words) rather than them."""
    unbounded = console.options.update_width(10**6)
    whole, least = {}, len(table.columns) + 1  # the borders
    for i, column in enumerate(table.columns):
        sizes = [Measurement.get(console, unbounded, c) for c in [column.header, *column.cells]]
        if column.header in WHOLE:
            whole[i] = max(m.maximum for m in sizes)
        least += max(m.maximum if i in whole else m.minimum for m in sizes) + 2  # padding
    if least > console.width:
        return False
    for i, width in whole.items():
        table.columns[i].width = width
    return True


def as_records(table: Table) -> Group:
    """``table`` one block a row, a line a non-empty cell (``header  value``): what a terminal
    too narrow for the table shows, every cell whole (a long one folds within its line)."""
    columns = [(str(c.header), list(c.cells)) for c in table.columns]
    blocks: list[RenderableType] = [] if table.title is None else [table.title]
    for r in range(table.row_count):
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(overflow="fold")
        for header, cells in columns[1:]:
            value = cells[r]
            if not isinstance(value, Text) or value.plain:  # an empty cell says nothing
                grid.add_row(header, value)
        heading = Table.grid(padding=(0, 1))  # "rank 2", "peer 3": the first column
        heading.add_row(Text(columns[0][0], style="bold"), columns[0][1][r])
        blocks += [heading, grid]
    return Group(*blocks)


def print_uncut(console: Console, table: Table) -> None:
    """Print ``table`` with no cell cut. On a terminal: as a table when it fits, its
    :data:`WHOLE` columns whole (:func:`keep_whole`), else as records (:func:`as_records`).
    Piped or into a file: as wide as its content, one line a row, so that a script or a log
    sees every address in full whatever ``COLUMNS`` says."""
    if console.is_terminal:
        console.print(table if keep_whole(console, table) else as_records(table))
        return
    unbounded = console.options.update_width(10**6)
    natural = Measurement.get(console, unbounded, table).maximum
    Console(file=console.file, width=max(natural, console.width), no_color=True,
            highlight=False).print(table)


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
        table = uncut_table(*COLUMNS, "error", title=f"cluster {reply.cluster_id!r}: "
                            f"{len(lines)} daemons; rank {reply.rank}'s view: epoch "
                            f"{reply.view_epoch}, live daemons {list(reply.live_daemons)}, "
                            f"live ranks {list(reply.live_ranks)}")
        for line in lines:
            table.add_row(*(cell(line.get(c)) for c in (*COLUMNS, "error")))
        print_uncut(console, table)
    return 1 if any("error" in line for line in lines) else 0
