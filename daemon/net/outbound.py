"""The sending side of the bulk data path: one :class:`Sender` per peer connection.

When nothing is queued, the event loop writes what the socket takes of a frame's head with a
non-blocking ``sendmsg``; the rest goes to the sender's thread, which writes it with blocking
``sendmsg`` calls (the GIL is released while the kernel copies) directly from the worker's
shared-memory slot. Frames are framed as :mod:`decentd.net.inbound` describes.

A striped link (:mod:`decentd.net.stripes`) has more connections, its lanes, each a
:class:`Sender` of its own: a large payload's last bytes are handed to them (a
:class:`~decentd.net.stripes.Pull` they take chunks of) when its frame starts on the main
connection, so that striped frames are numbered in the main connection's order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decentd.net.stripes import (
    CHUNK_HEAD,
    NOTSENT_LOWAT,
    Countdown,
    Pull,
    stripe_bytes,
    window,
)
from decentd.workers.arena import fault_in
from decentd.workers.staging import FillGate

#: the sender thread writes at most this much per call, and updates its progress in between
SLICE = 1 << 20
#: when nothing is queued, the event loop writes what the socket takes of a frame's first this
#: many bytes at once; the sender thread writes the rest (the link starts without a thread switch)
DIRECT_HEAD = 2 << 20
#: Linux's TCP_NOTSENT_LOWAT (Python names it from 3.12 only)
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)

Buffer = bytes | bytearray | memoryview


@dataclass
class Outgoing:
    """One frame waiting for the sender thread."""

    buffers: list[Buffer]
    on_done: Callable[[BaseException | None], None] | None
    abandoned: bool = False  # its op was cancelled: skip it if not started
    started: bool = False
    sent: int = 0  # bytes of the whole frame in the kernel so far (header included)
    write: int = -1  # the sender's write (sendmsg call) that took its last byte
    #: its payload is an input still being copied in: bytes go out as they are copied
    gate: FillGate | None = None
    #: its payload's striped bytes, handed to the lanes when it starts (striped links)
    striped: Striped | None = None
    #: (a lane's item) the striped bytes it takes chunks of
    pull: Pull | None = None


@dataclass
class Striped:
    """A frame's striped bytes before its frame starts."""

    buffers: list[Buffer]
    on_done: Callable[[BaseException | None], None]
    gate: FillGate | None  #: their first byte is the input's at ``gate.base``


def _take(buffers: list[Buffer], limit: int, total: int | None = None) -> list[Buffer]:
    """The first ``limit`` bytes of ``buffers`` (at most 64 of them; ``total``: their bytes,
    if known). ``buffers`` itself when all of it fits."""
    if len(buffers) <= 64 and (sum(map(len, buffers)) if total is None else total) <= limit:
        return buffers
    out: list[Buffer] = []
    for b in buffers[:64]:
        n = len(b)
        if n >= limit:
            out.append(memoryview(b)[:limit])
            break
        out.append(b)
        limit -= n
    return out


def _advance(buffers: list[Buffer], sent: int) -> list[Buffer]:
    """What is left of ``buffers`` after ``sent`` bytes went out."""
    rest: list[Buffer] = []
    for b in buffers:
        n = len(b)
        if sent >= n:
            sent -= n
            continue
        rest.append(memoryview(b)[sent:] if sent else b)
        sent = 0
    return rest


def sendmsg(sock: socket.socket, buffers: list[Buffer], flags: int = 0) -> int:
    """``sock.sendmsg``; memory a worker shrank away (EFAULT) is faulted in as zeros first."""
    try:
        return sock.sendmsg(buffers, (), flags)
    except OSError as exc:
        if exc.errno != errno.EFAULT:
            raise
        fault_in(buffers)
        return sock.sendmsg(buffers, (), flags)


class Sender:
    """The outgoing connection to one peer: frames go out whole and in order."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, peer: int,
                 on_broken: Callable[[Sender, BaseException], None] | None = None,
                 lanes: Sequence[socket.socket] = ()) -> None:
        """``on_broken(sender, error)`` runs on ``loop`` once when a write fails (on any
        connection of the link); ``lanes``: the other connections of a striped link, each
        already greeted with its HELLO."""
        self.sock = sock
        self.loop = loop
        self.peer = peer
        self._on_broken = on_broken
        for lane in lanes:
            with contextlib.suppress(OSError):
                lane.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
        self.lanes = [Sender(lane, loop, peer, self._lane_broken) for lane in lanes]
        self._striped_frames = 0  #: striped frames started (their numbers on the wire)
        #: bytes written to this connection
        self.written = 0
        #: frames sent, and the writes (sendmsg calls) that carried them: everything queued for
        #: this peer goes out together, several frames per write
        self.frames = 0
        self.writes = 0
        self.error: BaseException | None = None
        #: a TLS connection (no sendmsg: buffers are written one by one)
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._cv = threading.Condition()
        self._queue: collections.deque[Outgoing] = collections.deque()
        self._busy = False
        self._closed = False
        #: the gate of a frame whose input the thread is waiting for (its worker copies it in)
        self._held: FillGate | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"decentd-send-{peer}")
        self._thread.start()

    @property
    def stripes(self) -> int:
        """Connections of the link (1: not striped)."""
        return 1 + len(self.lanes)

    @property
    def bytes_sent(self) -> int:
        """Bytes written to the link (every connection of it)."""
        return self.written + sum(lane.written for lane in self.lanes)

    def stripe_bytes(self, payload: int) -> int:
        """Of a ``payload``-byte frame, the bytes the lanes carry (its header says so)."""
        return stripe_bytes(payload, self.stripes)

    def send(self, buffers: list[Buffer],
             on_done: Callable[[BaseException | None], None] | None = None,
             gate: FillGate | None = None, striped: int = 0,
             queued: bool = False, pull: Pull | None = None) -> Outgoing | None:
        """Queue one frame (header and payload buffers); ``on_done`` runs on the event loop.
        ``gate``: the payload is an input still being copied in (the thread writes it);
        ``striped``: the payload's last bytes that go over the lanes (:meth:`stripe_bytes`);
        ``queued``: the thread writes it even when nothing else is queued; ``pull`` (a
        lane's): take chunks of those striped bytes (``gate``: where they start in the input).

        Returns the queued item (to abandon it), or None when it went out at once.
        """
        shares: Striped | None = None
        if striped:
            buffers, shares, on_done = self._shares(buffers, striped, on_done, gate)
        total = sum(map(len, buffers))
        with self._cv:
            if self.error is not None or self._closed:
                self._refuse(on_done, pull is not None)
                return None
            if gate is not None or queued:
                item = Outgoing(buffers, on_done, gate=gate, striped=shares, pull=pull)
                self._queue.append(item)
                self._cv.notify()
                return item
            if not self._busy and not self._queue and not self._tls:
                self._hand_out(shares)  # this frame goes next: its striped bytes may start
                head = _take(buffers, DIRECT_HEAD, total)  # at most 64 buffers: < IOV_MAX
                try:
                    sent = sendmsg(self.sock, head, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self._broken(exc)
                    if on_done is not None:
                        on_done(exc)
                    return None
                self.written += sent
                self.writes += sent > 0
                if sent == total:
                    self.frames += 1
                    if on_done is not None:
                        on_done(None)
                    return None
                buffers = _advance(buffers, sent)
                total -= sent
                # part of the frame (or of its shares) is on the wire: the rest must follow
                item = Outgoing(buffers, on_done, started=sent > 0 or shares is not None,
                                sent=sent)
                self._queue.append(item)
                self._cv.notify()
                return item
            item = Outgoing(buffers, on_done, striped=shares)
            self._queue.append(item)
            self._cv.notify()
            return item

    def _refuse(self, on_done: Callable[[BaseException | None], None] | None,
                threaded: bool) -> None:
        """A frame for a connection that failed or closed fails (``threaded``: the caller is
        the main connection's sender thread, handing a lane its chunks: on the loop)."""
        err = self.error or ConnectionError(f"connection to rank {self.peer} is closed")
        if on_done is not None and threaded:
            with contextlib.suppress(RuntimeError):  # the loop is gone
                self.loop.call_soon_threadsafe(on_done, err)
        elif on_done is not None:
            on_done(err)

    def _shares(self, buffers: list[Buffer], striped: int,
                on_done: Callable[[BaseException | None], None] | None,
                gate: FillGate | None) -> tuple[list[Buffer], Striped,
                                                Callable[[BaseException | None], None]]:
        """The main connection's part of a frame, its last ``striped`` payload bytes for the
        lanes, and the callback that ends the frame once both are out."""
        total = sum(map(len, buffers))
        own, rest = window(buffers, 0, total - striped), window(buffers, total - striped, striped)
        ending = Countdown(on_done or (lambda err: None), 2)
        start = total - striped - len(buffers[0])  # in the payload (buffers[0]: the header)
        return own, Striped(rest, ending, None if gate is None else
                            FillGate(gate.fill, gate.base + start)), ending

    def _hand_out(self, striped: Striped | None) -> None:
        """The frame of ``striped`` starts (lock held): number it, and let the lanes take
        its chunks."""
        if striped is None:
            return
        ending, loop = striped.on_done, self.loop

        def written() -> None:  # a lane's thread wrote the last chunk
            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(ending, None)
        pull = Pull(self._striped_frames, striped.buffers, written)
        self._striped_frames += 1
        for lane in self.lanes:
            lane.send([], ending, striped.gate, queued=True, pull=pull)

    def _lane_broken(self, lane: Sender, exc: BaseException) -> None:
        """A lane's write failed: the whole link is broken (on the loop)."""
        with self._cv:
            self._broken(exc)
        self.abort()

    @property
    def queued(self) -> int:
        """Frames waiting for the sender thread."""
        with self._cv:
            return len(self._queue)

    @property
    def idle(self) -> bool:
        """Nothing queued or going out (on any connection of the link)."""
        with self._cv:
            if self._busy or self._queue:
                return False
        return all(lane.idle for lane in self.lanes)

    def abandon(self, item: Outgoing) -> bool:
        """Skip ``item`` if the thread has not started it; True when it is already going out."""
        with self._cv:
            item.abandoned = True
            return item.started

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = self._take_queued()
                self._busy = True
            err: BaseException | None = None
            try:
                for item in batch:  # a lane's items (nothing else is queued on a lane)
                    if item.pull is not None:
                        self._drain(item.pull, item.gate)
                self._write([item for item in batch if item.pull is None])
            except OSError as exc:
                err = exc
            with self._cv:
                self._busy = False
                if err is not None:
                    self._broken(err)
            for item in batch:
                if item.buffers or (item.pull is not None and err is not None):
                    self._done(item, err)  # not all of it went out

    def _drain(self, pull: Pull, gate: FillGate | None) -> None:
        """Take chunks of a striped frame's bytes and write them, until none are left (the
        lanes take turns: a slower connection takes fewer)."""
        while (chunk := pull.take()) is not None:
            offset, buffers = chunk
            chunk_gate = None if gate is None else \
                FillGate(gate.fill, gate.base + offset, CHUNK_HEAD.size)
            self._write([Outgoing(buffers, None, gate=chunk_gate, started=True)])
            pull.wrote(sum(map(len, buffers)) - CHUNK_HEAD.size)

    def _take_queued(self) -> list[Outgoing]:
        """Every frame queued now (lock held), in order; abandoned ones are dropped."""
        batch = []
        while self._queue:
            item = self._queue.popleft()
            if item.abandoned and not item.started:
                self._done(item, asyncio.CancelledError())
                continue
            item.started = True
            self._hand_out(item.striped)
            item.striped = None  # the lanes hold those bytes now (not this item, kept a while)
            batch.append(item)
        return batch

    def _write(self, batch: list[Outgoing]) -> None:
        """Write the frames of ``batch`` back to back, gathered into as few calls as the
        kernel allows (in slices, so that each frame's progress is visible)."""
        pending = list(batch)
        while pending:
            buffers = [b for item in pending for b in item.buffers]
            sent = self._write_slice(_take(buffers, self._ready(pending)))
            self.written += sent
            self.writes += 1
            while pending and sent:
                item = pending[0]
                left = sum(len(b) for b in item.buffers)
                step = min(sent, left)
                if item.gate is not None and not item.gate.fill.complete:
                    item.gate.fill.early += step
                item.sent += step
                item.buffers = _advance(item.buffers, step)
                sent -= step
                if step == left:
                    item.write = self.writes
                    self.frames += 1
                    self._done(item, None)
                    pending.pop(0)

    def _ready(self, pending: list[Outgoing]) -> int:
        """How much of ``pending`` (at most a slice) may go out now: up to the first byte of
        a gated frame that its worker has not copied in yet (waiting for one if need be)."""
        if all(item.gate is None for item in pending):  # the usual case: nothing to wait for
            return SLICE
        ahead = 0
        for item in pending:
            left = sum(len(b) for b in item.buffers)
            if item.gate is not None:
                frame = item.sent + left
                ready = item.gate.ready(item.sent, frame)
                if ready == 0 and ahead == 0:
                    with self._cv:
                        self._held = item.gate
                    try:
                        item.gate.wait(item.sent)
                    finally:
                        with self._cv:
                            self._held = None
                    ready = item.gate.ready(item.sent, frame)
                if ready < left:
                    return min(SLICE, ahead + ready)
            ahead += left
            if ahead >= SLICE:
                break
        return SLICE

    def _write_slice(self, chunk: list[Buffer]) -> int:
        """Write ``chunk`` (gathered, or buffer by buffer over TLS); the bytes written."""
        if not self._tls:
            return sendmsg(self.sock, chunk)
        for b in chunk:
            self.sock.sendall(b)
        return sum(len(b) for b in chunk)

    def _done(self, item: Outgoing, err: BaseException | None) -> None:
        item.buffers, item.striped, item.pull = [], None, None
        if item.on_done is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                self.loop.call_soon_threadsafe(item.on_done, err)

    def _broken(self, exc: BaseException) -> None:
        """The connection failed: every queued frame fails with it (lock held)."""
        if self.error is None:
            self.error = exc
            if self._on_broken is not None and not self._closed:
                with contextlib.suppress(RuntimeError):  # the loop is gone
                    self.loop.call_soon_threadsafe(self._on_broken, self, exc)
        while self._queue:
            self._done(self._queue.popleft(), exc)

    def abort(self) -> None:
        """Break the connection now: a write blocked on a peer that stopped reading fails, and
        so does a frame waiting for a worker that stopped copying its input in."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with self._cv:
            if self._held is not None:
                self._held.interrupt()
        for lane in self.lanes:
            lane.abort()

    def close(self) -> None:
        """Stop after what is queued; the socket is shut down for writing."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=2.0)  # what it started has been handed to the lanes
        for lane in self.lanes:
            lane.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        self.sock.close()
