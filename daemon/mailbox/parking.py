"""Frames from peers that joined late, kept until an op here places their rounds.

A late peer's rounds are translated into ours (:mod:`decentd.net.late_rounds`) once our first
op of a name involves it; a frame that comes before that op starts is parked here, whole
header and payload, and dispatched again by the receiver once it can be placed. A parked frame
given up (too many kept, its link dropped) returns its buffer to the pool and its credit to its
sender.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

from decent_wire.v1 import decent_pb2 as pb
from decentd.net.buffers import BufferPool
from decentd.net.late_rounds import RoundMap
from decentd.net.links import Links

#: frames of late peers kept until their ops start here, at most (the oldest are dropped)
MAX_PARKED = 4096


@dataclass(eq=False)
class Parked:
    """A frame from a late peer that names a round we cannot place yet."""

    src: int  #: the daemon it came from
    header: pb.BulkHeader
    payload: np.ndarray | None


class ParkedFrames:
    """The frames kept for ops that have not started here yet."""

    def __init__(self, links: Links, pool: BufferPool) -> None:
        self._links = links
        self._pool = pool
        self._frames: collections.deque[Parked] = collections.deque()

    def __len__(self) -> int:
        return len(self._frames)

    def park(self, src: int, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        """Keep a frame until its parts can be placed (the oldest is given up past
        :data:`MAX_PARKED`)."""
        self._frames.append(Parked(src, header, payload))
        while len(self._frames) > MAX_PARKED:
            self._give_up(self._frames.popleft())

    def placeable(self, rounds: RoundMap) -> list[Parked]:
        """The frames whose rounds ``rounds`` can place now, taken out of the parking."""
        ready = [f for f in self._frames if rounds.placeable(f.src, f.header)]
        for frame in ready:
            self._frames.remove(frame)
        return ready

    def drop_from(self, src: int) -> None:
        """Daemon ``src``'s link dropped: its parked frames are void."""
        for frame in [f for f in self._frames if f.src == src]:
            self._frames.remove(frame)
            self._give_up(frame)

    def _give_up(self, frame: Parked) -> None:
        """A parked frame is given up: its buffer back to the pool, its credit to the peer."""
        if frame.payload is not None:
            self._pool.put(frame.payload)
        if frame.header.kind == pb.DATA:
            self._links.outbox.consumed(frame.src, int(frame.header.payload_bytes))
