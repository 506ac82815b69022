"""Daemon-to-daemon transport: gRPC for control, the bulk path for data, and message matching.

gRPC carries the handshake (cluster id, protocol version, ranks, the bulk port and receive window)
and heartbeats. Tensor data goes over :mod:`decentd.bulk` connections, one per direction of each
peer pair. A message has one or more *parts*, each a tensor keyed ``(sender, name, round, tag)``;
each part is handed to the op that waits for its key, whatever other parts travelled with it (so
two ranks may fuse the same tensors into different messages).

Memory is bounded by credit: a sender may have at most the receiver's window of eagerly sent bytes
that the receiver has not consumed yet. A message that does not fit goes as RTS (header only); the
receiver answers CTS once an op that takes it is running, and the payload then lands directly in
memory that op consumes. Received payloads live in pooled buffers that are reused step after step.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import itertools
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import numpy as np

from decentd import PROTOCOL_VERSION
from decentd.bufpool import BufferPool
from decentd.bulk import Buffer, Inbound, Outgoing, Sender, encode, tune
from decentd.errors import OpError, StartupError
from decentd.wire import pb, pb_grpc

log = logging.getLogger("decentd.transport")

#: (sender or receiver rank, op name, round, tag)
Key = tuple[int, str, int, int]
#: told ``(payload so far, bytes arrived, sender's weight, part)`` while a lone part arrives
Progress = Callable[[np.ndarray, int, float, pb.Part], None]

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
    # peers start in any order: retry a peer that is not up yet soon, not after gRPC's 1 s
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

#: a cancelled op whose half-written message is still not out after this long says so in the log
WRITE_GRACE = 5.0
#: credit owed to a peer is sent on its own after this long if no other frame carried it
CREDIT_DELAY = 0.002
#: the smallest receive window a peer gets, however many peers share the early-arrival budget
MIN_WINDOW = 1 << 20

#: separates the job id from the op name in wire keys (a character no sane name contains)
JOB_SEPARATOR = "\x1f"


def qualify(job: str, name: str) -> str:
    """The wire key of op ``name`` in job ``job``."""
    return f"{job}{JOB_SEPARATOR}{name}" if job else name


def host_of(address: str) -> str:
    """The host part of a ``host:port`` peer address (IPv6 without its brackets)."""
    return address.rsplit(":", 1)[0].strip("[]")


def _is_loopback(address: str) -> bool:
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def display_name(wire_name: str) -> str:
    """The user's op name inside a wire key (for messages)."""
    return wire_name.rsplit(JOB_SEPARATOR, 1)[-1]


@dataclass(eq=False)
class _Message:
    """A received payload shared by its parts; its buffer goes back to the pool with the last."""

    src: int
    buf: np.ndarray | None
    refs: int
    credit: int  # eager bytes to give back to the sender when released


@dataclass(eq=False)
class Arrival:
    """One part (a tensor) of a message from a peer."""

    src: int
    op: int
    dtype: int
    shape: tuple[int, ...]
    weight: float
    data: np.ndarray  # uint8, exactly this part's bytes
    message: _Message | None = None
    released: bool = False
    acked: bool = False  # the sender was told at header time that this part matched
    step: int = 0  # window ops: the writer's step


@dataclass(eq=False)
class _Rendezvous:
    """A message of ours waiting for the receiver's CTS."""

    payload: list[memoryview]
    name: str
    done: asyncio.Future[None]
    item: Outgoing | None = None


@dataclass
class PeerLink:
    """Everything about one peer: control channel, bulk connections, credit, counters."""

    rank: int
    address: str
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.PeerStub | None = None
    sender: Sender | None = None
    inbound: Inbound | None = None
    connected: bool = False  # our connection to the peer is up
    inbound_lost: bool = False  # the peer's connection to us was up and ended
    last_heartbeat: float = 0.0  # when the peer was last heard from (any frame)
    heartbeat_mark: int = -1  # bytes sent to the peer at the last heartbeat tick
    credits: int = 0  # eager bytes we may still send before the peer consumes some
    rendezvous: dict[int, _Rendezvous] = field(default_factory=dict)
    owed: int = 0  # credit for consumed payloads not yet given back
    unconsumed: int = 0  # eager bytes received from the peer and not consumed yet
    owed_flush: bool = False
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    acks_early: int = 0  # parts acknowledged to the peer before their payload had all arrived
    acks_late: int = 0  # parts acknowledged only after: the op here started after the arrival

    @property
    def bytes_sent(self) -> int:
        """Bytes written to the peer's bulk connection."""
        return self.sender.bytes_sent if self.sender is not None else 0

    @property
    def bytes_received(self) -> int:
        """Bytes read from the peer's bulk connection."""
        return self.inbound.bytes_received if self.inbound is not None else 0


def _accepts(p: pb.Part) -> tuple[int, int, tuple[int, ...]]:
    """What an op must accept to take part ``p``: (op, dtype, shape)."""
    return int(p.op), int(p.meta.dtype), tuple(int(s) for s in p.meta.shape)


def part(name: str, round_: int, tag: int, op: int, dtype: int, shape: tuple[int, ...],
         nbytes: int, weight: float = 1.0) -> pb.Part:
    """The wire description of one tensor of a message."""
    return pb.Part(name=name, round=round_, tag=tag, op=op,
                   meta=pb.TensorMeta(dtype=dtype, shape=shape), weight=weight, nbytes=nbytes)


class Transport:
    """All peer links of one daemon plus the matching of incoming parts to waiting ops."""

    def __init__(
        self,
        rank: int,
        addresses: list[str],
        cluster_id: str,
        early_limit: int,
        on_abort: Callable[[int, str, int, pb.Error], None],
        on_peer_down: Callable[[int, str], None],
        is_running: Callable[[str, int], bool],
        on_unexpected: Callable[[int, str, int, int, Arrival], None],
        pool_limit: int | None = None,
    ) -> None:
        self.rank = rank
        self.cluster_id = cluster_id
        self.early_limit = early_limit
        self._is_running = is_running
        self._on_unexpected = on_unexpected
        self._on_abort = on_abort
        self._on_peer_down = on_peer_down
        self.links = {r: PeerLink(r, a) for r, a in enumerate(addresses) if r != rank}
        self._loopback = [_is_loopback(a) for a in addresses]
        self.window = max(MIN_WINDOW, early_limit // max(1, len(self.links)))
        self.pool = BufferPool(limit=pool_limit if pool_limit is not None else early_limit)
        self.data_port = 0
        #: Topology.digest() of this daemon's topology: peers must have the same
        self.topology_digest = ""
        self._server: asyncio.Server | None = None
        self._waiters: dict[Key, asyncio.Future[Arrival]] = {}
        #: what a waiting op accepts (op, dtype, shape) where it wants the sender acknowledged
        self._ackable: dict[Key, tuple[int, int, tuple[int, ...]]] = {}
        self._acked: set[Key] = set()
        #: parts whose payload is arriving (header read, payload not yet complete), and the keys
        #: of each connection's arriving frame: an op that starts meanwhile acknowledges at once
        self._arriving: dict[Key, pb.Part] = {}
        self._arriving_on: dict[Inbound, list[Key]] = {}
        #: ops that fold a tensor in while it is still arriving: key -> (buffer, bytes, weight)
        self._progress: dict[Key, Progress] = {}
        #: ops whose result is the incoming tensor itself: received straight into their output
        self._into: dict[Key, tuple[np.ndarray, tuple[int, int, tuple[int, ...]]]] = {}
        self._direct: set[tuple[int, int, int]] = set()  # (src, message id, kind) received so
        #: direct receives in progress: key -> (connection, the op's output buffer, frame id)
        self._direct_active: dict[Key, tuple[Inbound, np.ndarray, tuple[int, int, int]]] = {}
        self._early: dict[Key, Arrival] = {}
        self._held: dict[tuple[str, int], list[Arrival]] = {}
        self._acks: dict[Key, asyncio.Future[None]] = {}
        self._rts: dict[tuple[int, int], pb.BulkHeader] = {}  # (src, message id): awaiting CTS
        self._rts_keys: dict[Key, tuple[int, int]] = {}
        self._cts_sent: dict[tuple[int, int], pb.BulkHeader] = {}
        #: payloads cleared to send whose ops all ended here: read and dropped if they come
        self._discard: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self._closed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self.early_bytes = 0
        #: one-sided window messages (put, accumulate, get) go here instead of to an op:
        #: (src, name, round, arrival); the handler releases the arrival
        self.on_one_sided: Callable[[int, str, int, Arrival], None] | None = None
        #: a group leader could not sum a group round: (name, group round, error)
        self.on_group_failed: Callable[[str, int, pb.Error], None] | None = None

    # ------------------------------------------------------------------ connection setup

    async def start_server(self, host: str, port: int = 0) -> int:
        """Listen for bulk connections on ``host`` (port 0: any free one); returns the port."""
        loop = asyncio.get_running_loop()
        bind = None if host in ("", "0.0.0.0", "[::]", "::") else host.strip("[]")
        self._server = await loop.create_server(lambda: Inbound(self), bind, port,
                                                reuse_address=True)
        self.data_port = int(self._server.sockets[0].getsockname()[1])
        return self.data_port

    async def connect_all(self, timeout: float) -> None:
        """Handshake with every peer, retrying with backoff; StartupError names missing ranks."""
        deadline = time.monotonic() + timeout
        results = await asyncio.gather(
            *(self._connect(link, deadline) for link in self.links.values()),
            return_exceptions=True,
        )
        fatal = [r for r in results if isinstance(r, StartupError)]
        if fatal:
            raise fatal[0]
        for r in results:
            if isinstance(r, BaseException):
                raise StartupError(f"connecting to peers failed: {r!r}") from r
        missing = sorted(link.rank for link in self.links.values() if not link.connected)
        if missing:
            where = ", ".join(f"{r} ({self.links[r].address})" for r in missing)
            raise StartupError(
                f"peers not reachable after {timeout:.0f}s start timeout: rank(s) {where}"
            )

    async def _connect(self, link: PeerLink, deadline: float) -> None:
        delay = 0.05
        link.channel = grpc.aio.insecure_channel(link.address, options=GRPC_OPTIONS)
        link.stub = pb_grpc.PeerStub(link.channel)
        while True:
            try:
                reply = await link.stub.Handshake(
                    pb.HandshakeRequest(
                        cluster_id=self.cluster_id,
                        protocol_version=PROTOCOL_VERSION,
                        from_rank=self.rank,
                        to_rank=link.rank,
                        topology_digest=self.topology_digest,
                    ),
                    timeout=max(0.1, min(2.0, deadline - time.monotonic())),
                )
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() + delay >= deadline:
                    log.error("rank %d at %s: %s", link.rank, link.address, exc.code().name)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
                continue
            if reply.error.code != pb.OK:
                raise StartupError(
                    f"handshake with rank {link.rank} at {link.address} refused: "
                    f"{pb.ErrorCode.Name(reply.error.code)}: {reply.error.message}"
                )
            break
        host = host_of(link.address)
        loop = asyncio.get_running_loop()
        try:
            sock = await self._open(host, int(reply.data_port), loop)
        except OSError as exc:
            raise StartupError(f"rank {link.rank} at {link.address}: cannot open the bulk "
                               f"connection to port {reply.data_port}: {exc}") from None
        link.credits = int(reply.window_bytes)
        link.sender = Sender(sock, loop, link.rank)
        link.sender.send([encode(pb.BulkHeader(kind=pb.HELLO, cluster_id=self.cluster_id,
                                               from_rank=self.rank))])
        link.connected = True
        link.last_heartbeat = time.monotonic()
        log.debug("connected to rank %d at %s (bulk port %d)", link.rank, link.address,
                  reply.data_port)

    @staticmethod
    async def _open(host: str, port: int, loop: asyncio.AbstractEventLoop) -> socket.socket:
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

    def check_handshake(self, request: pb.HandshakeRequest) -> pb.Error | None:
        """Validate a peer's handshake; an Error to send back when it must be refused."""
        if request.cluster_id != self.cluster_id:
            return pb.Error(
                code=pb.CLUSTER_MISMATCH,
                message=f"rank {request.from_rank} is in cluster {request.cluster_id!r}, "
                f"this daemon (rank {self.rank}) is in {self.cluster_id!r}",
            )
        if request.protocol_version != PROTOCOL_VERSION:
            return pb.Error(
                code=pb.VERSION_MISMATCH,
                message=f"rank {request.from_rank} speaks protocol {request.protocol_version}, "
                f"rank {self.rank} speaks {PROTOCOL_VERSION}",
            )
        if request.to_rank != self.rank:
            return pb.Error(
                code=pb.RANK_MISMATCH,
                message=f"rank {request.from_rank} expected rank {request.to_rank} here, "
                f"but this daemon is rank {self.rank}",
            )
        if request.topology_digest != self.topology_digest:
            return pb.Error(
                code=pb.CLUSTER_MISMATCH,
                message=f"rank {request.from_rank} runs another topology than rank {self.rank} "
                f"(digest {request.topology_digest[:12] or 'none'} vs "
                f"{self.topology_digest[:12] or 'none'}): give every daemon the same topology "
                "settings (kind, scheme, options, weights)",
            )
        if request.from_rank not in self.links:
            return pb.Error(
                code=pb.RANK_MISMATCH,
                message=f"rank {request.from_rank} is not a peer of rank {self.rank}",
            )
        return None

    async def heartbeat_loop(self, interval: float) -> None:
        """Every ``interval`` seconds, send an empty frame on each bulk connection that carried
        nothing since the last tick, so that every peer hears from us at least every two
        intervals (its ``last_heartbeat``). Any frame counts, so busy links cost nothing, and
        an idle one costs one small write instead of a gRPC call: on 8 ranks the gRPC
        heartbeats took 13 ms of CPU per second per idle daemon, the frames take 1.3."""
        while True:
            await asyncio.sleep(interval)
            for link in self.links.values():
                if link.sender is None or not link.connected:
                    continue
                # a link that is busy, or stuck behind a peer that stopped reading, gets none:
                # heartbeats must not pile up in its queue
                if link.sender.bytes_sent == link.heartbeat_mark and link.sender.idle:
                    self._control(link.rank, pb.BulkHeader(kind=pb.ACK))
                link.heartbeat_mark = link.sender.bytes_sent

    async def close(self) -> None:
        """Close every connection and channel."""
        loop = asyncio.get_running_loop()
        senders = [link.sender for link in self.links.values() if link.sender is not None]
        await asyncio.gather(*(loop.run_in_executor(None, s.close) for s in senders))
        for link in self.links.values():
            link.connected = False
            if link.inbound is not None and link.inbound.transport is not None:
                link.inbound.transport.close()
            if link.channel is not None:
                await link.channel.close(grace=None)
        if self._server is not None:
            self._server.close()

    def same_host(self, peer: int) -> bool:
        """Both this daemon and ``peer`` are addressed on loopback in the cluster's peer list
        (which every daemon shares, so ``peer`` gives the same answer about this rank)."""
        return self._loopback[self.rank] and self._loopback[peer]

    # ------------------------------------------------------------------ sending

    def _link(self, dst: int, name: str) -> PeerLink:
        link = self.links.get(dst)
        if link is None or link.sender is None or not link.connected:
            raise OpError(
                pb.PEER_UNAVAILABLE,
                f"op '{display_name(name)}': rank {dst} is not connected to rank {self.rank}",
            )
        return link

    async def _write(self, link: PeerLink, buffers: list[Buffer], name: str,
                     refund: tuple[int, int] | None = None,
                     track: list[tuple[Outgoing, int]] | None = None, header: int = 0) -> None:
        """Write one frame to ``link`` and wait until the kernel has all of it.

        A frame is never abandoned half-way: its payload is read straight from the worker's arena
        slot, so a cancelled op waits for a frame already being written (a torn frame would break
        the stream, and a freed slot could send its next tensor under this key). A frame still
        queued when its op is cancelled is skipped.
        """
        assert link.sender is not None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done(err: BaseException | None) -> None:
            if isinstance(err, asyncio.CancelledError) and refund is not None:
                link.credits += refund[0]  # skipped: the peer never saw it
                link.owed += refund[1]
            _settle(fut, err, link.rank, name)

        item = link.sender.send(buffers, done)
        if item is not None and track is not None:
            track.append((item, header))  # (frame, header bytes): its payload's progress
        if item is not None:
            await self._await_write(fut, item, link, name)
        else:
            await fut

    @staticmethod
    async def _await_write(fut: asyncio.Future[None], item: Outgoing, link: PeerLink,
                           name: str) -> None:
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await Transport._abandon(fut, item, link, name)
            raise

    @staticmethod
    async def _abandon(fut: asyncio.Future[None], item: Outgoing, link: PeerLink,
                       name: str) -> None:
        """Skip a queued frame; wait (through cancellations) for one already being written."""
        if link.sender is None or not link.sender.abandon(item):
            return
        warned = False
        while not fut.done():
            try:
                await asyncio.wait({fut}, timeout=WRITE_GRACE)
            except asyncio.CancelledError:
                continue
            if not fut.done() and not warned:
                warned = True
                log.warning("op '%s': a message to rank %d is still being written %gs after "
                            "its op ended; rank %d is not reading: closing the connection",
                            display_name(name), link.rank, WRITE_GRACE, link.rank)
                link.connected = False
                if link.sender is not None:
                    link.sender.abort()

    async def send_parts(self, dst: int, parts: list[pb.Part], payload: list[memoryview],
                         track: list[tuple[Outgoing, int]] | None = None) -> None:
        """Send one message to ``dst``: ``parts`` with their bytes ``payload`` (one buffer per
        part, gathered by the kernel: nothing is copied into a message buffer).

        Returns once the kernel has every byte: eagerly when the receiver's window has room,
        otherwise after the receiver's CTS.
        """
        name = parts[0].name
        link = self._link(dst, name)
        payload = [b for b in payload if len(b)]
        size = sum(len(b) for b in payload)
        mid = next(link.ids)
        if size <= link.credits:
            link.credits -= size
            header = pb.BulkHeader(kind=pb.DATA, message_id=mid, payload_bytes=size, parts=parts)
            stamped = self._stamp(link, header)
            await self._write(link, [stamped, *payload], name, (size, int(header.credit)),
                              track, len(stamped))
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        rdv = _Rendezvous(payload, name, done)
        link.rendezvous[mid] = rdv
        try:
            await self._write(link, [self._stamp(link, pb.BulkHeader(kind=pb.RTS, message_id=mid,
                                                          payload_bytes=0, parts=parts))], name)
            await asyncio.shield(done)  # the CTS queues the payload; this is its write
        except BaseException:
            link.rendezvous.pop(mid, None)
            if rdv.item is not None and not done.done():  # the payload is queued or going out
                await self._abandon(done, rdv.item, link, name)
            raise

    def _on_cts(self, link: PeerLink, mid: int) -> None:
        rdv = link.rendezvous.pop(mid, None)
        if rdv is None or rdv.done.done() or link.sender is None:
            return  # its op gave up meanwhile
        size = sum(len(b) for b in rdv.payload)
        header = pb.BulkHeader(kind=pb.PAYLOAD, message_id=mid, payload_bytes=size)
        done = rdv.done
        item = link.sender.send([self._stamp(link, header), *rdv.payload],
                                lambda err: _settle(done, err, link.rank, rdv.name))
        rdv.item = item if item is not None else Outgoing([], None, started=True)

    async def send_data(
        self, dst: int, name: str, round_: int, tag: int, op: int, dtype: int,
        shape: tuple[int, ...], payload: memoryview, weight: float = 1.0,
    ) -> None:
        """Send one tensor to ``dst`` (a one-part message)."""
        await self.send_parts(
            dst, [part(name, round_, tag, op, dtype, shape, len(payload), weight)], [payload])

    def _control(self, dst: int, header: pb.BulkHeader) -> None:
        """Send a payload-free frame (best effort: a dead peer is ignored)."""
        link = self.links.get(dst)
        if link is None or link.sender is None or not link.connected:
            return
        link.sender.send([self._stamp(link, header)])

    def send_acks(self, dst: int, keys: list[tuple[str, int]], tag: int,
                  arrived: bool = False) -> None:
        """Tell ``dst`` that its parts ``(name, round)`` with ``tag`` were matched here;
        ``arrived``: only after their payload had all arrived (counted apart)."""
        link = self.links.get(dst)
        if link is not None:
            if arrived:
                link.acks_late += len(keys)
            else:
                link.acks_early += len(keys)
        self._control(dst, pb.BulkHeader(kind=pb.ACK, parts=[
            pb.Part(name=name, round=round_, tag=tag) for name, round_ in keys]))

    def send_abort(self, dst: int, keys: list[tuple[str, int]], error: pb.Error,
                   op: int = pb.OP_UNSPECIFIED) -> None:
        """Tell ``dst`` that the op of the tensors ``(name, round)`` failed here (``op``
        GROUP_RESULT: that a group round failed at its leader)."""
        self._control(dst, pb.BulkHeader(kind=pb.ABORT, error=error, parts=[
            pb.Part(name=name, round=round_, op=op) for name, round_ in keys]))

    # ------------------------------------------------------------------ receiving

    def expect(self, src: int, name: str, round_: int, tag: int,
               ack: tuple[int, int, tuple[int, ...]] | None = None,
               progress: Progress | None = None,
               into: tuple[np.ndarray, tuple[int, int, tuple[int, ...]]] | None = None
               ) -> asyncio.Future[Arrival]:
        """A future for the part ``(name, round, tag)`` from ``src``.

        ``ack``: the (op, dtype, shape) the op accepts. A part that arrives with exactly that is
        acknowledged as soon as its header is read, not after its payload: on a saturated link
        the acknowledgement then travels while the payload still does. A part already arriving
        (the op started after its header) is acknowledged now, for the same reason.
        ``progress`` is told how far a part that travels alone has arrived, while it arrives.
        ``into`` (a uint8 buffer of the part's size, and the (op, dtype, shape) the op accepts):
        a part with exactly that, travelling alone, is received straight into the buffer (no
        pooled buffer, no copy).
        """
        key = (src, name, round_, tag)
        fut: asyncio.Future[Arrival] = asyncio.get_running_loop().create_future()
        early = self._early.pop(key, None)
        if early is not None:
            self.early_bytes -= early.data.nbytes
            self._hold(name, round_, early)
            fut.set_result(early)
        else:
            self._waiters[key] = fut
            if ack is not None:
                arriving = self._arriving.get(key)
                if arriving is not None and ack == _accepts(arriving):
                    self._ack_before_payload(src, [(name, round_)], tag)
                else:
                    self._ackable[key] = ack
            if progress is not None:
                self._progress[key] = progress
            if into is not None:
                self._into[key] = into
            rts = self._rts_keys.get(key)
            if rts is not None:
                self._clear_to_send(rts)
        return fut

    def expect_ack(self, dst: int, name: str, round_: int, tag: int) -> asyncio.Future[None]:
        """A future resolved when ``dst`` acknowledges our part ``(name, round, tag)``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks[(dst, name, round_, tag)] = fut
        return fut

    def _hold(self, name: str, round_: int, arrival: Arrival) -> None:
        self._held.setdefault((name, round_), []).append(arrival)

    def release(self, arrival: Arrival) -> None:
        """The op is done with ``arrival``'s bytes (idempotent)."""
        if arrival.released:
            return
        arrival.released = True
        msg = arrival.message
        if msg is None:
            return
        msg.refs -= 1
        if msg.refs == 0:
            if msg.buf is not None:
                self.pool.put(msg.buf)
                msg.buf = None
            link = self.links.get(msg.src)
            if msg.credit and link is not None:
                link.unconsumed -= msg.credit
                # given back on the next frame to that peer, or by itself a moment later
                link.owed += msg.credit
                if not link.owed_flush:
                    link.owed_flush = True
                    asyncio.get_running_loop().call_later(CREDIT_DELAY, self._flush_credit, link)

    def _flush_credit(self, link: PeerLink) -> None:
        link.owed_flush = False
        if link.owed:
            self._control(link.rank, pb.BulkHeader(kind=pb.ACK))

    @staticmethod
    def _stamp(link: PeerLink, header: pb.BulkHeader) -> bytes:
        """The encoded frame header, carrying the credit we owe ``link``'s peer."""
        if link.owed:
            header.credit += link.owed
            link.owed = 0
        return encode(header)

    def close_ops(self, keys: list[tuple[str, int]]) -> None:
        """Forget everything about a finished op's tensors ``(name, round)``, in one pass over
        each table; later arrivals for them are dropped."""
        closing = set(keys)
        for key in keys:
            self._closed[key] = None
        while len(self._closed) > 65536:
            self._closed.popitem(last=False)
        for table in (self._waiters, self._acks):
            for k in [k for k in table if (k[1], k[2]) in closing]:
                fut = table.pop(k)
                if not fut.done():
                    fut.cancel()
        for k in [k for k in self._ackable if (k[1], k[2]) in closing]:
            del self._ackable[k]
        for k in [k for k in self._progress if (k[1], k[2]) in closing]:
            del self._progress[k]
        for k in [k for k in self._into if (k[1], k[2]) in closing]:
            del self._into[k]
        for k in [k for k in self._direct_active if (k[1], k[2]) in closing]:
            conn, dest, frame = self._direct_active.pop(k)
            # the op is over: the rest of its payload must not land in the worker's slot
            if conn.redirect(dest, self.pool.get(dest.nbytes)):
                self._direct.discard(frame)  # now a pooled buffer, dropped on arrival
        self._acked.difference_update([k for k in self._acked if (k[1], k[2]) in closing])
        for key in keys:
            for arrival in self._held.pop(key, ()):
                self.release(arrival)
        self._drop_early(closing)
        # a message cleared to send (or waiting for it) whose tensors are all closed here: its
        # payload is dropped if it still comes
        for rts in [r for r, h in self._rts.items()
                    if self._all_closed(h) and not _one_sided(h)]:
            del self._rts[rts]
        for rts in [r for r, h in self._cts_sent.items()
                    if self._all_closed(h) and not _one_sided(h)]:
            del self._cts_sent[rts]
            self._discard[rts] = None
        while len(self._discard) > 4096:
            self._discard.popitem(last=False)

    def _all_closed(self, header: pb.BulkHeader) -> bool:
        return all((p.name, int(p.round)) in self._closed for p in header.parts)

    def _drop_early(self, closing: set[tuple[str, int]]) -> None:
        for key in [k for k in self._early if (k[1], k[2]) in closing]:
            arrival = self._early.pop(key)
            self.early_bytes -= arrival.data.nbytes
            self.release(arrival)
        for key in [k for k in self._rts_keys if (k[1], k[2]) in closing]:
            self._rts_keys.pop(key, None)

    def forget_history(self) -> None:
        """Drop what finished or orphaned ops left behind (no local worker is left to use it)."""
        self._closed.clear()
        for key in list(self._early):
            arrival = self._early.pop(key)
            self.early_bytes -= arrival.data.nbytes
            self.release(arrival)
        self._discard.update((rts, None) for rts in self._cts_sent)
        self._cts_sent.clear()
        self._rts.clear()
        self._rts_keys.clear()

    def _deliver(self, key: Key, arrival: Arrival) -> None:
        name, round_ = key[1], key[2]
        if arrival.op in ONE_SIDED and key[3] == 0 and self.on_one_sided is not None:
            self.on_one_sided(key[0], name, round_, arrival)
            return
        if (name, round_) in self._closed:
            self.release(arrival)
            return
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            self._hold(name, round_, arrival)
            fut.set_result(arrival)
            return
        old = self._early.pop(key, None)
        if old is not None:  # a resend of the same key replaces the first copy
            self.early_bytes -= old.data.nbytes
            self.release(old)
        self._early[key] = arrival
        self.early_bytes += arrival.data.nbytes
        if self._is_running(name, round_):
            self._on_unexpected(key[0], name, round_, key[3], arrival)

    def _clear_to_send(self, rts: tuple[int, int]) -> None:
        header = self._rts.pop(rts, None)
        if header is None:
            return
        for p in header.parts:
            self._rts_keys.pop((rts[0], p.name, p.round, p.tag), None)
        self._cts_sent[rts] = header
        self._control(rts[0], pb.BulkHeader(kind=pb.CTS, message_id=rts[1]))

    # ------------------------------------------------------------------ the bulk sink

    def on_header(self, conn: Inbound, header: pb.BulkHeader) -> np.ndarray | None:
        """Where a frame's payload goes: a pooled buffer of exactly its size."""
        if conn.src < 0:
            raise ValueError("data before HELLO")
        kind = header.kind
        link = self.links[conn.src]
        parts = header.parts
        if kind == pb.PAYLOAD:
            rts = (conn.src, header.message_id)
            if rts not in self._cts_sent and rts not in self._discard:
                raise ValueError(f"a payload for message {header.message_id}, which was not "
                                 "cleared to send")
            parts = self._cts_sent[rts].parts if rts in self._cts_sent else parts
        elif kind == pb.DATA:
            if link.unconsumed + header.payload_bytes > self.window:
                raise ValueError(f"rank {conn.src} sent {header.payload_bytes} eager bytes with "
                                 f"{link.unconsumed} of its {self.window}-byte window in use")
            link.unconsumed += int(header.payload_bytes)
        else:
            raise ValueError(f"a payload on a frame of kind {kind}")
        if self._ackable:
            self._ack_early(conn.src, parts)
        keys = [(conn.src, p.name, int(p.round), int(p.tag)) for p in parts]
        self._arriving.update(zip(keys, parts, strict=True))
        self._arriving_on[conn] = keys
        if self._into and len(parts) == 1:
            p = parts[0]
            key = (conn.src, p.name, int(p.round), int(p.tag))
            into = self._into.get(key)
            fut = self._waiters.get(key)
            if into is not None and into[0].nbytes == header.payload_bytes \
                    and into[1] == (p.op, p.meta.dtype, tuple(p.meta.shape)) \
                    and fut is not None and not fut.done():
                del self._into[key]
                frame = (conn.src, int(header.message_id), int(kind))
                self._direct.add(frame)
                self._direct_active[key] = (conn, into[0], frame)
                return into[0]
        return self.pool.get(int(header.payload_bytes))

    def on_progress(self, conn: Inbound, header: pb.BulkHeader, dest: np.ndarray,
                    filled: int) -> None:
        """Part of a payload arrived: a lone part's waiting op may fold it in already."""
        parts = header.parts
        if header.kind == pb.PAYLOAD:
            rts = self._cts_sent.get((conn.src, header.message_id))
            if rts is None:
                return
            parts = rts.parts
        if len(parts) != 1 or not self._progress:
            return
        p = parts[0]
        fn = self._progress.get((conn.src, p.name, int(p.round), int(p.tag)))
        if fn is not None:
            fn(dest, filled, float(p.weight), p)

    def _ack_early(self, src: int, parts: Iterable[pb.Part]) -> None:
        matched: dict[int, list[tuple[str, int]]] = {}
        for p in parts:
            key = (src, p.name, int(p.round), int(p.tag))
            want = self._ackable.get(key)
            if want is not None and want == _accepts(p):
                del self._ackable[key]
                matched.setdefault(int(p.tag), []).append((p.name, int(p.round)))
        for tag, keys in matched.items():
            self._ack_before_payload(src, keys, tag)

    def _ack_before_payload(self, src: int, keys: list[tuple[str, int]], tag: int) -> None:
        """Acknowledge parts whose payload is still to come: their arrivals need no ACK later."""
        self._acked.update((src, name, round_, tag) for name, round_ in keys)
        self.send_acks(src, keys, tag)

    def on_frame(self, conn: Inbound, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        """Dispatch one complete frame; ValueError closes the connection it came on."""
        kind = header.kind
        if self._arriving_on:
            self._arrived(conn)
        if kind == pb.HELLO:
            self._on_hello(conn, header)
            return
        src = conn.src
        link = self.links.get(src)
        if link is None:
            raise ValueError("data before HELLO")
        link.last_heartbeat = time.monotonic()
        link.credits += int(header.credit)
        size = int(header.payload_bytes)
        direct = (src, int(header.message_id), int(kind))
        if payload is not None and direct in self._direct:  # in the op's output: not pooled
            self._direct.discard(direct)
            if kind == pb.DATA:
                parts = header.parts
            else:
                rts = self._cts_sent.pop((src, header.message_id), None)
                if rts is None:  # cannot happen: its op is still waiting (else redirected)
                    return
                parts = rts.parts
            for k in [k for k, v in self._direct_active.items() if v[2] == direct]:
                del self._direct_active[k]
            self._on_data(src, parts, payload, size, size if kind == pb.DATA else 0,
                          pooled=False)
        elif kind == pb.DATA:
            self._on_data(src, header.parts, payload, size, size)
        elif kind == pb.PAYLOAD:
            rts = self._cts_sent.pop((src, header.message_id), None)
            if rts is None:  # its ops ended here meanwhile
                self._discard.pop((src, header.message_id), None)
                if payload is not None:
                    self.pool.put(payload)
                return
            self._on_data(src, rts.parts, payload, size, 0)
        elif kind == pb.RTS:
            self._on_rts(src, header)
        elif kind == pb.CTS:
            self._on_cts(link, header.message_id)
        elif kind == pb.ACK:
            for p in header.parts:
                fut = self._acks.pop((src, p.name, p.round, p.tag), None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
        elif kind == pb.ABORT:
            if not header.parts:
                raise ValueError("ABORT without the op it aborts")
            for p in header.parts:
                name, round_ = p.name, int(p.round)
                if p.op == pb.GROUP_RESULT and self.on_group_failed is not None:
                    self.on_group_failed(name, round_, header.error)  # not an op of ours
                    continue
                self._drop_early({(name, round_)})  # the op failed: its data is moot
                if (name, round_) not in self._closed:
                    self._on_abort(src, name, round_, header.error)
        else:
            raise ValueError(f"a frame of unknown kind {kind}")

    def _on_hello(self, conn: Inbound, header: pb.BulkHeader) -> None:
        src = int(header.from_rank)
        if conn.src >= 0:
            raise ValueError("a second HELLO")
        if header.cluster_id != self.cluster_id or src not in self.links:
            raise ValueError(f"HELLO from rank {src} of cluster {header.cluster_id!r}")
        link = self.links[src]
        if link.inbound is not None:  # reconnecting is not supported: keep the first one
            raise ValueError(f"a second HELLO from rank {src}, which is already connected")
        conn.src = src
        link.inbound = conn
        link.inbound_lost = False

    def _on_data(self, src: int, parts: Iterable[pb.Part], payload: np.ndarray | None,
                 total: int, credit: int, pooled: bool = True) -> None:
        plist = list(parts)
        if sum(int(p.nbytes) for p in plist) != total or not plist:
            if payload is not None and pooled:
                self.pool.put(payload)
            raise ValueError(f"parts of {sum(int(p.nbytes) for p in plist)} bytes in a "
                             f"{total}-byte payload")
        msg = _Message(src, payload if pooled else None, len(plist), credit)
        empty = np.empty(0, np.uint8)
        offset = 0
        for p in plist:
            n = int(p.nbytes)
            data = payload[offset:offset + n] if payload is not None else empty
            offset += n
            shape = tuple(int(s) for s in p.meta.shape)
            arrival = Arrival(src, int(p.op), int(p.meta.dtype), shape, float(p.weight), data, msg,
                              step=int(p.step))
            if self._acked:
                key = (src, p.name, int(p.round), int(p.tag))
                arrival.acked = key in self._acked
                self._acked.discard(key)
            self._deliver((src, p.name, int(p.round), int(p.tag)), arrival)

    def _on_rts(self, src: int, header: pb.BulkHeader) -> None:
        rts = (src, int(header.message_id))
        if _one_sided(header):  # nothing local waits for it: the window service takes it now
            self._rts[rts] = header
            self._clear_to_send(rts)
            return
        if self._all_closed(header):
            return  # late: its op ended here (the sender's fails by timeout or ABORT)
        self._rts[rts] = header
        wanted = False
        for p in header.parts:
            key = (src, p.name, int(p.round), int(p.tag))
            if key in self._waiters or self._is_running(p.name, int(p.round)):
                wanted = True
            self._rts_keys[key] = rts
        if wanted:
            self._clear_to_send(rts)

    def _arrived(self, conn: Inbound) -> None:
        """``conn``'s frame is complete (or will never be): its parts are no longer arriving."""
        for key in self._arriving_on.pop(conn, ()):
            self._arriving.pop(key, None)

    def on_lost(self, conn: Inbound, reason: str) -> None:
        """An incoming connection ended: when it was the peer's current one, the peer is down."""
        self._arrived(conn)
        partial = conn.take_partial()
        if partial is not None:
            header, dest = partial
            if (conn.src, int(header.message_id), int(header.kind)) in self._direct:
                self._direct.discard((conn.src, int(header.message_id), int(header.kind)))
            else:
                self.pool.put(dest)
        src = conn.src
        link = self.links.get(src)
        if link is None or link.inbound is not conn:
            return
        link.inbound = None
        link.inbound_lost = True
        for table in (self._cts_sent, self._rts):
            for k in [k for k in table if k[0] == src]:
                del table[k]
        err = OpError(pb.PEER_UNAVAILABLE, f"rank {src} disconnected ({reason})")
        for wtable in (self._waiters, self._acks):
            for key in [k for k in wtable if k[0] == src]:
                fut = wtable.pop(key)
                if not fut.done():
                    fut.set_exception(err)
        for rdv in link.rendezvous.values():
            if not rdv.done.done():
                rdv.done.set_exception(err)
        link.rendezvous.clear()
        self._on_peer_down(src, reason)


#: window requests that arrive without a local op to match them (decentd.windows)
ONE_SIDED = frozenset({pb.WIN_PUT, pb.WIN_ACCUMULATE, pb.WIN_GET, pb.WIN_EXCHANGE,
                       pb.GROUP_TRIGGER, pb.GROUP_RESULT})


def _one_sided(header: pb.BulkHeader) -> bool:
    return any(p.op in ONE_SIDED and p.tag == 0 for p in header.parts)


def _settle(fut: asyncio.Future[None], err: BaseException | None, rank: int, name: str) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    elif isinstance(err, asyncio.CancelledError):
        fut.set_exception(OpError(pb.ABORTED, f"op '{display_name(name)}': cancelled before "
                                              "it was sent"))
    else:
        fut.set_exception(OpError(pb.PEER_UNAVAILABLE, f"op '{display_name(name)}': sending to "
                                  f"rank {rank} failed ({type(err).__name__}: {err})"))
