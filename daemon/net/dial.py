"""How a daemon reaches one peer (at start, and again after the link dropped): a gRPC handshake
(cluster id, protocol version, ranks, topology, workers per node, incarnation; in secret mode
after a challenge-response both ways, :mod:`decentd.security.auth`), retried until a deadline, then
its bulk connection, greeted with a HELLO that proves the handshake's session key. A link whose
round trip (measured as that connection opens) needs it opens more connections, its lanes
(:mod:`decentd.net.stripes`), each greeted the same way. Who calls it when is
:mod:`decentd.membership.liveness`."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import ssl
import struct
import time
from collections.abc import Callable

import grpc

from decent_wire import framing
from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.errors import StartupError
from decentd.net.grpc_options import PEER_CHANNEL_OPTIONS
from decentd.net.inbound import tune
from decentd.net.links import Links
from decentd.net.outbound import Sender
from decentd.net.peer import PeerLink, host_of
from decentd.security.auth import new_nonce, shown

log = logging.getLogger("decentd.net.links")

#: where Linux's ``struct tcp_info`` holds ``tcpi_rtt``, the smoothed round trip in microseconds
TCPI_RTT = struct.Struct("=I")
TCPI_RTT_OFFSET = 68


async def connect_peer(links: Links, link: PeerLink, deadline: float, was_down: bool = False,
                       on_broken: Callable[[Sender, BaseException], None] | None = None,
                       serving: bool = False) -> pb.HandshakeReply:
    """Handshake with ``link``'s peer (retried until ``deadline``) and open our bulk connection
    to it, greeted with a HELLO; the peer's reply (its incarnation, whether it serves a job).
    ConnectionError when it cannot be reached in time; StartupError when it refuses us (another
    cluster, topology, secret). ``was_down``: we declared the peer down since it was last up;
    ``on_broken``: told when a write to the peer fails."""
    tls = links.auth.tls
    if link.channel is None:
        options = PEER_CHANNEL_OPTIONS
        link.channel = (grpc.aio.secure_channel(link.address, tls.channel_credentials(), options)
                        if tls is not None else
                        grpc.aio.insecure_channel(link.address, options))
    reply, key = await _handshake(links, link, pb_grpc.PeerStub(link.channel), deadline,
                                  was_down, serving)
    key = key or bytes(reply.bulk_key)
    hello = pb.BulkHeader(kind=pb.HELLO, cluster_id=links.cluster_id, from_rank=links.rank,
                          bundle=secrets.randbits(63))
    bulk_tls = tls.client_context() if tls is not None and tls.encrypt_bulk else None
    host, port = host_of(link.address), int(reply.data_port)
    socks: list[socket.socket] = []

    async def greeted(stripe: int) -> None:
        # each says HELLO at once: it leaves the peer's bound on unproven connections at once
        sock, rtt = await _open(host, port, bulk_tls)
        socks.append(sock)
        if stripe == 0:
            link.connect_rtt = rtt
            hello.stripes = links.striping.count(rtt)
        sock.sendall(framing.encode(_greeting(links, link, hello, key, stripe)))

    try:
        await greeted(0)
        await asyncio.gather(*(greeted(i) for i in range(1, hello.stripes)))
    except BaseException as exc:
        for sock in socks:
            sock.close()
        if not isinstance(exc, OSError):
            raise
        raise ConnectionError(f"rank {link.rank} at {link.address}: cannot open the bulk "
                              f"connection to port {port}: {exc}") from None
    link.flow.credits = int(reply.window_bytes)
    link.sender = Sender(socks[0], asyncio.get_running_loop(), link.rank, on_broken, socks[1:])
    link.connected = True
    link.last_heartbeat = time.monotonic()
    log.debug("connected to rank %d at %s (bulk port %d, %d connection(s), %.1f ms)",
              link.rank, link.address, reply.data_port, hello.stripes,
              link.connect_rtt * 1e3)
    return reply


def _greeting(links: Links, link: PeerLink, hello: pb.BulkHeader, key: bytes,
              stripe: int) -> pb.BulkHeader:
    """``hello`` for connection ``stripe`` of the link, with its proof of ``key``."""
    hello.stripe = stripe
    hello.proof = links.auth.hello_proof(key, links.rank, link.rank, hello)
    return hello


async def _handshake(links: Links, link: PeerLink, stub: pb_grpc.PeerStub, deadline: float,
                     was_down: bool, serving: bool) -> tuple[pb.HandshakeReply, bytes]:
    """The peer's handshake reply and the session key of secret mode (empty otherwise),
    retried until ``deadline``; ConnectionError saying why it was not reached (refused, or no
    answer in time)."""
    delay = 0.05
    request = pb.HandshakeRequest(cluster_id=links.cluster_id,
                                  protocol_version=PROTOCOL_VERSION, from_rank=links.rank,
                                  to_rank=link.rank, topology_digest=links.topology_digest,
                                  workers_per_node=links.per_node,
                                  machine_topology_digest=links.machine_digest,
                                  incarnation=links.incarnation, was_down=was_down,
                                  serving=serving)
    while True:
        timeout = max(0.1, min(2.0, deadline - time.monotonic()))
        try:
            key = await _prove(links, link, stub, request, timeout)
            reply: pb.HandshakeReply = await stub.Handshake(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            # refused (nobody listens: the caller tries again later) or out of time
            if exc.code() == grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay >= deadline:
                log.debug("rank %d at %s: %s", link.rank, link.address, exc.code().name)
                why = ("refused or unreachable" if exc.code() == grpc.StatusCode.UNAVAILABLE
                       else "did not answer in time")
                raise ConnectionError(f"rank {link.rank} at {link.address} {why} "
                                      f"({exc.code().name})") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
            continue
        if reply.error.code != pb.OK:
            raise StartupError(
                f"handshake with rank {link.rank} at {link.address} refused: "
                f"{pb.ErrorCode.Name(reply.error.code)}: {shown(reply.error.message, 400)}"
            )
        return reply, key


async def _prove(links: Links, link: PeerLink, stub: pb_grpc.PeerStub,
                 request: pb.HandshakeRequest, timeout: float) -> bytes:
    """Secret mode: the challenge-response before ``request`` (its proof filled in); the
    session key. Nothing in other modes. StartupError when the peer does not prove it holds
    the cluster secret."""
    if links.auth.mode != "secret":
        return b""
    nonce = new_nonce()
    reply: pb.ChallengeReply = await stub.Challenge(pb.ChallengeRequest(
        cluster_id=links.cluster_id, from_rank=links.rank, to_rank=link.rank,
        client_nonce=nonce), timeout=timeout)
    where = f"rank {link.rank} at {link.address}"
    if reply.error.code != pb.OK:
        raise StartupError(f"{where} refused our challenge: "
                           f"{pb.ErrorCode.Name(reply.error.code)}: "
                           f"{shown(reply.error.message, 400)}")
    if not links.auth.server_proof_ok(links.rank, link.rank, nonce, reply.server_nonce,
                                      reply.server_proof):
        raise StartupError(f"{where} does not hold this cluster's secret (another "
                           "security.secret_file?)")
    request.server_nonce = reply.server_nonce
    request.proof, key = links.auth.client_proof(links.rank, link.rank, nonce,
                                                 reply.server_nonce)
    return key


async def _open(host: str, port: int,
                tls: ssl.SSLContext | None) -> tuple[socket.socket, float]:
    """A tuned, blocking bulk connection to ``host:port`` (over TLS with ``tls``, the peer's
    certificate checked against ``host``), and the seconds its TCP handshake took (one round
    trip as the kernel measured it, :func:`kernel_rtt`; name lookup and TLS not counted)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    try:
        start = time.monotonic()
        await loop.sock_connect(sock, addr)
        rtt = kernel_rtt(sock, time.monotonic() - start)
    except BaseException:
        sock.close()
        raise
    tune(sock)
    sock.setblocking(True)  # the sender thread writes with blocking calls
    if tls is None:
        return sock, rtt
    try:  # the handshake blocks: off the event loop, which serves the peer's side of ours
        return await loop.run_in_executor(None, functools.partial(
            tls.wrap_socket, sock, server_hostname=host)), rtt
    except BaseException:
        sock.close()
        raise


def kernel_rtt(sock: socket.socket, waited: float) -> float:
    """The round trip of ``sock``'s handshake as the kernel timed it (``TCP_INFO``), else
    ``waited``, the seconds the event loop saw the connect take: on a busy host that counts
    the loop's own delays too (tens of milliseconds on a LAN), enough for "auto" to stripe a
    link that does not need it."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError):  # not Linux
        return waited
    if len(info) < TCPI_RTT_OFFSET + TCPI_RTT.size:
        return waited
    micros = TCPI_RTT.unpack_from(info, TCPI_RTT_OFFSET)[0]
    return min(waited, micros / 1e6) if micros else waited
