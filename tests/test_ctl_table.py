"""``decentctl status`` never cuts an address: piped at ``COLUMNS=80`` each address is printed
whole on one line, a wide terminal keeps the address column whole, and a terminal too narrow for
the table shows each row as a block of lines, nothing ellipsized.

In process, with the daemon's reply made up (a long IPv6 peer address, a down peer whose reason
repeats it): the tables are what is under test, not the daemon."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from decent_wire.v1 import decent_pb2 as pb
from decentd.tools import cluster_table, ctl

#: 46 characters: wider than rich gives a column of a 7-column table at 80
ADDRESSES = ["[2001:db8:85a3:1234:5678:8a2e:370:7334]:7700",
             "[2001:db8:85a3:1234:5678:8a2e:370:7335]:7700"]


def reply() -> pb.StatusReply:
    """A daemon with two peers at long IPv6 addresses, the second down."""
    peers = [pb.PeerStatus(rank=1, address=ADDRESSES[0], state="up", last_heartbeat_age_s=0.1,
                           bytes_sent=123_456_789, bytes_received=987_654_321, stripes=8,
                           connect_rtt_ms=100.42),
             pb.PeerStatus(rank=2, address=ADDRESSES[1], state="down",
                           down_reason=f"rank 2 at {ADDRESSES[1]} refused or unreachable",
                           last_heartbeat_age_s=4.2, reconnects=3)]
    one = pb.StatusReply(rank=0, size=3, cluster_id="decent", workers=1, peers=peers,
                         address="[2001:db8:85a3:1234:5678:8a2e:370:7333]:7700",
                         local_workers=[pb.LocalWorker(rank=0, pid=4242, framework="torch",
                                                       job="a-rather-long-job-name-1234")])
    cluster = [pb.StatusReply(rank=1, address=ADDRESSES[0], version="0.1.0", workers=1),
               pb.StatusReply(rank=2, address=ADDRESSES[1], error=pb.Error(
                   code=pb.PEER_UNAVAILABLE, message=f"rank 2 at {ADDRESSES[1]} refused"))]
    one.cluster.extend([pb.StatusReply(rank=0, address=one.address, version="0.1.0",
                                       workers=1), *cluster])
    return one


class FakeStub:
    """Stands for ``WorkerStub``: every Status call answers :func:`reply`."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def Status(self, request: pb.StatusRequest, timeout: float) -> pb.StatusReply:
        return reply()


@pytest.fixture
def fake_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both views ask the made-up daemon; the console is 80 columns when not a terminal."""
    monkeypatch.setattr(ctl.pb_grpc, "WorkerStub", FakeStub)
    monkeypatch.setattr(cluster_table.pb_grpc, "WorkerStub", FakeStub)
    monkeypatch.setenv("COLUMNS", "80")


@pytest.mark.parametrize("cluster", [False, True], ids=["status", "status --cluster"])
def test_piped_status_prints_every_address_whole(fake_daemon: None, cluster: bool,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Piped (stdout not a terminal, ``COLUMNS=80``): no ellipsis, and each address in full on
    one line, as ``grep`` would look for it."""
    argv = ["status", "--daemon", "unix:///nowhere.sock", *(["--cluster"] if cluster else [])]
    code = ctl.main(argv)
    out = capsys.readouterr().out
    assert code == (1 if cluster else 0), out  # --cluster: rank 2 could not be asked
    assert "…" not in out, out
    lines = out.splitlines()
    for address in ADDRESSES:
        assert any(address in line for line in lines), out
    if not cluster:
        assert "a-rather-long-job-name-1234" in out, out


def terminal(width: int) -> tuple[Console, io.StringIO]:
    """A terminal ``width`` columns wide, its output in the buffer."""
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=True, color_system=None), buf


def cluster_view() -> Table:
    """``status --cluster``'s table of :func:`reply`."""
    table = cluster_table.uncut_table(*cluster_table.COLUMNS, "error", title="cluster")
    for s in reply().cluster:
        line = cluster_table.row(s)
        table.add_row(*(cluster_table.cell(line.get(c)) for c in (*cluster_table.COLUMNS,
                                                                    "error")))
    return table


@pytest.mark.parametrize("table", [lambda: ctl.peer_table(reply()), cluster_view],
                         ids=["peers", "cluster"])
def test_a_terminal_at_80_columns_shows_every_address_whole(table: Callable[[], Table]) -> None:
    """An 80-column terminal, too narrow for the table: each row as a block of ``header
    value`` lines, no line wider than 80, no ellipsis, every address whole on its line."""
    console, buf = terminal(80)
    cluster_table.print_uncut(console, table())
    out = buf.getvalue()
    assert "…" not in out and all(len(line) <= 80 for line in out.splitlines()), out
    for address in ADDRESSES:
        assert any(line.split()[-1:] == [address] for line in out.splitlines()), out
    assert "a-rather-long-job-name" not in out  # (only the peers' and the cluster's tables)


def test_a_wide_terminal_keeps_the_table_and_the_address_column_whole() -> None:
    """Wide enough for the address but not for every cell at full width: still a table, the
    address column as wide as the longest address, the down reason wrapped at its words."""
    console, buf = terminal(160)
    s = reply()
    s.peers[1].down_reason = "refused or unreachable (UNAVAILABLE) " * 3
    cluster_table.print_uncut(console, ctl.peer_table(s))
    out = buf.getvalue()
    assert out.startswith("┏") and "…" not in out, out
    rows = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    assert [r[2].strip() for r in rows if r[2].strip()] == ADDRESSES, out
    assert "8 (100.4 ms)" in out, out  # a striped link: its connections, its measured RTT
    assert all(len(line) <= 160 for line in out.splitlines()), out
