"""How a daemon reaches its peers at start: a gRPC handshake with each (cluster id, protocol
version, ranks, topology, workers per node), retried until the start timeout, then its bulk
connection, greeted with HELLO."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import grpc

from decent_wire import framing
from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.bulk import Sender, tune
from decentd.errors import StartupError
from decentd.links import GRPC_OPTIONS, Links, PeerLink, host_of

log = logging.getLogger("decentd.links")


async def connect_all(links: Links, timeout: float) -> None:
    """Handshake with every peer, retrying with backoff; StartupError names missing ranks."""
    deadline = time.monotonic() + timeout
    results = await asyncio.gather(
        *(_connect(links, link, deadline) for link in links.links.values()),
        return_exceptions=True,
    )
    fatal = [r for r in results if isinstance(r, StartupError)]
    if fatal:
        raise fatal[0]
    for r in results:
        if isinstance(r, BaseException):
            raise StartupError(f"connecting to peers failed: {r!r}") from r
    missing = sorted(link.rank for link in links.links.values() if not link.connected)
    if missing:
        where = ", ".join(f"{r} ({links.links[r].address})" for r in missing)
        raise StartupError(
            f"peers not reachable after {timeout:.0f}s start timeout: rank(s) {where}"
        )


async def _connect(links: Links, link: PeerLink, deadline: float) -> None:
    link.channel = grpc.aio.insecure_channel(link.address, options=GRPC_OPTIONS)
    reply = await _handshake(links, link, pb_grpc.PeerStub(link.channel), deadline)
    if reply is None:
        return
    try:
        sock = await _open(host_of(link.address), int(reply.data_port))
    except OSError as exc:
        raise StartupError(f"rank {link.rank} at {link.address}: cannot open the bulk "
                           f"connection to port {reply.data_port}: {exc}") from None
    link.flow.credits = int(reply.window_bytes)
    link.sender = Sender(sock, asyncio.get_running_loop(), link.rank)
    link.sender.send([framing.encode(pb.BulkHeader(kind=pb.HELLO, cluster_id=links.cluster_id,
                                                   from_rank=links.rank))])
    link.connected = True
    link.last_heartbeat = time.monotonic()
    log.debug("connected to rank %d at %s (bulk port %d)", link.rank, link.address,
              reply.data_port)


async def _handshake(links: Links, link: PeerLink, stub: pb_grpc.PeerStub,
                     deadline: float) -> pb.HandshakeReply | None:
    """The peer's handshake reply, retried until ``deadline`` (None: not reachable)."""
    delay = 0.05
    request = pb.HandshakeRequest(cluster_id=links.cluster_id,
                                  protocol_version=PROTOCOL_VERSION, from_rank=links.rank,
                                  to_rank=link.rank, topology_digest=links.topology_digest,
                                  workers_per_node=links.per_node,
                                  machine_topology_digest=links.machine_digest)
    while True:
        try:
            reply: pb.HandshakeReply = await stub.Handshake(
                request, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        except grpc.aio.AioRpcError as exc:
            if time.monotonic() + delay >= deadline:
                log.error("rank %d at %s: %s", link.rank, link.address, exc.code().name)
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
            continue
        if reply.error.code != pb.OK:
            raise StartupError(
                f"handshake with rank {link.rank} at {link.address} refused: "
                f"{pb.ErrorCode.Name(reply.error.code)}: {reply.error.message}"
            )
        return reply


async def _open(host: str, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    tune(sock)
    sock.setblocking(True)  # the sender thread writes with blocking calls
    return sock
