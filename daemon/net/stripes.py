"""Striping: one peer link over several TCP connections, for long fat links.

One TCP flow moves at most its window per round trip. Across 100 ms at 1 Gbit/s that is
12.5 MB in flight, more than the kernel lets one connection's buffers grow by default (the
maxima of ``net.ipv4.tcp_rmem`` and ``tcp_wmem``, 4-6 MiB). So a link opens ``n`` bulk
connections (``transport.stripes``). ``"auto"`` sizes ``n`` from the round trip measured when
the first connection opened, the link rate it is sized for, and the window one flow reaches
under the kernel's buffer maxima: the buffers keep their autotuning, which setting
SO_SNDBUF/SO_RCVBUF would turn off (and cap at ``net.core.*mem_max``).

The main connection carries every frame as before. The last :func:`stripe_bytes` of a large
payload go over the other connections ("lanes") instead, in chunks that the lanes take in turn
as their connections drain (:class:`Pull`): a flow that slows down (a loss, a smaller window)
carries less, and the frame is whole when the lanes together have moved its bytes. Each chunk
says which striped frame it belongs to (the link's striped frames are numbered in the main
connection's order), where in it, and how long; the receiver puts it in place in the frame's
destination (:class:`Lane`).
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

Buffer = bytes | bytearray | memoryview

#: payloads smaller than this go whole over the main connection
STRIPE_MIN = 1 << 20
#: connections of one link, at most (what a HELLO may announce; within the bulk port's bound on
#: connections from one address that have not said HELLO yet)
MAX_STRIPES = 16
#: the in-flight bytes "auto" plans for: this much above the bandwidth-delay product
HEADROOM = 1.25
#: bytes a lane holds that came before the frame they belong to was announced (a lane
#: waiting for one stops reading)
MAX_EARLY = 1 << 20
#: a lane chunk's head: the striped frame's number, the offset into its striped bytes, length
CHUNK_HEAD = struct.Struct("<QQQ")
#: bytes per chunk a lane takes (every chunk but a frame's last is this long, at a multiple
#: of it: the receiver checks both)
CHUNK = 256 << 10
#: a lane's connection takes its next chunk once fewer than this many bytes wait unsent in it
#: (TCP_NOTSENT_LOWAT): what a slow flow holds back at the end of a frame stays small
NOTSENT_LOWAT = 256 << 10


def kernel_window(proc: str = "/proc/sys/net/ipv4") -> int:
    """Bytes one TCP flow keeps in flight under the kernel's autotuning: half the smaller of
    the send and receive buffer maxima (the other half is the buffers' own overhead)."""
    sizes = []
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            with open(f"{proc}/{name}") as f:
                sizes.append(int(f.read().split()[2]))
        except (OSError, ValueError, IndexError):
            sizes.append(4 << 20)
    return max(64 << 10, min(sizes) // 2)


@dataclass(frozen=True)
class Striping:
    """How many connections a link opens (``transport.stripes``, ``max_stripes``,
    ``stripe_rate_mbit``)."""

    stripes: int | None = None  #: fixed; None: sized from the round trip
    max_stripes: int = 8
    rate_bps: float = 1e9  #: the link rate "auto" sizes for
    window: int = field(default_factory=kernel_window)  #: one flow's bytes in flight

    def count(self, rtt: float) -> int:
        """Connections for a link whose round trip is ``rtt`` seconds."""
        if self.stripes is not None:
            return self.stripes
        in_flight = self.rate_bps / 8 * max(0.0, rtt) * HEADROOM
        return max(1, min(self.max_stripes, math.ceil(in_flight / self.window)))


def stripe_bytes(payload: int, stripes: int) -> int:
    """Of a ``payload``-byte frame on a link of ``stripes`` connections, the bytes that go
    over the lanes: all but the first ``payload // (2 * stripes)``, which the main connection
    carries after the header (half of an even share: a fixed share that must not be the last
    to arrive)."""
    if stripes <= 1 or payload < STRIPE_MIN:
        return 0
    return payload - payload // (2 * stripes)


def window(buffers: list[Buffer], start: int, length: int) -> list[Buffer]:
    """Bytes ``[start, start + length)`` of ``buffers`` taken together, as views."""
    out: list[Buffer] = []
    for b in buffers:
        n = len(b)
        if start >= n:
            start -= n
            continue
        take = min(n - start, length)
        out.append(memoryview(b)[start:start + take])
        length -= take
        start = 0
        if not length:
            break
    return out


class Pull:
    """The striped bytes of one frame, sending side: the lanes take chunks of them in turn
    (any thread); ``on_done`` is told once, from the thread that wrote the last one."""

    def __init__(self, seq: int, buffers: list[Buffer], on_done: Callable[[], None]) -> None:
        self.seq = seq
        self.buffers = buffers
        self.total = sum(map(len, buffers))
        self._lock = threading.Lock()
        self._next = 0  #: offset of the next chunk to hand out
        self._written = 0
        self._on_done = on_done

    def take(self) -> tuple[int, list[Buffer]] | None:
        """The next chunk to write (its offset and bytes, the head first), or None."""
        with self._lock:
            offset = self._next
            if offset >= self.total:
                return None
            length = min(CHUNK, self.total - offset)
            self._next += length
            body = window(self.buffers, offset, length)
        return offset, [CHUNK_HEAD.pack(self.seq, offset, length), *body]

    def wrote(self, length: int) -> None:
        """A chunk of ``length`` bytes is in its connection's kernel buffer."""
        with self._lock:
            self._written += length
            last = self._written == self.total
            if last:
                self.buffers = []  # every chunk is out: the memory is not ours to hold
        if last:
            self._on_done()


class Whole(Protocol):
    """Told when every chunk of a striped frame has arrived."""

    def stripes_done(self) -> None:
        """The lanes' chunks are in (the main connection's share came earlier)."""


@dataclass(eq=False)
class StripedFrame:
    """A frame whose payload arrives over the main connection (its first bytes) and the lanes
    (the last ``striped`` bytes, from ``start``, in chunks)."""

    dest: np.ndarray  #: where the payload goes (uint8; replaced when the op stops waiting)
    owner: Whole  #: the main connection, told when the lanes' chunks are in
    start: int
    striped: int
    received: int = 0  #: of the striped bytes
    main_done: bool = False
    chunks: int = 0  #: chunks begun
    chunks_in: int = 0  #: chunks received whole
    seen: set[int] = field(default_factory=set)  #: offsets of the chunks begun

    def own_done(self) -> bool:
        """The main connection's share is in; whether the frame is now whole."""
        self.main_done = True
        return self.whole

    def chunk_done(self) -> None:
        """A chunk is in; the owner is told when that made the frame whole."""
        self.chunks_in += 1
        if self.main_done and self.whole:
            self.owner.stripes_done()

    @property
    def whole(self) -> bool:
        """Every chunk announced is in, and they cover the striped bytes."""
        return self.received == self.striped and self.chunks_in == self.chunks


class Reader(Protocol):
    """The connection a lane reads from (:class:`decentd.net.inbound.Inbound`)."""

    bytes_received: int

    def pause(self) -> None:
        """Stop reading (nothing is expected)."""

    def resume(self) -> None:
        """Read again."""

    def drop(self, reason: str) -> None:
        """Close this connection: another of its link ended for ``reason``."""


class Lane:
    """One lane of a link, receiving side: chunks, each a :data:`CHUNK_HEAD` (the frame's
    sequence number among the link's striped frames, the offset into its striped bytes, the
    length) and its bytes, received in place."""

    def __init__(self, index: int, group: LaneSet) -> None:
        self.index = index
        self.group = group
        self.reader: Reader | None = None
        self._spill = bytearray(64 << 10)
        self._head = bytearray(CHUNK_HEAD.size)
        self._head_filled = 0
        #: the chunk being received: its frame, dest[pos:end] still to come, its length
        self._chunk: tuple[StripedFrame, int, int, int] | None = None
        #: a chunk head whose frame the main connection has not announced yet
        self.waiting: int | None = None
        self._early = bytearray()  #: bytes read while waiting (replayed once it is announced)

    def buffer(self) -> memoryview:
        """Where the next bytes read go: the chunk being received, else its head (or, while
        waiting for an announcement, the bytes held)."""
        if self._chunk is not None:
            frame, pos, end, _ = self._chunk
            return memoryview(frame.dest.data)[pos:end]
        if self.waiting is None:
            return memoryview(self._head)[self._head_filled:]
        return memoryview(self._spill)

    def arrived(self, nbytes: int) -> None:
        """``nbytes`` were read into :meth:`buffer`; ValueError when the peer broke the
        chunk format."""
        if self._chunk is not None:
            self._advance(nbytes)
        elif self.waiting is None:
            self._head_filled += nbytes
            if self._head_filled == CHUNK_HEAD.size:
                self._begin()
        else:
            self.hold(memoryview(self._spill)[:nbytes])

    def hold(self, data: memoryview | bytes) -> None:
        """Bytes that came before the frame they belong to was announced."""
        if len(self._early) + len(data) > MAX_EARLY:
            raise ValueError(f"stripe {self.index} sent {len(self._early) + len(data)} bytes "
                             "for frames not announced")
        self._early += data
        if self.reader is not None:
            self.reader.pause()

    def replay(self, data: Buffer) -> None:
        """Run ``data`` (bytes read earlier) through the chunk format."""
        view = memoryview(bytes(data))
        while view:
            if self.waiting is not None:
                self.hold(view)
                return
            buf = self.buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.arrived(n)

    def announced(self) -> None:
        """The frame this lane waits for may be known now: go on with it."""
        if self.waiting is None or self.waiting not in self.group.frames:
            return
        self._begin()
        early, self._early = self._early, bytearray()
        self.replay(early)
        if self.reader is not None and self.waiting is None:
            self.reader.resume()

    def _begin(self) -> None:
        """A chunk head is in: start receiving its bytes (or wait for its frame)."""
        seq, offset, length = CHUNK_HEAD.unpack(self._head)
        frame = self.group.frames.get(seq)
        if frame is None:
            if seq < self.group.announced:
                raise ValueError(f"stripe {self.index} sent a chunk of striped frame {seq}, "
                                 "which is complete")
            self.waiting = seq
            if self.reader is not None:
                self.reader.pause()
            return
        if offset % CHUNK or offset >= frame.striped or offset in frame.seen or \
                length != min(CHUNK, frame.striped - offset):
            raise ValueError(f"stripe {self.index} sent {length} bytes at {offset} of a frame's "
                             f"{frame.striped} striped bytes (chunks of {CHUNK}, each once)")
        self.waiting, self._head_filled = None, 0
        frame.seen.add(offset)
        frame.chunks += 1
        if frame.received + length == frame.striped:  # its last chunk: the seq is done
            del self.group.frames[seq]
        pos = frame.start + offset
        self._chunk = (frame, pos, pos + length, length)
        frame.received += length

    def _advance(self, nbytes: int) -> None:
        assert self._chunk is not None
        frame, pos, end, length = self._chunk
        pos += nbytes
        if pos < end:
            self._chunk = (frame, pos, end, length)
            return
        self._chunk = None
        frame.chunk_done()

    def lost(self, reason: str) -> None:
        """This lane's connection ended: so does the link's main connection (and with it
        the link, for the same reason)."""
        if self.group.main is not None:
            self.group.main.drop(reason)


class LaneSet:
    """The lanes of one peer link, receiving side (one per link opening, ``bundle``)."""

    def __init__(self, stripes: int, bundle: int) -> None:
        self.stripes, self.bundle = stripes, bundle
        self.lanes = [Lane(i, self) for i in range(1, stripes)]
        #: the link's main connection, once its HELLO came
        self.main: Reader | None = None
        #: striped frames announced by the main connection and not whole yet, by sequence
        self.frames: dict[int, StripedFrame] = {}
        self.announced = 0  #: striped frames announced so far
        self.closed = False  #: the link is gone: a late connection of it gets a new set

    @property
    def bytes_received(self) -> int:
        """Bytes read from the lanes' connections."""
        return sum(lane.reader.bytes_received for lane in self.lanes if lane.reader is not None)

    def attach(self, index: int, reader: Reader) -> Lane:
        """Lane ``index`` is read from ``reader`` now; ValueError when it already is."""
        lane = self.lanes[index - 1]
        if lane.reader is not None:
            raise ValueError(f"a second connection for stripe {index}")
        lane.reader = reader
        return lane

    def announce(self, frame: StripedFrame) -> None:
        """The main connection parsed the header of the next striped frame."""
        self.frames[self.announced] = frame
        self.announced += 1
        for lane in self.lanes:
            lane.announced()

    def close(self, reason: str) -> None:
        """The link is gone: close every lane's connection; nothing is received any more
        (the frames' buffers go back to the pool)."""
        self.main = None
        self.closed = True
        self.frames.clear()
        for lane in self.lanes:
            if lane.reader is not None:
                reader, lane.reader = lane.reader, None
                reader.drop(reason)


class Countdown:
    """Calls ``on_done`` once: with the first error, or with None when all ``parts`` ended
    well (every call on the event loop)."""

    def __init__(self, on_done: Callable[[BaseException | None], None], parts: int) -> None:
        self.on_done: Callable[[BaseException | None], None] | None = on_done
        self.left = parts

    def __call__(self, err: BaseException | None) -> None:
        """One part ended (``err``: how it failed)."""
        if self.on_done is None:
            return
        self.left -= 1
        if err is not None or self.left == 0:
            on_done, self.on_done = self.on_done, None
            on_done(err)
