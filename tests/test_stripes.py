"""Striped links (issue 44, point 2): one peer link over several TCP connections.

The split and the automatic connection count are checked exactly; the receiving side's
reassembly is driven in-process (frames fed to real ``Inbound`` parsers, in every order the
connections may deliver them); real daemons on loopback then move tensors over 3 connections per
link, eager and announced, in the clear, in secret mode and over TLS, with exact results.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import test_hostile_input as hostile
import torch
from hypothesis import given
from hypothesis import strategies as st
from lone import secret_args, secret_file
from prometheus_client import CollectorRegistry
from test_hostile_input import feed
from test_security import PerRankCluster, make_certs, mtls_args

from cluster import Cluster
from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb
from decentd.net.inbound import Inbound
from decentd.net.stripes import (
    CHUNK,
    CHUNK_HEAD,
    MAX_EARLY,
    STRIPE_MIN,
    LaneSet,
    Pull,
    Striping,
    stripe_bytes,
)
from decentd.security.refusals import Refusals
from decentd.service.config import NodeConfig
from decentd.service.server import build_services

MIB = 1 << 20
#: daemons with 3 connections per link and room for the large tensors below
STRIPED = ("--set", "transport.stripes=3", "--set", f"memory.arena_bytes={512 * MIB}")


# ------------------------------------------------------------------ the split and the count


def test_auto_opens_what_the_round_trip_needs_and_one_connection_on_a_lan() -> None:
    auto = Striping(window=2 * MIB)  # 1 Gbit/s, 8 at most
    # 1 Gbit/s x RTT x 1.25 headroom / 2 MiB per flow, rounded up
    assert [auto.count(rtt) for rtt in (0.0001, 0.005, 0.01, 0.02, 0.05, 0.1, 1.0)] == \
        [1, 1, 1, 2, 4, 8, 8]
    assert Striping(window=2 * MIB, rate_bps=100e6).count(0.1) == 1
    assert Striping(window=2 * MIB, max_stripes=5).count(0.1) == 5
    assert Striping(stripes=3, window=2 * MIB).count(0.0001) == 3


def test_the_kernel_window_is_half_the_smaller_buffer_maximum(tmp_path: Path) -> None:
    from decentd.net.stripes import kernel_window
    (tmp_path / "tcp_rmem").write_text("4096\t131072\t6291456\n")
    (tmp_path / "tcp_wmem").write_text("4096\t16384\t4194304\n")
    assert kernel_window(str(tmp_path)) == 2 * MIB
    (tmp_path / "tcp_wmem").write_text("4096\t16384\t67108864\n")
    assert kernel_window(str(tmp_path)) == 3 * MIB


@given(st.integers(0, 64 * MIB), st.integers(1, 64))
def test_the_main_connection_keeps_half_a_lanes_share(payload: int, stripes: int) -> None:
    striped = stripe_bytes(payload, stripes)
    if stripes == 1 or payload < STRIPE_MIN:
        assert striped == 0
    else:
        assert payload - striped == payload // (2 * stripes)


@given(st.lists(st.integers(1, 3 * CHUNK), min_size=1, max_size=4), st.integers(0, 7))
def test_chunks_taken_by_turns_tile_the_striped_bytes_once(sizes: list[int], seq: int) -> None:
    data = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    done: list[int] = []
    pull = Pull(seq, [memoryview(d) for d in data], lambda: done.append(1))
    got, at = b"", 0
    while (chunk := pull.take()) is not None:
        offset, buffers = chunk
        head = CHUNK_HEAD.unpack(buffers[0])
        body = b"".join(bytes(b) for b in buffers[1:])
        assert head == (seq, offset, len(body)) and offset == at and 0 < len(body) <= CHUNK
        got, at = got + body, at + len(body)
        assert not done
        pull.wrote(len(body))
    assert got == b"".join(data) and done == [1]


# ------------------------------------------------------------------ reassembly, in-process


class Transport(hostile.Transport):
    """What an ``Inbound`` calls on its transport: whether it reads, whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True

    def pause_reading(self) -> None:
        assert self.reading
        self.reading = False

    def resume_reading(self) -> None:
        assert not self.reading
        self.reading = True


class Sink:
    """Records what an ``Inbound`` delivers; payloads go into fresh buffers."""

    def __init__(self) -> None:
        self.frames: list[tuple[pb.BulkHeader, bytes]] = []
        self.lost: list[str] = []
        self.buffers: list[np.ndarray] = []

    def on_header(self, conn: Inbound, header: pb.BulkHeader) -> np.ndarray | None:
        self.buffers.append(np.full(header.payload_bytes, 0xEE, np.uint8))
        return self.buffers[-1]

    def on_frame(self, conn: Inbound, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        self.frames.append((header, b"" if payload is None else payload.tobytes()))

    def on_progress(self, conn: Inbound, header: pb.BulkHeader, dest: np.ndarray,
                    filled: int) -> None:
        assert filled <= header.payload_bytes - header.stripe_bytes

    def on_lost(self, conn: Inbound, reason: str) -> None:
        self.lost.append(reason)


def striped_link(stripes: int) -> tuple[Sink, list[Inbound]]:
    """A main connection and its lanes, bound as their HELLOs bind them."""
    sink, lanes = Sink(), LaneSet(stripes, bundle=7)
    conns = [Inbound(cast(Any, sink)) for _ in range(stripes)]
    for i, conn in enumerate(conns):
        conn.transport = cast(asyncio.Transport, Transport())
        conn.src = 1
        if i:
            conn.lane = lanes.attach(i, conn)
    conns[0].lanes, lanes.main = lanes, conns[0]
    return sink, conns


def deliver(conns: list[Inbound], data: list[bytes], order: tuple[int, ...],
            piece: int) -> None:
    """Hand each connection its ``data`` as an event loop does: only while it reads, ``piece``
    bytes at a time, the first of ``order`` with something to read going first."""
    left = [memoryview(d) for d in data]
    while any(left):
        ready = [i for i in order if left[i] and cast(Transport, conns[i].transport).reading]
        assert ready, "every connection with bytes to read stopped reading"
        i = ready[0]
        feed(conns[i], bytes(left[i][:piece]))
        left[i] = left[i][piece:]


def streams(payloads: list[bytes], stripes: int, after: bytes = b"") -> list[bytes]:
    """What each connection carries for DATA frames of ``payloads`` (then ``after`` on the
    main connection), as a striped sender writes them: the lanes take chunks in turn."""
    out = [b""] * stripes
    for seq, payload in enumerate(payloads):
        striped = stripe_bytes(len(payload), stripes)
        header = pb.BulkHeader(kind=pb.DATA, message_id=seq, payload_bytes=len(payload),
                               stripe_bytes=striped)
        own = len(payload) - striped
        out[0] += framing.encode(header) + payload[:own]
        pull = Pull(seq, [payload[own:]], lambda: None)
        lane = 0
        while (chunk := pull.take()) is not None:
            out[1 + lane] += b"".join(bytes(b) for b in chunk[1])
            lane = (lane + 1 + seq) % (stripes - 1)  # an uneven turn per frame
    out[0] += after
    return out


PAYLOAD = bytes(np.random.default_rng(5).integers(0, 256, 3 * MIB + 11, np.uint8))
SECOND = bytes(np.random.default_rng(6).integers(0, 256, 2 * MIB + 5, np.uint8))
BEAT = framing.encode(pb.BulkHeader(kind=pb.ACK))  # a heartbeat


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))),
                         ids=lambda o: "-".join(map(str, o)))
def test_a_striped_frame_is_whole_and_in_order_whatever_connection_comes_first(
        order: tuple[int, ...]) -> None:
    sink, conns = striped_link(3)
    deliver(conns, streams([PAYLOAD, SECOND], 3, after=BEAT), order, 1 << 16)
    assert [h.kind for h, _ in sink.frames] == [pb.DATA, pb.DATA, pb.ACK]
    assert [p for _, p in sink.frames[:2]] == [PAYLOAD, SECOND]
    assert all(cast(Transport, c.transport).reading for c in conns)  # none left waiting
    assert not sink.lost


def test_lanes_bytes_interleaved_in_small_pieces_land_in_place() -> None:
    sink, conns = striped_link(4)
    deliver(conns, streams([PAYLOAD, SECOND], 4), (3, 1, 2, 0), 4096)  # lanes first
    assert [p for _, p in sink.frames] == [PAYLOAD, SECOND]


def test_a_lane_that_sends_what_no_frame_announced_is_closed_with_its_link() -> None:
    sink, conns = striped_link(2)
    feed(conns[1], CHUNK_HEAD.pack(0, 0, 10) + bytes(MAX_EARLY))  # frame 0 may still come
    assert not sink.lost
    feed(conns[1], b"x")
    assert cast(Transport, conns[1].transport).aborted
    assert cast(Transport, conns[0].transport).aborted  # the link goes whole
    assert any("for frames not announced" in why for why in sink.lost)


@pytest.mark.parametrize("head", [(0, 0, 0), (0, 2 * MIB, 4), (0, 0, 3 * MIB)],
                         ids=["empty", "past-the-end", "longer-than-striped"])
def test_a_chunk_outside_its_frame_closes_the_link(head: tuple[int, int, int]) -> None:
    sink, conns = striped_link(2)
    feed(conns[0], streams([SECOND], 2)[0])
    feed(conns[1], CHUNK_HEAD.pack(*head))
    assert cast(Transport, conns[0].transport).aborted and not sink.frames
    assert any("striped bytes" in why for why in sink.lost)


@pytest.mark.parametrize("second", [(0, 0, CHUNK), (0, CHUNK // 2, CHUNK)],
                         ids=["twice", "misaligned"])
def test_a_chunk_sent_twice_or_off_the_chunk_grid_closes_the_link(
        second: tuple[int, int, int]) -> None:
    # a chunk over bytes already given would leave others never written (stale buffer bytes
    # delivered as data): each chunk is at a multiple of CHUNK, and comes once
    sink, conns = striped_link(2)
    feed(conns[0], streams([SECOND], 2)[0])
    feed(conns[1], CHUNK_HEAD.pack(0, 0, CHUNK) + bytes(CHUNK) + CHUNK_HEAD.pack(*second))
    assert cast(Transport, conns[0].transport).aborted and not sink.frames
    assert any("each once" in why for why in sink.lost)


def test_a_chunk_of_a_frame_already_whole_closes_the_link() -> None:
    sink, conns = striped_link(2)
    data = streams([SECOND], 2)
    feed(conns[0], data[0])
    feed(conns[1], data[1] + CHUNK_HEAD.pack(0, 0, 4))
    assert len(sink.frames) == 1 and "which is complete" in sink.lost[0]


def test_striped_bytes_on_a_link_without_lanes_close_it() -> None:
    sink = Sink()
    conn = Inbound(cast(Any, sink))
    conn.transport, conn.src = cast(asyncio.Transport, Transport()), 1
    feed(conn, streams([PAYLOAD], 3)[0])
    assert cast(Transport, conn.transport).aborted and not sink.frames
    assert "striped bytes of a" in sink.lost[0] and "1 connection(s)" in sink.lost[0]


def test_a_frame_redirected_while_its_lanes_arrive_goes_on_into_the_new_buffer() -> None:
    sink, conns = striped_link(3)
    data = streams([PAYLOAD], 3)
    feed(conns[0], data[0])  # the main share is in; the op stops waiting for it
    dest = sink.buffers[0]
    assert conns[0].receiving_into(dest)
    into = np.zeros_like(dest)
    assert conns[0].redirect(dest, into)
    feed(conns[1], data[1])
    feed(conns[2], data[2])
    own = len(PAYLOAD) - stripe_bytes(len(PAYLOAD), 3)
    assert into[own:].tobytes() == PAYLOAD[own:]  # the lanes' shares went to the new buffer
    assert sink.frames[0][1][own:] == PAYLOAD[own:]


def hello(stripe: int, stripes: int, bundle: int = 9) -> bytes:
    return framing.encode(pb.BulkHeader(kind=pb.HELLO, cluster_id="decent", from_rank=1,
                                        stripe=stripe, stripes=stripes, bundle=bundle))


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Any]:
    """Daemon 0's real receiver and links (no sockets), rank 1's connections fed by hand."""
    cfg = NodeConfig(peers=["127.0.0.1:1", "127.0.0.1:2"], rank=0,
                     socket=str(tmp_path / "d.sock"))
    services, receiver, _ = build_services(cfg, 0, Refusals(CollectorRegistry()))
    yield receiver, services.links


def connection(receiver: Any, links: Any, greeting: bytes) -> tuple[Inbound, Transport]:
    conn, transport = Inbound(receiver, links.gate), Transport()
    conn.transport = cast(asyncio.Transport, transport)

    async def fed() -> None:  # the gate's timer needs a running loop
        links.gate.opened(conn, "127.0.0.1")
        feed(conn, greeting)
    asyncio.run(fed())
    return conn, transport


def test_hellos_bind_a_link_and_its_lanes_in_any_order(receiver: Any) -> None:
    recv, links = receiver
    lane, lane_t = connection(recv, links, hello(2, 3))  # a lane before its main connection
    main, main_t = connection(recv, links, hello(0, 3))
    other, other_t = connection(recv, links, hello(1, 3))
    assert not (lane_t.aborted or main_t.aborted or other_t.aborted)
    link = links.links[1]
    assert link.inbound is main and main.lanes is link.lanes and link.lanes.main is main
    assert [x.reader for x in link.lanes.lanes] == [other, lane]
    _, again = connection(recv, links, hello(2, 3))  # a second one for a bound lane
    _, stale = connection(recv, links, hello(1, 3, bundle=8))  # an older opening's
    _, beyond = connection(recv, links, hello(3, 3, bundle=10))
    assert again.aborted and stale.aborted and beyond.aborted


# ------------------------------------------------------------------ real daemons


@pytest.fixture(scope="module")
def striped() -> Iterator[Cluster]:
    c = Cluster(2, "ring", *STRIPED)
    try:
        c.connect()
        yield c
    finally:
        c.kill()


SIZES = [1000, MIB // 4, 3 * MIB // 4 + 1, 16 * MIB // 4 + 3, 40 * MIB // 4 + 1]


def test_tensors_cross_a_striped_link_exactly(striped: Cluster) -> None:
    def work(cl: Any) -> list[torch.Tensor]:
        out = []
        for n in SIZES:  # under the threshold, at it, eager, and announced (RTS) sizes
            x = torch.arange(n, dtype=torch.float32) + 1000 * cl.rank
            out.append(cl.neighbor_allreduce(x, name=f"s{n}"))
            cl.neighbor_allreduce_(x, name=f"i{n}")
            out.append(x)
        ints = torch.arange(5 * MIB // 4 + 7, dtype=torch.int32) * (cl.rank + 1)
        out.append(cl.allreduce(ints, name="ring", average=False))  # the ring's chunks
        return out

    for got in striped.run(work):
        for i, n in enumerate(SIZES):
            want = torch.arange(n, dtype=torch.float32) + 500
            assert torch.equal(got[2 * i], want) and torch.equal(got[2 * i + 1], want)
        assert torch.equal(got[-1], torch.arange(5 * MIB // 4 + 7, dtype=torch.int32) * 3)
    for i in range(2):
        peer = striped.status(i).peers[0]
        assert peer.stripes == 3 and peer.connect_rtt_ms > 0
        assert peer.bytes_sent >= 2 * 4 * sum(SIZES)


def test_auto_opens_one_connection_on_loopback() -> None:
    c = Cluster(2, "ring")
    try:
        c.connect()
        assert [c.status(i).peers[0].stripes for i in range(2)] == [1, 1]
    finally:
        c.kill()


def test_auto_sizes_from_the_kernels_round_trip_not_the_event_loops() -> None:
    """A connect that a busy loop saw end 200 ms late (daemons starting together on a loaded
    host measured up to 15 ms on a LAN, and striped it) counts the kernel's round trip."""
    import socket

    from decentd.net.dial import kernel_rtt

    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as sock:
        rtt = kernel_rtt(sock, 0.2)
    assert 0 < rtt < 0.01
    lan = Striping(window=1 << 20)
    assert lan.count(0.2) == 8 and lan.count(rtt) == 1
    left, right = socket.socketpair()  # no TCP_INFO: what the loop saw
    with left, right:
        assert kernel_rtt(left, 0.2) == 0.2


def test_secret_mode_proves_every_connection_of_a_striped_link(tmp_path: Path) -> None:
    c = Cluster(2, "ring", *STRIPED, *secret_args(secret_file(tmp_path)))
    try:
        c.connect()
        got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((MIB,), float(cl.rank)),
                                                     name="sec.striped"))
        assert all(torch.equal(g, torch.full((MIB,), 0.5)) for g in got)
        assert c.status(0).peers[0].stripes == 3
    finally:
        c.kill()


def test_tls_carries_every_connection_of_a_striped_link(tmp_path: Path) -> None:
    pki = make_certs(tmp_path, 2)
    c = PerRankCluster(2, [(*STRIPED, *mtls_args(pki, r)) for r in range(2)])
    try:
        c.connect()
        got = c.run(lambda cl: cl.neighbor_allreduce(torch.full((MIB,), float(cl.rank)),
                                                     name="tls.striped"))
        assert all(torch.equal(g, torch.full((MIB,), 0.5)) for g in got)
        assert c.status(1).peers[0].stripes == 3
        assert "bulk over TLS" in c.log(0)
    finally:
        c.kill()
