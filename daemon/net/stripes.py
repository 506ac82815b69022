"""Striping: one peer link over several TCP connections, for long fat links.

One TCP flow moves at most its window per round trip. Across 100 ms at 1 Gbit/s that is
12.5 MB in flight, more than the kernel lets one connection's buffers grow by default (the
maxima of ``net.ipv4.tcp_rmem`` and ``tcp_wmem``, 4-6 MiB). So a link opens ``n`` bulk
connections (``transport.stripes``). ``"auto"`` sizes ``n`` from the round trip measured when
the first connection opened, the link rate it is sized for, and the window one flow reaches
under the kernel's buffer maxima: the buffers keep their autotuning, which setting
SO_SNDBUF/SO_RCVBUF would turn off (and cap at ``net.core.*mem_max``).

The main connection carries every frame as before. The last :func:`stripe_bytes` of a large
payload go over the other connections ("lanes") instead: each lane is a raw byte stream of its
shares, frame after frame in the main connection's order, with no headers of its own, split as
:func:`layout` says and received in place into the frame's destination (:class:`Lane`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

#: payloads smaller than this go whole over the main connection
STRIPE_MIN = 1 << 20
#: connections of one link, at most (what a HELLO may announce)
MAX_STRIPES = 64
#: the in-flight bytes "auto" plans for: this much above the bandwidth-delay product
HEADROOM = 1.25
#: bytes a lane holds that came before the frame they belong to was known (they can only have
#: come in the read that carried its HELLO: a lane with nothing expected stops reading)
MAX_EARLY = 1 << 20


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
    over the lanes (the main connection keeps the first ``payload // stripes``)."""
    if stripes <= 1 or payload < STRIPE_MIN:
        return 0
    return payload - payload // stripes


def layout(striped: int, stripes: int) -> list[tuple[int, int]]:
    """(offset, length) of each lane's share of the last ``striped`` bytes of a payload,
    offsets from where those bytes start; the last lane takes the remainder."""
    lanes = stripes - 1
    share = striped // lanes
    return [(i * share, share if i < lanes - 1 else striped - i * share) for i in range(lanes)]


class Whole(Protocol):
    """Told when every share of a striped frame has arrived."""

    def stripes_done(self) -> None:
        """The lanes' shares are in (the main connection's share came earlier)."""


@dataclass(eq=False)
class StripedFrame:
    """A frame whose payload arrives over the main connection and the lanes."""

    dest: np.ndarray  #: where the payload goes (uint8; replaced when the op stops waiting)
    owner: Whole  #: the main connection, told when the lanes' shares are in
    waiting: int  #: shares not in yet (the main connection's one included)

    def share_done(self) -> bool:
        """One share is in; whether the frame is now whole."""
        self.waiting -= 1
        return self.waiting == 0


@dataclass(eq=False)
class Region:
    """One lane's share of a striped frame: ``dest[pos:end]`` is still to come."""

    frame: StripedFrame
    pos: int
    end: int


class Reader(Protocol):
    """The connection a lane reads from (:class:`decentd.net.inbound.Inbound`)."""

    def pause(self) -> None:
        """Stop reading (nothing is expected)."""

    def resume(self) -> None:
        """Read again."""

    def fail(self, reason: str) -> None:
        """Close this connection after a protocol error."""


class Lane:
    """One lane of a link, receiving side: the shares it will carry, in order."""

    def __init__(self, index: int, group: LaneSet) -> None:
        self.index = index
        self.group = group
        self.reader: Reader | None = None
        self.regions: collections.deque[Region] = collections.deque()
        self.early = bytearray()  #: bytes before their region was known
        self.received = 0  #: bytes read from its connection
        self._spill = bytearray(64 << 10)

    def expect(self, region: Region) -> None:
        """The main connection announced ``region`` for this lane."""
        if self.early:
            take = min(len(self.early), region.end - region.pos)
            region.frame.dest[region.pos:region.pos + take] = np.frombuffer(
                self.early, np.uint8, take)
            del self.early[:take]
            region.pos += take
            if region.pos == region.end:
                self._region_done(region)
                return
        self.regions.append(region)
        if self.reader is not None:
            self.reader.resume()

    @property
    def left(self) -> int:
        """Bytes of the current region still to come (0: none expected)."""
        return self.regions[0].end - self.regions[0].pos if self.regions else 0

    def buffer(self) -> memoryview:
        """Where the next bytes read go: the current region, else a spill area (counted as
        early bytes)."""
        if self.regions:
            r = self.regions[0]
            return memoryview(r.frame.dest.data)[r.pos:r.end]
        return memoryview(self._spill)

    def arrived(self, nbytes: int) -> None:
        """``nbytes`` were read into :meth:`buffer`; ValueError when the peer sent more
        than it announced."""
        if not self.regions:
            self.take_early(memoryview(self._spill)[:nbytes])
            return
        self.received += nbytes
        r = self.regions[0]
        r.pos += nbytes
        if r.pos == r.end:
            self.regions.popleft()
            self._region_done(r)
        if not self.regions and self.reader is not None:
            self.reader.pause()

    def take_early(self, data: memoryview | bytes) -> None:
        """Bytes that came before any region did (left over from the read of its HELLO, or
        read into the spill area)."""
        if len(self.early) + len(data) > MAX_EARLY:
            raise ValueError(f"stripe {self.index} sent {len(self.early) + len(data)} bytes "
                             "that no frame announced")
        self.early += data
        self.received += len(data)
        if self.reader is not None:
            self.reader.pause()

    def lost(self, reason: str) -> None:
        """This lane's connection ended: so does the link's main connection."""
        if self.group.main is not None:
            self.group.main.fail(f"stripe {self.index} ended ({reason})")

    @staticmethod
    def _region_done(region: Region) -> None:
        if region.frame.share_done():
            region.frame.owner.stripes_done()


class LaneSet:
    """The lanes of one peer link, receiving side (one per link opening, ``bundle``)."""

    def __init__(self, stripes: int, bundle: int) -> None:
        self.stripes, self.bundle = stripes, bundle
        self.lanes = [Lane(i, self) for i in range(1, stripes)]
        #: the link's main connection, once its HELLO came
        self.main: Reader | None = None

    @property
    def bytes_received(self) -> int:
        """Bytes read from the lanes' connections."""
        return sum(lane.received for lane in self.lanes)

    def attach(self, index: int, reader: Reader) -> Lane:
        """Lane ``index`` is read from ``reader`` now; ValueError when it already is."""
        lane = self.lanes[index - 1]
        if lane.reader is not None:
            raise ValueError(f"a second connection for stripe {index}")
        lane.reader = reader
        if not lane.regions:
            reader.pause()
        return lane

    def announce(self, frame: StripedFrame, start: int, striped: int) -> None:
        """The last ``striped`` bytes of ``frame``'s payload, from ``start``, come over the
        lanes."""
        for lane, (offset, length) in zip(self.lanes, layout(striped, self.stripes),
                                          strict=True):
            lane.expect(Region(frame, start + offset, start + offset + length))

    def close(self, reason: str) -> None:
        """The link is gone: close every lane's connection."""
        self.main = None
        for lane in self.lanes:
            if lane.reader is not None:
                reader, lane.reader = lane.reader, None
                reader.fail(reason)


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
