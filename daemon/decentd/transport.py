"""Daemon-to-daemon transport: handshake, one framed stream per direction, matching of arrivals.

Each daemon opens one gRPC ``Exchange`` stream to every peer and writes frames on it: a DATA message
is a header frame (meta, total size, first chunk) followed by CHUNK frames; ACK and ABORT are small
control frames. Incoming frames are reassembled per (sender, message id) and handed to whoever
waits for ``(sender, name, round, tag)``; arrivals nobody waits for yet are buffered up to a byte
bound, past which the receiving stream stops reading (gRPC flow control then slows the sender).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from decentd import PROTOCOL_VERSION
from decentd.errors import OpError, StartupError
from decentd.wire import pb, pb_grpc

log = logging.getLogger("decentd.transport")

#: (sender or receiver rank, op name, round, tag)
Key = tuple[int, str, int, int]

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 128 << 20),
    ("grpc.max_receive_message_length", 128 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # peers start in any order: retry a peer that is not up yet soon, not after gRPC's 1 s
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

#: a cancelled op whose half-written message is still not out after this long says so in the log
WRITE_GRACE = 5.0

RANK_HEADER = "x-decent-rank"
CLUSTER_HEADER = "x-decent-cluster"


@dataclass
class Arrival:
    """One complete DATA message from a peer."""

    src: int
    op: int
    dtype: int
    shape: tuple[int, ...]
    weight: float
    data: np.ndarray  # uint8, exactly the message bytes


@dataclass
class _Assembly:
    key: Key
    frame: pb.Frame
    buf: np.ndarray | None  # None: refused, the chunks are read and dropped
    filled: int
    total: int


@dataclass
class _Outgoing:
    """One message waiting for a link's writer."""

    frames: Iterator[pb.Frame]
    done: asyncio.Future[None]
    name: str
    abandoned: bool = False  # its op was cancelled: skip it if not started
    started: bool = False  # the writer has begun cutting frames from the payload


#: separates the job id from the op name in wire keys (a character no sane name contains)
JOB_SEPARATOR = "\x1f"


def qualify(job: str, name: str) -> str:
    """The wire key of op ``name`` in job ``job``."""
    return f"{job}{JOB_SEPARATOR}{name}" if job else name


def display_name(wire_name: str) -> str:
    """The user's op name inside a wire key (for messages)."""
    return wire_name.rsplit(JOB_SEPARATOR, 1)[-1]


@dataclass
class PeerLink:
    """The outgoing side of the connection to one peer."""

    rank: int
    address: str
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.PeerStub | None = None
    call: grpc.aio.StreamUnaryCall | None = None
    queue: asyncio.Queue[_Outgoing] = field(default_factory=asyncio.Queue)
    writer: asyncio.Task[None] | None = None
    connected: bool = False  # our stream to the peer is up
    inbound_lost: bool = False  # the peer's stream to us was up and ended
    inbound_streams: int = 0  # streams open from the peer (a stale or stray one may overlap)
    last_heartbeat: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    next_message_id: int = 0


class Transport:
    """All peer links of one daemon plus the matching of incoming messages to waiting ops."""

    def __init__(
        self,
        rank: int,
        addresses: list[str],
        cluster_id: str,
        chunk_bytes: int,
        early_limit: int,
        on_abort: Callable[[int, str, int, pb.Error], None],
        on_peer_down: Callable[[int, str], None],
        is_running: Callable[[str, int], bool],
        on_unexpected: Callable[[int, str, int, int, Arrival], None],
    ) -> None:
        self.rank = rank
        self.cluster_id = cluster_id
        self.chunk_bytes = chunk_bytes
        self.early_limit = early_limit
        self._is_running = is_running
        self._on_unexpected = on_unexpected
        self._on_abort = on_abort
        self._on_peer_down = on_peer_down
        self.links = {r: PeerLink(r, a) for r, a in enumerate(addresses) if r != rank}
        self._waiters: dict[Key, asyncio.Future[Arrival]] = {}
        self._early: dict[Key, Arrival] = {}
        self._acks: dict[Key, asyncio.Future[None]] = {}
        self._assembling: dict[tuple[int, int], _Assembly] = {}  # (stream id, message id)
        self._closed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self.early_bytes = 0

    # ------------------------------------------------------------------ connection setup

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
        metadata = ((RANK_HEADER, str(self.rank)), (CLUSTER_HEADER, self.cluster_id))
        link.call = link.stub.Exchange(metadata=metadata)
        link.writer = asyncio.get_running_loop().create_task(self.writer_loop(link))
        link.connected = True
        link.last_heartbeat = time.monotonic()
        log.debug("connected to rank %d at %s", link.rank, link.address)

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
        if request.from_rank not in self.links:
            return pb.Error(
                code=pb.RANK_MISMATCH,
                message=f"rank {request.from_rank} is not a peer of rank {self.rank}",
            )
        return None

    async def heartbeat_loop(self, interval: float) -> None:
        """Ping every peer each ``interval`` seconds; record when each last answered."""
        while True:
            await asyncio.sleep(interval)
            for link in self.links.values():
                if link.stub is None:
                    continue
                try:
                    await link.stub.Heartbeat(
                        pb.HeartbeatRequest(from_rank=self.rank), timeout=interval
                    )
                    link.last_heartbeat = time.monotonic()
                except grpc.aio.AioRpcError:
                    log.debug("heartbeat to rank %d failed", link.rank)

    async def close(self) -> None:
        """Close every outgoing stream and channel."""
        for link in self.links.values():
            if link.writer is not None:
                link.writer.cancel()
            if link.call is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(link.call.done_writing(), 1.0)
                link.call.cancel()
            if link.channel is not None:
                await link.channel.close(grace=None)
            link.connected = False

    # ------------------------------------------------------------------ sending

    def _link(self, dst: int, name: str) -> PeerLink:
        link = self.links.get(dst)
        if link is None or link.call is None or not link.connected:
            raise OpError(
                pb.PEER_UNAVAILABLE,
                f"op '{display_name(name)}': rank {dst} is not connected to rank {self.rank}",
            )
        return link

    async def _write(self, link: PeerLink, frames: Iterator[pb.Frame], name: str) -> None:
        """Queue a message on the link's writer and wait until it is written.

        A write is never abandoned half-way: the frames are cut lazily from the worker's arena
        slot, so a cancelled op waits for a message already being written (a torn message would
        break the stream, and a freed slot could send its next tensor under this key). A message
        still queued when its op is cancelled is skipped.
        """
        out = _Outgoing(frames, asyncio.get_running_loop().create_future(), name)
        link.queue.put_nowait(out)
        try:
            await asyncio.shield(out.done)
        except asyncio.CancelledError:
            out.abandoned = True
            if out.started:
                await self._finish_started(out, link)
            raise

    @staticmethod
    async def _finish_started(out: _Outgoing, link: PeerLink) -> None:
        """Wait, through further cancellations, for a message already being written."""
        warned = False
        while not out.done.done():
            try:
                await asyncio.wait({out.done}, timeout=WRITE_GRACE)
            except asyncio.CancelledError:
                continue
            if not out.done.done() and not warned:
                warned = True
                log.warning("op '%s': a message to rank %d is still being written after its op "
                            "ended; waiting for it", display_name(out.name), link.rank)

    async def writer_loop(self, link: PeerLink) -> None:
        """Write queued messages to ``link``'s stream, one whole message at a time."""
        while True:
            out = await link.queue.get()
            fut, name = out.done, display_name(out.name)
            try:
                if out.abandoned:
                    raise OpError(pb.ABORTED, f"op '{name}': cancelled before it was sent")
                if link.call is None or not link.connected:
                    raise OpError(pb.PEER_UNAVAILABLE,
                                  f"op '{name}': rank {link.rank} is not connected")
                out.started = True
                for frame in out.frames:
                    await link.call.write(frame)
                    link.bytes_sent += len(frame.data)
            except OpError as err:
                if not fut.done():
                    fut.set_exception(err)
            except Exception as exc:  # the stream broke
                link.connected = False
                if not fut.done():
                    fut.set_exception(OpError(
                        pb.PEER_UNAVAILABLE,
                        f"op '{name}': sending to rank {link.rank} failed ({type(exc).__name__})"))
            else:
                if not fut.done():
                    fut.set_result(None)

    def _data_frames(
        self, link: PeerLink, header: pb.Frame, payload: memoryview
    ) -> Iterator[pb.Frame]:
        link.next_message_id += 1
        mid = link.next_message_id
        chunk = self.chunk_bytes
        header.kind = pb.DATA
        header.message_id = mid
        header.total_bytes = len(payload)
        header.data = bytes(payload[:chunk])
        yield header
        for start in range(chunk, len(payload), chunk):
            yield pb.Frame(kind=pb.CHUNK, message_id=mid, data=bytes(payload[start:start + chunk]))

    async def send_data(
        self,
        dst: int,
        name: str,
        round_: int,
        tag: int,
        op: int,
        dtype: int,
        shape: tuple[int, ...],
        payload: memoryview,
        weight: float = 1.0,
    ) -> None:
        """Send one tensor to ``dst``; returns once every frame is written to the stream."""
        link = self._link(dst, name)
        header = pb.Frame(
            name=name, round=round_, tag=tag, op=op,
            meta=pb.TensorMeta(dtype=dtype, shape=shape),
            weight=weight,
        )
        await self._write(link, self._data_frames(link, header, payload), name)

    async def send_control(
        self, dst: int, kind: int, name: str, round_: int, tag: int = 0,
        error: pb.Error | None = None,
    ) -> None:
        """Send an ACK or ABORT frame (best effort: a dead peer is ignored)."""
        link = self.links.get(dst)
        if link is None or link.call is None or not link.connected:
            return
        frame = pb.Frame(kind=kind, name=name, round=round_, tag=tag, error=error)
        with contextlib.suppress(OpError):
            await self._write(link, iter([frame]), name)

    # ------------------------------------------------------------------ receiving

    def expect(self, src: int, name: str, round_: int, tag: int) -> asyncio.Future[Arrival]:
        """A future for the DATA message ``(name, round, tag)`` from ``src``."""
        key = (src, name, round_, tag)
        fut: asyncio.Future[Arrival] = asyncio.get_running_loop().create_future()
        early = self._early.pop(key, None)
        if early is not None:
            self._release(early.data.nbytes)
            fut.set_result(early)
        else:
            self._waiters[key] = fut
        return fut

    def expect_ack(self, dst: int, name: str, round_: int, tag: int) -> asyncio.Future[None]:
        """A future resolved when ``dst`` acknowledges our message ``(name, round, tag)``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks[(dst, name, round_, tag)] = fut
        return fut

    def close_op(self, name: str, round_: int) -> None:
        """Forget everything about a finished op; later arrivals for it are dropped."""
        self._closed[(name, round_)] = None
        while len(self._closed) > 65536:
            self._closed.popitem(last=False)
        for table in (self._waiters, self._acks):
            for key in [k for k in table if k[1] == name and k[2] == round_]:
                fut = table.pop(key)
                if not fut.done():
                    fut.cancel()
        for key in [k for k in self._early if k[1] == name and k[2] == round_]:
            self._release(self._early.pop(key).data.nbytes)

    def _release(self, nbytes: int) -> None:
        self.early_bytes -= nbytes

    def _admit(self, key: Key, nbytes: int) -> bool:
        """Whether an early arrival of ``nbytes`` may be buffered.

        Data for an op already running here, and a message into an empty buffer, always get in.
        Otherwise the buffer is bounded: a message past ``early_limit`` is refused at once, which
        fails that one op on both sides with RESOURCE_EXHAUSTED. Refusing instead of pausing the
        stream keeps everything queued behind it (data of running ops, ACKs, ABORTs) moving.
        """
        if nbytes == 0 or self.early_bytes == 0 or key in self._waiters \
                or self._is_running(key[1], key[2]):
            return True
        return self.early_bytes + nbytes <= self.early_limit

    def _deliver(self, key: Key, arrival: Arrival) -> None:
        if key[1:3] in self._closed:
            return
        fut = self._waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(arrival)
            return
        old = self._early.pop(key, None)
        if old is not None:  # a resend of the same key replaces the first copy
            self._release(old.data.nbytes)
        self._early[key] = arrival
        self.early_bytes += arrival.data.nbytes
        if self._is_running(key[1], key[2]):
            self._on_unexpected(key[0], key[1], key[2], key[3], arrival)

    def _drop_early(self, name: str, round_: int) -> None:
        for key in [k for k in self._early if k[1] == name and k[2] == round_]:
            self._release(self._early.pop(key).data.nbytes)

    def forget_history(self) -> None:
        """Drop what finished or orphaned ops left behind (no local worker is left to use it)."""
        self._closed.clear()
        for key in list(self._early):
            self._release(self._early.pop(key).data.nbytes)

    async def on_frame(self, src: int, frame: pb.Frame, stream: int = 0) -> None:
        """Handle one incoming frame from ``src`` on stream ``stream`` (the Exchange servicer's).

        A malformed frame raises ValueError, which ends that stream (and only that one).
        """
        link = self.links.get(src)
        if link is not None:
            link.bytes_received += len(frame.data)
            link.last_heartbeat = time.monotonic()
        kind = frame.kind
        if kind == pb.CHUNK:
            asm = self._assembling.get((stream, frame.message_id))
            if asm is None:
                raise ValueError(f"rank {src} sent a chunk of unknown message {frame.message_id}")
            size = len(frame.data)
            if asm.filled + size > asm.total:
                raise ValueError(f"rank {src} sent more than the {asm.total} bytes it announced "
                                 f"for '{asm.key[1]}'")
            if asm.buf is not None:
                asm.buf[asm.filled:asm.filled + size] = np.frombuffer(frame.data, np.uint8)
            asm.filled += size
            if asm.filled == asm.total:
                del self._assembling[(stream, frame.message_id)]
                if asm.buf is not None:
                    self._deliver(asm.key, self._arrival(src, asm.frame, asm.buf))
        elif kind == pb.DATA:
            key = (src, frame.name, frame.round, frame.tag)
            total = frame.total_bytes
            first = np.frombuffer(frame.data, np.uint8)
            if first.size > total:
                raise ValueError(f"rank {src} sent {first.size} bytes for '{frame.name}' but "
                                 f"announced {total}")
            if (frame.name, frame.round) in self._closed:
                keep = False  # a late message of a finished op: read it and drop it
            else:
                keep = self._admit(key, total)
                if not keep:
                    self._refuse(src, frame)
            if first.size == total:
                if keep:
                    self._deliver(key, self._arrival(src, frame, first.copy()))
                return
            header = pb.Frame()
            header.CopyFrom(frame)
            header.ClearField("data")
            buf = None
            if keep:
                buf = np.empty(total, np.uint8)
                buf[:first.size] = first
            self._assembling[(stream, frame.message_id)] = _Assembly(
                key, header, buf, first.size, total)
        elif kind == pb.ACK:
            fut = self._acks.pop((src, frame.name, frame.round, frame.tag), None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif kind == pb.ABORT:
            self._drop_early(frame.name, frame.round)  # the op failed: its data is moot
            if (frame.name, frame.round) not in self._closed:
                self._on_abort(src, frame.name, frame.round, frame.error)
        else:
            raise ValueError(f"rank {src} sent a frame of unknown kind {kind}")

    def _refuse(self, src: int, frame: pb.Frame) -> None:
        error = pb.Error(
            code=pb.RESOURCE_EXHAUSTED,
            message=f"tensor '{display_name(frame.name)}' round {frame.round}: rank {self.rank} "
            f"has "
            f"{self.early_bytes} bytes of data buffered for ops it has not started "
            f"(memory.early_arrival_bytes = {self.early_limit}); rank {src}'s message was refused",
        )
        log.warning("%s", error.message)
        asyncio.get_running_loop().create_task(
            self.send_control(src, pb.ABORT, frame.name, frame.round, frame.tag, error))
        self._on_abort(src, frame.name, frame.round, error)  # our own op fails the same way

    @staticmethod
    def _arrival(src: int, frame: pb.Frame, data: np.ndarray) -> Arrival:
        return Arrival(
            src=src,
            op=frame.op,
            dtype=frame.meta.dtype,
            shape=tuple(frame.meta.shape),
            weight=frame.weight,
            data=data,
        )

    def stream_closed(self, stream: int) -> None:
        """Drop the partial messages of an incoming stream that ended."""
        for key in [k for k in self._assembling if k[0] == stream]:
            del self._assembling[key]

    def inbound_opened(self, src: int) -> None:
        """``src`` opened its stream to us."""
        link = self.links.get(src)
        if link is not None:
            link.inbound_streams += 1
            link.inbound_lost = False

    def peer_down(self, src: int, reason: str) -> None:
        """A stream from ``src`` ended: when it was the last, fail everything waiting on it."""
        link = self.links.get(src)
        if link is not None:
            link.inbound_streams = max(0, link.inbound_streams - 1)
            if link.inbound_streams:
                log.warning("a stream claiming to be rank %d ended (%s); its other stream "
                            "stays up", src, reason)
                return
            link.inbound_lost = True
        err = OpError(pb.PEER_UNAVAILABLE, f"rank {src} disconnected ({reason})")
        for table in (self._waiters, self._acks):
            for key in [k for k in table if k[0] == src]:
                fut = table.pop(key)
                if not fut.done():
                    fut.set_exception(err)
        self._on_peer_down(src, reason)
