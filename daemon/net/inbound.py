"""The bulk data path between daemons: raw TCP, protobuf headers, tensor bytes never copied twice.

A frame is a ``BulkHeader`` framed as :mod:`decent_wire.framing` frames it, then the header's
``payload_bytes`` of raw data. Each direction of a peer pair has its own connection:

* :class:`decentd.net.outbound.Sender` owns the outgoing socket.
* :class:`Inbound` is an ``asyncio.BufferedProtocol`` on the incoming socket. Headers are parsed
  from a reused scratch buffer; a payload is received straight into the buffer its consumer
  provides (``recv_into`` semantics, no per-chunk objects).

A striped link (:mod:`decentd.net.stripes`) has more incoming connections: the main one parses
frames as above, the others are lanes that receive the shares of striped payloads in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np

from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb
from decentd.net.stripes import Lane, LaneSet, StripedFrame
from decentd.security.refusals import Refusals

log = logging.getLogger("decentd.net.inbound")

#: headers are small (a name and a shape per part); a larger one means a broken stream
MAX_HEADER = 16 << 20
#: ... and before it said a valid HELLO (a HELLO is about 100 bytes)
UNPROVEN_HEADER = 4096
#: the scratch buffer of a connection that has not said a valid HELLO yet
UNPROVEN_SCRATCH = 8192
#: connections that have not said a valid HELLO yet, at once
MAX_UNPROVEN = 64
#: ... from one address
MAX_UNPROVEN_PER_SOURCE = 16
SCRATCH = 256 << 10
#: a payload being received wakes the event loop (and reports its progress) once this much more
#: has arrived; fewer wakeups mean less interpreter work per byte
LOW_WATER = 4 << 20
#: ... but toward its end at half of what is left, down to this: the last wakeup then has little
#: left to fold, which is what the op waits for after the last byte
TAIL = 256 << 10


def next_step(remaining: int) -> int:
    """Bytes of a payload to wait for before the next wakeup, with ``remaining`` still to come."""
    return max(min(LOW_WATER, remaining // 2), min(remaining, TAIL))


#: TCP keepalive of bulk connections: probes after this long idle, this often, this many
KEEPALIVE = (30, 10, 3)


def tune(sock: socket.socket) -> None:
    """TCP options for the bulk path: no Nagle delay; keepalive probes, so that a connection
    idle between large frames (a striped link's lanes carry no heartbeats) keeps its place in
    a NAT's table. Buffer sizes are left to the kernel's autotuning, which grows them past what
    SO_SNDBUF/SO_RCVBUF may set (net.core.*mem_max)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in zip((socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT),
                             KEEPALIVE, strict=True):
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


class FrameSink(Protocol):
    """Where an :class:`Inbound` connection delivers what it reads."""

    def on_header(self, conn: Inbound, header: pb.BulkHeader) -> np.ndarray | None:
        """A header arrived; return the uint8 buffer of exactly its payload's size that the
        payload is received into (None: no payload)."""

    def on_frame(self, conn: Inbound, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        """A whole frame (header and payload) arrived."""

    def on_progress(self, conn: Inbound, header: pb.BulkHeader, dest: np.ndarray,
                    filled: int) -> None:
        """``dest[:filled]`` of a payload still being received has arrived."""

    def on_lost(self, conn: Inbound, reason: str) -> None:
        """The connection ended."""


@dataclass
class _Partial:
    """A payload being received in place."""

    header: pb.BulkHeader
    dest: np.ndarray
    view: memoryview
    filled: int = 0
    reported: int = 0  # progress last reported at
    end: int = -1  # bytes of it that come over this connection (-1: all)

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = self.dest.size


@dataclass(eq=False)
class Inbound(asyncio.BufferedProtocol):
    """One incoming bulk connection: a frame parser that receives payloads in place."""

    sink: FrameSink
    gate: Gate | None = None  #: bounds connections until their HELLO (None: this daemon's own)
    src: int = -1  # set by the HELLO frame
    bytes_received: int = 0
    frames_received: int = 0
    transport: asyncio.Transport | None = None
    _scratch: bytearray = field(default_factory=lambda: bytearray(UNPROVEN_SCRATCH),
                                repr=False)
    _start: int = 0
    _end: int = 0
    _partial: _Partial | None = None
    _closed: bool = False
    _sock: socket.socket | None = None
    _lowat: int = 1
    #: the main connection of a striped link: its lanes (set by its HELLO)
    lanes: LaneSet | None = None
    #: a lane of a striped link: what it receives (set by its HELLO)
    lane: Lane | None = None
    #: a striped frame whose own share is in, waiting for the lanes' shares
    _striped: tuple[pb.BulkHeader, StripedFrame] | None = None
    _paused: bool = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Tune the socket."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._sock = transport.get_extra_info("socket")
        if self._sock is not None:
            with contextlib.suppress(OSError):
                tune(self._sock)
        if self.gate is not None:
            peer = transport.get_extra_info("peername")
            self.gate.opened(self, str(peer[0]) if peer else "?")

    @property
    def trusted(self) -> bool:
        """This daemon's own connection to itself (no gate, no proof)."""
        return self.gate is None

    def _low_water(self, nbytes: int) -> None:
        """Wake the loop only once ``nbytes`` are readable (SO_RCVLOWAT): a payload trickling
        in over a slow link is then read in large pieces instead of a packet at a time."""
        nbytes = max(1, nbytes)
        # over TLS the socket's bytes are records, not payload: a threshold could wait for
        # bytes the TLS layer already read
        if self.transport is not None and self.transport.get_extra_info("sslcontext"):
            return
        if nbytes != self._lowat and self._sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
                self._lowat = nbytes

    def get_buffer(self, sizehint: int) -> memoryview:
        """The payload being received, else free scratch space."""
        if self.lane is not None:
            return self.lane.buffer()
        if self._partial is not None:
            return self._partial.view[self._partial.filled:self._partial.end]
        if self.src >= 0 and self._start == self._end and len(self._scratch) < SCRATCH:
            self._scratch = bytearray(SCRATCH)  # proven: the full-size buffer
            self._start = self._end = 0
        if self._end == len(self._scratch):
            pending = self._end - self._start
            if self._start:
                self._scratch[:pending] = self._scratch[self._start:self._end]
                self._start, self._end = 0, pending
            else:  # one header larger than the scratch buffer (a new one: the old may be exported)
                grown = bytearray(2 * len(self._scratch))
                grown[:pending] = self._scratch
                self._scratch = grown
        return memoryview(self._scratch)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        """Advance the payload in progress, or parse the frames now complete in scratch."""
        self.bytes_received += nbytes
        if self.lane is not None:
            try:
                self.lane.arrived(nbytes)
            except ValueError as exc:
                self.fail(str(exc))
            # no SO_RCVLOWAT here: a chunk's threshold above what a young connection's receive
            # window lets the peer send stalls the lane until the kernel grows the buffer
            return
        part = self._partial
        if part is not None:
            part.filled += nbytes
            if part.filled == part.end:
                self._partial = None
                self._low_water(1)
                if self._own_share_done(part.header, part.dest):
                    self._parse_or_fail()
            else:
                self._low_water(next_step(part.end - part.filled))
                if part.filled - part.reported >= next_step(part.end - part.reported):
                    part.reported = part.filled
                    try:
                        self.sink.on_progress(self, part.header, part.dest, part.filled)
                    except Exception:  # a bug in a consumer must not take the link down
                        log.exception("progress callback failed")
            return
        self._end += nbytes
        self._parse_or_fail()

    def _parse_or_fail(self) -> None:
        try:
            self._parse()
        except ValueError as exc:
            self.fail(f"malformed frame: {exc}")

    def _parse(self) -> None:
        buf = self._scratch
        length = framing.LENGTH
        while not self._closed and self._striped is None:
            if self.lane is not None:  # its HELLO made it a lane: the rest is payload bytes
                leftover = bytes(buf[self._start:self._end])
                self._start = self._end = 0
                self.lane.replay(leftover)
                return
            limit = MAX_HEADER if self.src >= 0 else UNPROVEN_HEADER
            hlen = framing.body_length(buf, self._start, self._end, limit)
            if hlen is None or self._end - self._start < length + hlen:
                break
            header = pb.BulkHeader()
            try:
                header.ParseFromString(bytes(buf[self._start + length:self._start + length + hlen]))
            except Exception as exc:  # protobuf's DecodeError
                raise ValueError(f"undecodable header ({exc})") from None
            self._start += length + hlen
            size = header.payload_bytes
            striped = self._striped_bytes(header)
            dest = self.sink.on_header(self, header) if size else None
            if size and (dest is None or dest.size != size):
                raise ValueError(f"no buffer for a {size}-byte payload")
            if dest is None:
                self._deliver(header, None)
                continue
            own = size - striped
            if striped:
                self._announce(header, dest, own, striped)
            take = min(own, self._end - self._start)
            if take:
                dest[:take] = np.frombuffer(buf, np.uint8, take, self._start)
                self._start += take
            if take == own:
                if self._own_share_done(header, dest):
                    continue
                break
            self._partial = _Partial(header, dest, dest.data, take, end=own)
            self._low_water(next_step(own - take))
            break
        if self._start == self._end:
            self._start = self._end = 0
        if self._partial is not None and len(self._scratch) > SCRATCH:
            self._scratch = bytearray(SCRATCH)  # shrink after a huge header

    def _striped_bytes(self, header: pb.BulkHeader) -> int:
        """Bytes of ``header``'s payload that come over the lanes (checked)."""
        striped = int(header.stripe_bytes)
        if striped and (self.lanes is None or striped > header.payload_bytes
                        or header.kind not in (pb.DATA, pb.PAYLOAD)):
            raise ValueError(f"{striped} striped bytes of a {header.payload_bytes}-byte "
                             f"payload on a link of {self.lanes.stripes if self.lanes else 1} "
                             "connection(s)")
        return striped

    def _announce(self, header: pb.BulkHeader, dest: np.ndarray, own: int,
                  striped: int) -> None:
        """The lanes will carry ``dest[own:]``."""
        assert self.lanes is not None
        frame = StripedFrame(dest, self, own, striped)
        self._striped = (header, frame)
        self.lanes.announce(frame)

    def _own_share_done(self, header: pb.BulkHeader, dest: np.ndarray) -> bool:
        """This connection's share of a payload is in: deliver the frame if it is whole
        (True: go on parsing); else stop reading until the lanes' shares are in."""
        striped = self._striped
        if striped is None:
            self._deliver(header, dest)
            return True
        if striped[1].own_done():
            self._striped = None
            self._deliver(header, striped[1].dest)
            return True
        self.pause()
        return False

    def stripes_done(self) -> None:
        """The lanes' shares of the striped frame are in, after this connection's: deliver
        it and read on."""
        striped, self._striped = self._striped, None
        if striped is None or self._closed:
            return
        self._deliver(striped[0], striped[1].dest)
        self.resume()
        if self._end > self._start:
            self._parse_or_fail()

    def pause(self) -> None:
        """Stop reading this connection (a lane with nothing announced, or a main connection
        waiting for its lanes)."""
        if not self._paused and self.transport is not None and not self._closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read this connection again."""
        if self._paused and self.transport is not None and not self._closed:
            self._paused = False
            self.transport.resume_reading()

    def _deliver(self, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        self.frames_received += 1
        try:
            self.sink.on_frame(self, header, payload)
        except ValueError as exc:
            self.fail(f"malformed frame: {exc}")

    def receiving_into(self, dest: np.ndarray) -> bool:
        """Whether the payload being received goes into ``dest``."""
        return ((self._partial is not None and self._partial.dest is dest)
                or (self._striped is not None and self._striped[1].dest is dest))

    def redirect(self, dest: np.ndarray, into: np.ndarray) -> bool:
        """If the payload being received goes into ``dest``, send the rest into ``into``
        instead (same size; what already arrived is not copied). True when it did."""
        if not self.receiving_into(dest):
            return False
        part = self._partial
        if part is not None:
            part.dest, part.view = into, into.data
        if self._striped is not None:
            self._striped[1].dest = into  # the lanes' regions read it afresh
        return True

    def take_partial(self) -> tuple[pb.BulkHeader, np.ndarray] | None:
        """The header and destination of a payload cut off mid-way (to return its buffer)."""
        part, self._partial = self._partial, None
        striped, self._striped = self._striped, None
        if part is not None:
            return part.header, part.dest
        return None if striped is None else (striped[0], striped[1].dest)

    def fail(self, reason: str) -> None:
        """Close this connection (and only this one, or its link if it is striped) after a
        protocol error."""
        if self._closed:
            return
        if self.src >= 0 or self.gate is None:
            log.error("bulk connection from rank %d: %s; closing it", self.src, reason)
        else:
            self.gate.refused(reason)
        self.drop(reason)

    def drop(self, reason: str) -> None:
        """Close this connection because another of its link ended for ``reason`` (or, from
        :meth:`fail`, because of that protocol error)."""
        if self._closed:
            return
        self._closed = True
        if self.gate is not None:
            self.gate.settled(self)
        if self.transport is not None:
            self.transport.abort()
        self._lanes_lost(reason)
        self.sink.on_lost(self, reason)

    def connection_lost(self, exc: Exception | None) -> None:
        """The peer closed the connection or it broke."""
        if self._closed:
            return
        self._closed = True
        if self.gate is not None:
            self.gate.settled(self)
        reason = "stream closed" if exc is None else type(exc).__name__
        self._lanes_lost(reason)
        self.sink.on_lost(self, reason)

    def _lanes_lost(self, reason: str) -> None:
        """A striped link's connection ended: the others go with it (a lane's main
        connection fails, so that the link is reopened whole)."""
        if self.lanes is not None:
            lanes, self.lanes = self.lanes, None
            lanes.close(f"its main connection ended ({reason})")
        if self.lane is not None:
            self.lane.lost(reason)


class Gate:
    """Incoming connections that have not said a valid HELLO yet. Each is closed when it has
    not within ``timeout`` seconds, and they hold a few KiB each. At most ``per_source`` at once
    from one address and ``limit`` in all: a newcomer past either bound evicts the oldest
    waiting connection (of its own address, or of the address holding the most), so that
    nobody holding the slots can keep a real peer out; a real peer says HELLO in its first
    bytes and leaves the gate at once."""

    def __init__(self, timeout: float, limit: int = MAX_UNPROVEN,
                 per_source: int = MAX_UNPROVEN_PER_SOURCE,
                 refusals: Refusals | None = None) -> None:
        """``refusals``: where refused and evicted connections are counted and logged."""
        self.timeout = timeout
        self.limit = limit
        self.per_source = per_source
        self.refusals = refusals
        self._timers: dict[Inbound, asyncio.TimerHandle] = {}  # oldest first
        self._sources: dict[Inbound, str] = {}
        self._counts: Counter[str] = Counter()

    def opened(self, conn: Inbound, source: str) -> None:
        """A new connection from address ``source``; evicts the oldest waiting one when there
        is no room for it."""
        if self._counts[source] >= self.per_source:
            self._evict(source, f"more than {self.per_source} connections from {source} "
                        "have not said HELLO")
        elif len(self._timers) >= self.limit:
            crowded = max(self._counts, key=self._counts.__getitem__)
            self._evict(crowded, f"more than {self.limit} connections have not said HELLO")
        self._timers[conn] = asyncio.get_running_loop().call_later(
            self.timeout, conn.fail, f"did not authenticate within {self.timeout:g}s")
        self._sources[conn] = source
        self._counts[source] += 1

    def _evict(self, source: str, why: str) -> None:
        """Close the oldest waiting connection from ``source``."""
        oldest = next(c for c, s in self._sources.items() if s == source)
        oldest.fail(f"evicted for a newer connection: {why}")

    def settled(self, conn: Inbound) -> None:
        """The connection proved itself, or closed."""
        if (timer := self._timers.pop(conn, None)) is not None:
            timer.cancel()
        source = self._sources.pop(conn, None)
        if source is not None:
            self._counts[source] -= 1
            if not self._counts[source]:
                del self._counts[source]

    def refused(self, reason: str) -> None:
        """Count and log (at a bounded rate) a connection closed before its HELLO."""
        message = f"bulk connection from a peer that has not said HELLO: {reason}; closing it"
        if self.refusals is None:
            log.error("%s", message)
        else:
            self.refusals.refused("bulk port", message, logging.ERROR)
