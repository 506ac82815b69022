"""A lone part's payload as it arrives, followed by its op in the op's own task.

The receiving side reads a large payload in steps (:mod:`decentd.net.inbound`) and tells the
mailbox after each; the mailbox tells the op that waits for the part. That happens inside the
socket's read callback, so :class:`Arriving` only records how far the payload got and wakes
the op: folding the tensor in, telling the worker what became final, all of it runs in the op
(:func:`follow`), never in the callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import numpy as np

from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")

#: what an op does with a payload that got further: (payload so far, bytes arrived, the
#: sender's weight, the part)
OnArrival = Callable[[np.ndarray, int, float, pb.Part], None]


class Arriving:
    """How far a lone part's payload has arrived (a mailbox ``Progress``)."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.filled = 0
        self.weight = 1.0
        self.part: pb.Part | None = None
        self.seen = 0  #: bytes already handed to the op
        self.closed = False
        self._wake: asyncio.Future[None] | None = None

    def __call__(self, buf: np.ndarray, filled: int, weight: float, part: pb.Part) -> None:
        """``buf[:filled]`` has arrived (the socket's read callback: record and wake only)."""
        self.buf, self.filled, self.weight, self.part = buf, filled, weight, part
        self._notify()

    def close(self) -> None:
        """The part is all here (or the op gave up on it): the follower stops."""
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def updates(self) -> AsyncIterator[tuple[np.ndarray, int, float, pb.Part]]:
        """Each time more has arrived: (payload so far, bytes arrived, weight, part), until
        :meth:`close` (what arrived after the last update is left to the op's end)."""
        while not self.closed:
            if self.buf is not None and self.part is not None and self.filled > self.seen:
                self.seen = self.filled
                yield self.buf, self.filled, self.weight, self.part
                continue
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake


async def follow(arriving: Arriving, on_arrival: OnArrival) -> None:
    """Run ``on_arrival`` for every update of ``arriving`` until it closes."""
    async for buf, filled, weight, part in arriving.updates():
        on_arrival(buf, filled, weight, part)


async def closing(work: Awaitable[T], arriving: Arriving) -> T:
    """``await work``, then close ``arriving`` (whatever happened): its follower stops."""
    try:
        return await work
    finally:
        arriving.close()
