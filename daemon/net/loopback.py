"""The daemon as its own peer: what one local worker sends another never touches a socket.

A :class:`LoopbackSender` stands where a peer's :class:`~decentd.net.outbound.Sender` would. It
hands each frame, on the event loop, to an :class:`~decentd.net.inbound.Inbound` of this daemon
exactly as a socket would have (the same parser, flow control, mailbox and landing in place), so a
tensor goes from the sending worker's memory straight into the receiving op's memory or a pooled
buffer: one copy."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb
from decentd.net.inbound import FrameSink, Inbound
from decentd.net.outbound import Buffer, Outgoing
from decentd.workers.staging import FillGate

log = logging.getLogger("decentd.net.loopback")


class LoopbackSender:
    """Frames to this daemon's own workers, delivered in order on the event loop."""

    def __init__(self, sink: FrameSink, rank: int, cluster_id: str) -> None:
        self.inbound = Inbound(sink)
        self.loop = asyncio.get_running_loop()
        self.bytes_sent = 0
        self._queue: collections.deque[Outgoing] = collections.deque()
        self._draining = False
        hello = pb.BulkHeader(kind=pb.HELLO, cluster_id=cluster_id, from_rank=rank)
        self.send([framing.encode(hello)])

    @staticmethod
    def stripe_bytes(payload: int) -> int:
        """Nothing is striped: frames never leave the process."""
        return 0

    def send(self, buffers: list[Buffer],
             on_done: Callable[[BaseException | None], None] | None = None,
             gate: FillGate | None = None, striped: int = 0) -> Outgoing:
        """Queue one frame; ``on_done`` runs once the receiving side has all of it (``gate``
        must be None: inputs reach this daemon's workers whole; ``striped`` 0)."""
        assert gate is None and not striped
        item = Outgoing(list(buffers), on_done)
        self._queue.append(item)
        if not self._draining:
            self._draining = True
            self.loop.call_soon(self._drain)
        return item

    @property
    def idle(self) -> bool:
        """Nothing queued."""
        return not self._queue

    @staticmethod
    def abandon(item: Outgoing) -> bool:
        """Skip ``item`` if it was not delivered yet (it is never half-way: False)."""
        item.abandoned = True
        return False

    def _drain(self) -> None:
        # a frame delivered here may make the receiving side send (an ACK, a reply): those are
        # queued behind and delivered in this same pass, never inside another's delivery
        try:
            while self._queue:
                item = self._queue.popleft()
                if item.abandoned:
                    self._done(item, asyncio.CancelledError())
                    continue
                item.started = True
                try:
                    self._feed(item.buffers)
                except Exception as exc:  # a bug on the receiving side: this frame fails
                    log.exception("loopback delivery failed")
                    self._done(item, exc)
                    continue
                self._done(item, None)
        finally:
            self._draining = False

    def _feed(self, buffers: list[Buffer]) -> None:
        """Hand the frame's bytes to the inbound parser the way a socket read would."""
        for buf in buffers:
            data = memoryview(buf).cast("B")
            while len(data):
                view = self.inbound.get_buffer(len(data))
                n = min(len(view), len(data))
                view[:n] = data[:n]
                self.inbound.buffer_updated(n)
                self.bytes_sent += n
                data = data[n:]

    @staticmethod
    def _done(item: Outgoing, err: BaseException | None) -> None:
        item.buffers = []
        if item.on_done is not None:
            item.on_done(err)

    def abort(self) -> None:
        """Nothing to break."""

    def close(self) -> None:
        """Frames still queued fail."""
        while self._queue:
            self._done(self._queue.popleft(), ConnectionError("the daemon is stopping"))
