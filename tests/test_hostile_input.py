"""Hostile input on the bulk path (issue 24, "bounded parsing"): every size, count, rank, dtype
and shape a peer sends is checked before anything is allocated for it or indexed with it, a bad
frame closes only the connection it came on with a short reason, and what a peer makes the
daemon remember is bounded and dropped when its connection is lost.

Most cases drive daemon 0's real receiver in-process (frames fed to a real ``Inbound`` parser,
no sockets); the last runs real daemons with this test playing their third peer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import torch
from lone import closed_by_peer
from prometheus_client import CollectorRegistry

import decent.torch as dt
from cluster import until
from decent_wire import framing
from decent_wire.topology import build_topology
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.keys import at_worker, part
from decentd.mailbox.arrivals import Arrival
from decentd.mailbox.receiver import Receiver
from decentd.mailbox.records import Key
from decentd.net import flow
from decentd.net.inbound import Inbound
from decentd.ops.api import Services
from decentd.security.refusals import Refusals
from decentd.service.config import NodeConfig
from decentd.service.server import build_services
from decentd.tools.launcher import free_ports
from decentd.windows import store as window_store
from decentd.windows.store import WindowStore

GIB2 = 2 << 30
#: a window of worker 0 (on daemon 0, the one under test), and a tensor key of its
WINDOW, TENSOR = at_worker("w", 0), at_worker("t", 0)


def frame(header: pb.BulkHeader, payload: bytes = b"") -> bytes:
    return framing.encode(header) + payload


def window_part(op: int = pb.WIN_PUT, dtype: int = pb.FLOAT32, shape: tuple[int, ...] = (1,),
                nbytes: int = 4, name: str = WINDOW, weight: float = 1.0) -> pb.Part:
    """A window request from worker 1 (on daemon 1) to worker 0."""
    p = part(name, 0, window_store.REQUEST, op, dtype, shape, nbytes, weight)
    p.src = 1
    return p


def tensor_part(round_: int = 0, nbytes: int = 16, name: str = TENSOR) -> pb.Part:
    """A part of an op's tensor from worker 1 to worker 0."""
    p = part(name, round_, 0, pb.NEIGHBOR_ALLREDUCE, pb.FLOAT32, (nbytes // 4,), nbytes)
    p.src = 1
    return p


class Transport:
    """What an ``Inbound`` calls on its transport: here, only whether it closed it."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Listener:
    """An open op that ignores what it is told."""

    def aborted(self, src: int, error: pb.Error) -> None:
        pass

    def stray(self, key: Key, arrival: Arrival) -> None:
        pass

    def foreign(self, src: int, op: int) -> None:
        pass


class Daemon0:
    """Daemon 0 of a two-daemon cluster, built as the daemon builds itself, minus the sockets;
    rank 1's bulk connections are fed by the test."""

    def __init__(self, tmp_path: Path, window: int = 1 << 20) -> None:
        cfg = NodeConfig(peers=["127.0.0.1:1", "127.0.0.1:2"], rank=0,
                         socket=str(tmp_path / "d.sock"),
                         memory={"early_arrival_bytes": window})
        self.services: Services
        self.receiver: Receiver
        self.services, self.receiver, _ = build_services(cfg, 0,
                                                         Refusals(CollectorRegistry()))
        self.mailbox = self.services.mailbox
        self.pool = self.services.pool
        self.windows: WindowStore = self.services.windows
        self.flow = self.services.links.links[1].flow

    def connect(self) -> tuple[Inbound, Transport]:
        """A bulk connection from rank 1 that said HELLO."""
        conn, transport = Inbound(self.receiver, self.services.links.gate), Transport()
        conn.transport = cast(asyncio.Transport, transport)
        feed(conn, frame(pb.BulkHeader(kind=pb.HELLO, cluster_id="decent", from_rank=1)))
        assert conn.src == 1 and not transport.aborted
        return conn, transport


def feed(conn: Inbound, data: bytes) -> None:
    """``data`` as the event loop hands it to the protocol, in pieces of what it asks for."""
    view = memoryview(data)
    while view:
        buf = conn.get_buffer(len(view))
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        conn.buffer_updated(n)
        view = view[n:]


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


@pytest.fixture
def daemon(tmp_path: Path) -> Daemon0:
    return Daemon0(tmp_path)


def closed_with(caplog: pytest.LogCaptureFixture, transport: Transport, text: str) -> bool:
    """The connection was closed, and the log says why in a short line."""
    lines = [r.getMessage() for r in caplog.records if r.name == "decentd.net.inbound"]
    assert all(len(line) < 1024 for line in lines), [len(line) for line in lines]
    return transport.aborted and any(text in line for line in lines)


# ---------------------------------------------------------------- window messages


def test_an_unknown_dtype_in_a_window_message_closes_that_connection_clearly(
        daemon: Daemon0, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        conn, transport = daemon.connect()
        bad = window_part(dtype=77)
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=1, payload_bytes=4,
                                       parts=[bad]), b"1234"))  # no KeyError escapes
        assert closed_with(caplog, transport, "window message of unknown dtype 77")
        assert daemon.windows.windows == {}
        conn, transport = daemon.connect()  # by RTS: refused before anything is cleared
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=2, parts=[bad])))
        assert transport.aborted and len(daemon.mailbox.announced) == 0
        for other in (window_part(op=pb.WIN_REPLY, dtype=99, nbytes=0),  # an answer too
                      window_part(shape=(-1,)), window_part(shape=(1,) * 65)):
            conn, transport = daemon.connect()
            feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=3,
                                           payload_bytes=other.nbytes, parts=[other]),
                             b"\0" * other.nbytes))
            assert transport.aborted, other
    caplog.set_level(logging.INFO)
    run(body())
    assert "KeyError" not in caplog.text


def test_a_window_put_whose_element_count_is_not_its_payload_is_refused(
        daemon: Daemon0, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        conn, transport = daemon.connect()
        lying = window_part(shape=(1_000_000,), nbytes=4)  # 1e6 elements in 4 bytes
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=1, payload_bytes=4,
                                       parts=[lying]), b"1234"))
        assert closed_with(caplog, transport, "1000000 float32 elements in 4 bytes")
        assert daemon.windows.windows == {}  # no partial write, no window
        conn, transport = daemon.connect()  # parts that do not add up to the payload
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=2, payload_bytes=4,
                                       parts=[window_part(shape=(2,), nbytes=8)]), b"1234"))
        assert closed_with(caplog, transport, "parts of 8 bytes in a 4-byte payload")
        conn, transport = daemon.connect()  # a read carries no tensor
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=3, payload_bytes=4,
                                       parts=[window_part(op=pb.WIN_GET)]), b"1234"))
        assert transport.aborted
        conn, transport = daemon.connect()  # and an honest put is taken
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=4, payload_bytes=8,
                                       parts=[window_part(shape=(2,), nbytes=8)]), b"\0" * 8))
        assert not transport.aborted and daemon.windows.early_bytes == 8
    run(body())


@pytest.mark.parametrize("bad", [
    window_part(op=pb.WIN_LOCK, nbytes=0), window_part(op=pb.GROUP_TRIGGER, nbytes=0, weight=3),
    window_part(op=pb.GROUP_TRIGGER, nbytes=0, weight=float("inf")),
    window_part(name="w\x1en"),  # a window of no worker
], ids=["lock-slot", "group-3", "group-inf", "node-window"])
def test_window_requests_name_ranks_and_groups_that_exist(daemon: Daemon0, bad: pb.Part) -> None:
    if bad.op == pb.WIN_LOCK:
        bad.step = 99  # the slot of rank 99 among 2
    if bad.name.endswith("n"):
        bad.src = 1  # a node-level part names its daemon

    async def body() -> None:
        conn, transport = daemon.connect()
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=1, payload_bytes=bad.nbytes,
                                       parts=[bad]), b"\0" * bad.nbytes))
        assert transport.aborted
    run(body())


def test_a_bad_window_frame_is_logged_in_a_short_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: WindowStore, src: int, name: str, round_: int, arrival: Arrival) -> None:
        raise KeyError("x" * (256 << 10))  # a failure while serving it, with a huge text

    monkeypatch.setattr(WindowStore, "on_message", boom)
    daemon = Daemon0(tmp_path)
    huge = "y" * (256 << 10)

    async def body() -> None:
        for bad in (window_part(dtype=77, name=at_worker(huge, 0)),  # a long name
                    window_part(name=huge),  # a name with no owner
                    window_part()):  # served, and failing
            conn, transport = daemon.connect()
            feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=1, payload_bytes=4,
                                           parts=[bad]), b"1234"))
            assert transport.aborted
    caplog.set_level(logging.INFO)
    run(body())
    assert caplog.records
    assert max(len(r.getMessage()) for r in caplog.records) < 1024
    assert "KeyError in boom" in caplog.text
    assert daemon.pool.in_use_bytes == 0  # the failed request's payload went back
    assert daemon.flow.unconsumed == 0 and daemon.flow.unconsumed_parts == 0


def test_reads_of_windows_not_created_yet_are_bounded_and_dropped_with_their_peer(
        daemon: Daemon0, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(window_store, "PARKED_MEMORY", 2)

    async def body() -> None:
        conn, transport = daemon.connect()
        for mid in range(1, 4):
            feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=mid, parts=[
                window_part(op=pb.WIN_GET, nbytes=0)])))
        assert daemon.windows.parked == 2 and not transport.aborted  # the third: refused
        lock = window_part(op=pb.WIN_LOCK, nbytes=0)
        lock.step = 1
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=4, parts=[lock])))
        assert daemon.services.locks.requests == 1
        conn.connection_lost(None)
        assert daemon.windows.parked == 0 and daemon.services.locks.requests == 0
    run(body())


# ---------------------------------------------------------------- payload sizes


def test_a_payload_never_announced_or_larger_than_announced_allocates_nothing(
        daemon: Daemon0, caplog: pytest.LogCaptureFixture) -> None:
    pool = daemon.pool

    async def body() -> None:
        before = (pool.allocated, pool.in_use_bytes, pool.peak_in_use)
        conn, transport = daemon.connect()  # a 60-byte header declaring 2 GiB
        feed(conn, frame(pb.BulkHeader(kind=pb.PAYLOAD, message_id=7, payload_bytes=GIB2)))
        assert closed_with(caplog, transport, "not cleared to send")
        conn, transport = daemon.connect()  # a window request cleared at once, then 2 GiB
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=8, parts=[window_part()])))
        assert not transport.aborted and len(daemon.mailbox.announced) == 1
        feed(conn, frame(pb.BulkHeader(kind=pb.PAYLOAD, message_id=8, payload_bytes=GIB2)))
        assert closed_with(caplog, transport, f"a {GIB2}-byte payload for message 8, "
                                              "announced with 4 bytes")
        conn, transport = daemon.connect()  # a consistent 2 GiB put: not cleared, no window
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=9, parts=[
            window_part(shape=(GIB2 // 4,), nbytes=GIB2)])))
        assert not transport.aborted and len(daemon.mailbox.announced) == 0
        feed(conn, frame(pb.BulkHeader(kind=pb.PAYLOAD, message_id=9, payload_bytes=GIB2)))
        assert transport.aborted
        conn, transport = daemon.connect()  # past this machine's memory
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=10, parts=[
            tensor_part(nbytes=1 << 62)])))
        assert closed_with(caplog, transport, "more than this machine's")
        conn, transport = daemon.connect()  # eager: past the window
        feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=11, payload_bytes=GIB2,
                                       parts=[tensor_part(nbytes=GIB2)])))
        assert closed_with(caplog, transport, "eager bytes")
        assert (pool.allocated, pool.in_use_bytes, pool.peak_in_use) == before
    run(body())


def test_a_dropped_payload_must_still_have_the_bytes_announced(
        daemon: Daemon0, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        conn, transport = daemon.connect()
        key = (TENSOR, 0)
        daemon.mailbox.open([key], Listener())
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=5, parts=[
            tensor_part(nbytes=4 << 20)])))  # cleared: an op takes it
        daemon.mailbox.close([key])  # ... and ended before the payload came: dropped
        before = daemon.pool.allocated
        feed(conn, frame(pb.BulkHeader(kind=pb.PAYLOAD, message_id=5, payload_bytes=GIB2)))
        assert closed_with(caplog, transport, "announced with 4194304 bytes")
        assert daemon.pool.allocated == before
    run(body())


def test_credit_given_back_is_at_most_what_was_sent_eagerly(
        daemon: Daemon0, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        conn, transport = daemon.connect()
        daemon.flow.credits = 1 << 20
        assert daemon.flow.take(100)  # we sent rank 1 100 bytes eagerly
        feed(conn, frame(pb.BulkHeader(kind=pb.ACK, credit=100)))  # and it consumed them
        assert not transport.aborted and daemon.flow.lent == 0
        feed(conn, frame(pb.BulkHeader(kind=pb.ACK, credit=1 << 40)))  # more than ever sent
        assert closed_with(caplog, transport, "1099511627776 bytes of credit given back")
        assert daemon.flow.credits == 1 << 20
    run(body())


def test_one_header_told_to_every_peer_carries_each_only_its_own_credit() -> None:
    flows = [flow.LinkFlow(window=100, owed=10), flow.LinkFlow(window=100, owed=20)]
    news = pb.BulkHeader(kind=pb.WORKER_LEFT)  # as Links.tell_all sends it, to each link
    credits = [framing.decode(pb.BulkHeader, f.stamp(news)[framing.LENGTH:]).credit
               for f in flows]
    assert credits == [10, 20]  # not 30 to the second: more than it ever lent us


# ---------------------------------------------------------------- floods


def test_an_rts_flood_is_bounded_and_forgotten_when_its_peer_disconnects(
        daemon: Daemon0, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "MAX_PARTS", 64)
    box = daemon.mailbox

    def flood(conn: Inbound, count: int) -> None:
        for mid in range(1, count + 1):  # announced for ops that never run here
            feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=mid, parts=[
                tensor_part(round_=mid, nbytes=8 << 20)])))

    async def body() -> None:
        conn, transport = daemon.connect()
        flood(conn, 64)
        assert len(box.announced) == 64 and box.slot_count == 64
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=100, parts=[window_part()])))
        assert closed_with(caplog, transport, "more than 64 parts announced")
        assert len(box.announced) == 0 and box.slot_count == 0  # its connection is gone
        conn, transport = daemon.connect()  # ids and room are free again
        flood(conn, 63)
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=100, parts=[window_part()])))
        assert not transport.aborted and len(box.announced) == 64  # one cleared, never sent
        feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=100, parts=[window_part()])))
        assert closed_with(caplog, transport, "message 100 announced twice")
        assert len(box.announced) == 0 and box.slot_count == 0
        conn, transport = daemon.connect()
        flood(conn, 10)
        conn.connection_lost(None)  # an orderly close forgets them the same way
        assert len(box.announced) == 0 and box.slot_count == 0
    run(body())


def test_worker_news_after_an_rts_flood_costs_what_local_ops_wait_on_not_every_slot(
        daemon: Daemon0) -> None:
    box = daemon.mailbox

    async def body() -> None:
        conn, transport = daemon.connect()
        for mid in range(60):  # 60,000 parts announced for ops that never run here
            feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=mid + 1, parts=[
                tensor_part(round_=1000 * mid + i + 1, nbytes=8 << 20) for i in range(1000)])))
        assert box.slot_count == 60_000 and not transport.aborted
        waits = box.expect(1, TENSOR, 0, 0)  # the one op here that waits on worker 1
        news = b"".join(frame(pb.BulkHeader(kind=kind, parts=[pb.Part(name="", src=1)]))
                        for kind in (pb.WORKER_LEFT, pb.WORKER_JOINED))
        started = time.process_time()
        feed(conn, news * 2000)
        spent = time.process_time() - started
        assert waits.done() and "left" in str(waits.exception())
        assert not transport.aborted and box.slot_count == 60_001
        # a cost bound, not a speed figure: before, each WORKER_LEFT visited all 60,000 slots
        # (2,000 of them: minutes of CPU; an attacker's 4.4 MB pinned a daemon for 3.5 min)
        assert spent < 20, f"{spent:.1f} s of CPU for 4,000 worker news frames"
    run(body())


def test_payloads_to_drop_do_not_count_against_their_peer_and_are_bounded(
        daemon: Daemon0, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "MAX_PARTS", 4)
    monkeypatch.setattr(flow, "DISCARD_MEMORY", 2)
    box, rts = daemon.mailbox, daemon.mailbox.announced

    async def body() -> None:
        conn, transport = daemon.connect()
        for r in range(4):  # cleared for ops that then end before the payloads come
            box.open([(TENSOR, r)], Listener())
            feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=r + 1, parts=[
                tensor_part(round_=r, nbytes=8 << 20)])))
            box.close([(TENSOR, r)])
        assert len(rts.discard) == 2 and len(rts) == 2  # the oldest two forgotten
        for r in range(4, 8):  # the peer's room is whole again
            feed(conn, frame(pb.BulkHeader(kind=pb.RTS, message_id=r + 1, parts=[
                tensor_part(round_=r, nbytes=8 << 20)])))
        assert not transport.aborted and len(rts.waiting) == 4
        feed(conn, frame(pb.BulkHeader(kind=pb.PAYLOAD, message_id=4, payload_bytes=8 << 20),
                         b"\0" * (8 << 20)))  # a dropped one still comes: read and dropped
        assert not transport.aborted and len(rts.discard) == 1
        assert daemon.pool.in_use_bytes == 0
        box.forget_history()  # a new job: nothing of the old one is kept but what to drop
        assert len(rts.waiting) == 0 and len(rts.discard) == 1 and box.slot_count == 0
    run(body())


def test_a_zero_byte_data_flood_is_bounded_and_taken_parts_give_room_back(
        daemon: Daemon0, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "MAX_PARTS", 64)
    box = daemon.mailbox

    def flood(conn: Inbound, rounds: range) -> None:
        for r in rounds:
            feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=r + 1, parts=[
                tensor_part(round_=r, nbytes=0)])))

    async def body() -> None:
        conn, transport = daemon.connect()
        for mid in range(1000, 1200):  # window requests: served at once, their room given back
            unlock = window_part(op=pb.WIN_UNLOCK, nbytes=0)
            unlock.step = 1
            feed(conn, frame(pb.BulkHeader(kind=pb.DATA, message_id=mid, parts=[unlock])))
        assert not transport.aborted and daemon.flow.unconsumed_parts == 0
        flood(conn, range(64))
        assert box.slot_count == 64 and daemon.flow.unconsumed_parts == 64
        for r in range(32):  # ops take half of them, and end
            (await box.expect(1, TENSOR, r, 0)).release()
            box.close([(TENSOR, r)])
        assert daemon.flow.unconsumed_parts == 32 and box.slot_count == 32
        flood(conn, range(64, 96))
        assert not transport.aborted and box.slot_count == 64
        flood(conn, range(96, 97))  # the 65th part waiting for an op
        assert closed_with(caplog, transport, "eager parts")
        assert box.slot_count == 64  # what arrived stays for the ops that may take it
        assert box.early_bytes == 0 and daemon.pool.in_use_bytes == 0
    run(body())


# ---------------------------------------------------------------- real daemons


class FakePeer:
    """Rank ``rank`` of a cluster, played by this test: a Peer service that answers handshakes,
    and a bulk port that takes the daemons' connections and drops what they send."""

    def __init__(self, rank: int, grpc_address: str) -> None:
        self.bulk = socket.create_server(("127.0.0.1", 0))
        self.conns: list[socket.socket] = []
        port = self.bulk.getsockname()[1]

        class Service(pb_grpc.PeerServicer):
            def Handshake(self, request: pb.HandshakeRequest,
                          context: grpc.ServicerContext) -> pb.HandshakeReply:
                return pb.HandshakeReply(rank=rank, data_port=port, window_bytes=1 << 20)

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_PeerServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(grpc_address)
        self.server.start()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.bulk.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    @staticmethod
    def _drain(conn: socket.socket) -> None:
        try:
            while conn.recv(1 << 16):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.server.stop(0)
        self.bulk.close()
        for conn in self.conns:
            conn.close()


def _rss(pid: int) -> int:
    """Resident bytes of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@dataclass
class TwoOfThree:
    """Daemons 0 and 1 of a three-daemon cluster whose rank 2 is a :class:`FakePeer`."""

    peers: list[str]
    sockets: list[str]
    logs: list[Path]
    procs: list[subprocess.Popen[bytes]]


@pytest.fixture
def two_of_three(tmp_path: Path) -> Iterator[TwoOfThree]:
    peers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    fake = FakePeer(2, peers[2])
    c = TwoOfThree(peers, [str(tmp_path / f"r{i}.sock") for i in range(2)],
                   [tmp_path / f"rank{i}.log" for i in range(2)], [])
    for i in range(2):
        with c.logs[i].open("ab") as log:
            c.procs.append(subprocess.Popen(
                [sys.executable, "-m", "decentd", "--rank", str(i), "--peers",
                 ",".join(peers), "--socket", c.sockets[i], "--topology", "ring",
                 # rank 2 (the fake) reaches them only when the test attacks
                 "--set", "timeouts.start=30", "--set", "faults.min_nodes=2"],
                stdout=log, stderr=subprocess.STDOUT))
    try:
        yield c
    finally:
        for p in c.procs:
            p.kill()
            p.wait()
        fake.close()


def bulk_port_as_rank_2(peer: str) -> int:
    """Rank 0's bulk port, learned by a handshake as the (insecure) cluster's rank 2."""
    digest = build_topology("ring", 3).digest()
    stub = pb_grpc.PeerStub(grpc.insecure_channel(peer))
    return int(stub.Handshake(pb.HandshakeRequest(
        cluster_id="decent", protocol_version=pb.PROTOCOL_VERSION_CURRENT, from_rank=2,
        to_rank=0, workers_per_node=1, topology_digest=digest,
        machine_topology_digest=digest)).data_port)


@pytest.mark.slow
def test_hostile_frames_close_only_their_connection_and_ops_go_on(
        two_of_three: TwoOfThree) -> None:
    c = two_of_three
    procs = c.procs
    clients = [dt.connect(f"unix://{s}", 60, local_rank=0) for s in c.sockets]
    try:
        port = bulk_port_as_rank_2(c.peers[0])
        hello = frame(pb.BulkHeader(kind=pb.HELLO, cluster_id="decent", from_rank=2))

        def window(**fields: Any) -> pb.Part:
            p = window_part(**fields)
            p.src = 2
            return p

        rss = _rss(procs[0].pid)
        tries: dict[str, bytes] = {
            "unknown dtype": frame(pb.BulkHeader(kind=pb.DATA, message_id=1, payload_bytes=4,
                                                 parts=[window(dtype=77)]), b"1234"),
            "count/payload": frame(pb.BulkHeader(kind=pb.DATA, message_id=1, payload_bytes=4,
                                                 parts=[window(shape=(10**6,))]), b"1234"),
            "2 GiB payload": frame(pb.BulkHeader(kind=pb.PAYLOAD, message_id=1,
                                                 payload_bytes=GIB2)),
            "2 GiB for 4 announced": frame(pb.BulkHeader(kind=pb.RTS, message_id=1,
                                                         parts=[window()]))
            + frame(pb.BulkHeader(kind=pb.PAYLOAD, message_id=1, payload_bytes=GIB2)),
        }
        for what, data in tries.items():
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(hello + data)
                assert closed_by_peer(s), what
        assert _rss(procs[0].pid) < rss + (256 << 20)  # nothing of 2 GiB was allocated
        text = c.logs[0].read_text()
        lines = [line for line in text.splitlines() if "malformed frame" in line]
        assert all(len(line) < 1024 for line in lines), lines
        assert sum("bulk connection from rank 2: malformed" in line for line in lines) == 4
        assert "Traceback" not in text and "KeyError" not in text
        assert all(p.poll() is None for p in procs)

        def average(i: int) -> torch.Tensor:
            return clients[i].neighbor_allreduce(
                torch.full((4,), 2.0 * i), name="after", self_weight=0.5,
                src_weights={1 - i: 0.5}, dst_weights=[1 - i], timeout=30)

        with futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(average, range(2)))
        assert all(torch.equal(g, torch.ones(4)) for g in got)  # ranks 0 and 1 go on
    finally:
        for client in clients:
            client.close()



@pytest.mark.slow
def test_a_peers_abort_text_reaches_the_log_escaped_and_cut(two_of_three: TwoOfThree) -> None:
    c = two_of_three
    clients = [dt.connect(f"unix://{s}", 60, local_rank=0) for s in c.sockets]
    try:
        port = bulk_port_as_rank_2(c.peers[0])
        forged = "\nFORGED log line " + "x" * 20_000
        abort = pb.BulkHeader(kind=pb.ABORT, parts=[pb.Part(name=at_worker("victim", 0), src=2)],
                              error=pb.Error(code=pb.MISMATCH, message=forged))
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(frame(pb.BulkHeader(kind=pb.HELLO, cluster_id="decent", from_rank=2)))
            until(lambda: any(p.rank == 2 and p.state == "up"
                              for p in clients[0].status().peers), "rank 2 up at rank 0")
            handle = clients[0].neighbor_allreduce_async(  # waits for rank 2, which never sends
                torch.ones(4), name="victim", self_weight=0.5, src_weights={2: 0.5},
                dst_weights=[], timeout=60, fuse=False)
            until(lambda: clients[0].status().ops_in_flight == 1, "the op waiting for rank 2")
            s.sendall(frame(abort))
            with pytest.raises(dt.DecentError) as failed:
                handle.wait()
        assert failed.value.code == pb.MISMATCH and "FORGED" in str(failed.value)
        lines = c.logs[0].read_text().splitlines()
        assert not any(line.startswith("FORGED") for line in lines)  # no line of the peer's
        mentions = [line for line in lines if "FORGED" in line]
        assert mentions and all(len(line) < 1024 for line in mentions), mentions
    finally:
        for client in clients:
            client.close()
