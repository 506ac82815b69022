"""An input that its worker is still copying into the arena while its op already runs.

A worker's large private tensor reaches the daemon in chunks: the request comes first (marked
``filling``), then ``Fill`` notes say how many of its bytes are in the arena so far. The op starts
at once; its sender threads write each part of the input as soon as the worker has copied it
(:class:`FillState` is what they wait on), so the copy overlaps the wire instead of preceding it.
Whatever reads the input itself (the weighted sum) waits until it is whole.

The other way, a worker copying a large in-place result out of the arena is told how much of it
is final (:class:`Drain`) while the rest still arrives, so that copy overlaps the wire too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from decent_wire.v1 import decent_pb2 as pb

#: a worker copies gigabytes a second: this long without a byte more, it stopped (paused,
#: dying); well within the heartbeats that a frame waiting for it holds back
STALL = 2.0


class FillState:
    """How much of one input is in the arena: advanced on the event loop, waited on by the
    event loop (:meth:`whole`) and by sender threads (:meth:`wait_past`)."""

    def __init__(self, nbytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self.nbytes = nbytes
        self.filled = 0
        self.released = False  #: the op ended: nothing waits any more, whole or not
        #: bytes of it that sender threads wrote before the copy ended (written by them)
        self.early = 0
        self._cv = threading.Condition()
        self._whole: asyncio.Future[None] = loop.create_future()

    @property
    def complete(self) -> bool:
        """Every byte is in the arena."""
        return self.filled >= self.nbytes

    def advance(self, filled: int) -> None:
        """The worker has copied the first ``filled`` bytes (event loop; never backwards)."""
        with self._cv:
            self.filled = max(self.filled, min(filled, self.nbytes))
            self._cv.notify_all()
        if self.complete and not self._whole.done():
            self._whole.set_result(None)

    def release(self) -> None:
        """The op ended: wake every waiter (a sender still waiting gives its frame up)."""
        with self._cv:
            self.released = True
            self._cv.notify_all()
        if not self._whole.done():
            self._whole.cancel()

    def wake(self) -> None:
        """Wake every waiting sender thread (each checks whether its own wait is over)."""
        with self._cv:
            self._cv.notify_all()

    async def whole(self) -> None:
        """Wait until every byte is in the arena (CancelledError once released short)."""
        if not self.complete:
            await asyncio.shield(self._whole)

    def wait_past(self, filled: int, interrupted: Callable[[], bool] = lambda: False) -> int:
        """Block (a sender thread) until more than ``filled`` bytes are in, or all are; the
        bytes in now. ConnectionAbortedError once the op ended with the input still short,
        the worker copied nothing for :data:`STALL` seconds (a frame started on the wire can
        then not be completed, and the frames behind it, heartbeats too, must not wait), or
        ``interrupted()`` (this waiter's link was closed; others wait on)."""
        with self._cv:
            while True:
                seen = self.filled
                self._cv.wait_for(lambda: self.filled > filled or self.complete
                                          or self.released or interrupted(), STALL)
                if self.filled > filled or self.complete:
                    return self.filled
                if self.released or interrupted() or self.filled == seen:
                    break  # else the copy moves on, short of this waiter's bytes yet
            why = ("ended" if self.released else "lost its link" if interrupted()
                   else f"copied nothing for {STALL:g}s")
            raise ConnectionAbortedError(f"the worker's op {why} before its input was all "
                                         "copied in: the frame carrying it is cut off")


class FillGate:
    """The part of a frame's payload that must wait for a filling input: the payload's bytes
    are the input's from ``base``, after ``head`` bytes of header."""

    def __init__(self, fill: FillState, base: int = 0, head: int = 0) -> None:
        self.fill, self.base, self.head = fill, base, head
        self.interrupted = False  #: the link this frame goes to was closed

    def with_head(self, head: int) -> FillGate:
        """The same gate behind a header of ``head`` bytes."""
        return FillGate(self.fill, self.base, head)

    def ready(self, frame_sent: int, frame_bytes: int) -> int:
        """Bytes of the frame that may go out now, given ``frame_sent`` are out already."""
        if self.fill.complete:
            return frame_bytes - frame_sent
        in_frame = self.head + max(0, self.fill.filled - self.base)
        return max(0, min(frame_bytes, in_frame) - frame_sent)

    def wait(self, frame_sent: int) -> None:
        """Block until at least one more byte of the frame may go out (sender thread)."""
        self.fill.wait_past(self.base + frame_sent - self.head, lambda: self.interrupted)

    def interrupt(self) -> None:
        """The link this frame goes to was closed: its waiting sender thread gives it up
        (the op, and sends of the same input to other peers, go on)."""
        self.interrupted = True
        self.fill.wake()


#: a worker copying a result out is told in steps of at least this many bytes (one note each)
DRAIN_STEP = 2 << 20


class Drain:
    """The output counterpart of a fill: tells the worker (``tell(bytes)``, a partial
    completion) how much of its in-place result is final from the start, so that it copies
    that much out while the rest arrives (``SubmitRequest.draining``). Event loop only."""

    def __init__(self, tell: Callable[[int, pb.Combine | None], None], nbytes: int) -> None:
        self.tell = tell
        self.nbytes = nbytes
        self.told = 0

    def final(self, nbytes: int, combine: pb.Combine | None = None) -> None:
        """The first ``nbytes`` of the output hold their final values (the last bytes are
        left to the op's completion); ``combine``: they hold the in-neighbor's tensor, which
        the worker combines with its own so (SubmitRequest.combining)."""
        if nbytes - self.told >= DRAIN_STEP and nbytes < self.nbytes:
            self.told = nbytes
            self.tell(nbytes, combine)
