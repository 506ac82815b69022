"""The receiving side of the links: the peers' bulk frames, taken apart.

Each incoming connection is an :class:`~decentd.net.inbound.Inbound` that hands its frames here.
This module checks them against the link's flow control, hands each part of a message to the
:class:`~decentd.mailbox.slots.Mailbox` (or a one-sided window request to the
:mod:`~decentd.windows` services), and gives consumed bytes back as credit. Received payloads live
in pooled buffers, reused step after step; a lone part an op waits for lands straight in that op's
memory.

Everything a peer says is checked before anything is allocated for it or indexed with it: a
payload has exactly the bytes its parts (or its RTS) declared, eager ones fit the link's window
in bytes and parts, a window message describes its tensor exactly. A frame that fails a check,
or that fails while it is handled, is a ValueError: the connection it came on is closed (and
only that one), with a short reason (peer text cut and escaped).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import PeerLost
from decentd.mailbox.arrivals import Arrival, Message
from decentd.mailbox.parking import Parked, ParkedFrames
from decentd.mailbox.slots import Mailbox
from decentd.net.buffers import BufferPool
from decentd.net.flow import LinkFlow
from decentd.net.inbound import Inbound
from decentd.net.late_rounds import peer_id
from decentd.net.links import Links
from decentd.security.auth import shown

log = logging.getLogger("decentd.mailbox.receiver")

_EMPTY = np.empty(0, np.uint8)
#: the largest message a peer may announce: this machine's memory
MAX_MESSAGE = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
#: characters of a failure's text that reach the log; of an ABORT's text that reach an op
SHOWN, ERROR_TEXT = 300, 4096
_ERROR_CODES = frozenset(pb.ErrorCode.values())
#: frames whose parts name rounds (a late peer's are translated into ours)
_PLACED_KINDS = frozenset({pb.DATA, pb.RTS, pb.ACK, pb.ABORT, pb.SKIP})


def _contained(exc: Exception) -> ValueError:
    """A failure while handling a peer's frame, as the ValueError that closes only the
    connection it came on; its text is short (what the peer said is cut and escaped)."""
    text = str(exc)
    if isinstance(exc, ValueError):
        return ValueError(text if len(text) <= SHOWN else shown(text, SHOWN))
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" in {frames[-1].name} line {frames[-1].lineno}" if frames else ""
    return ValueError(f"{type(exc).__name__}{where}: {shown(text, SHOWN // 2)}")


class OneSided(Protocol):
    """The services that answer peers' one-sided requests themselves (the window services,
    :mod:`decentd.windows`), as the receiver hands them their parts."""

    def serves(self, part: pb.Part) -> bool:
        """Whether ``part`` is a request one of them serves (not an op's data)."""

    def serve(self, part: pb.Part, arrival: Arrival) -> None:
        """Answer the one-sided request ``part`` (its bytes: ``arrival``)."""

    def check(self, part: pb.Part) -> None:
        """ValueError unless a window message describes itself exactly."""

    def admit(self, part: pb.Part) -> DecentError | None:
        """Why a request announced by RTS may not be cleared to send (None: it may)."""

    def peer_lost(self, gone: Callable[[int, str], bool]) -> None:
        """The ranks ``gone`` tells are unreachable."""


@dataclass(eq=False)
class _Landing:
    """A lone part's payload being received straight into the waiting op's memory."""

    conn: Inbound
    part: pb.Part
    dest: np.ndarray
    pool: BufferPool
    active: bool = True  #: still landing in the op's memory (not moved to a pooled buffer)

    def cancel(self) -> None:
        """The op ended: the rest of the payload goes to a pooled buffer, dropped on arrival."""
        if self.active and self.conn.receiving_into(self.dest):
            self.conn.redirect(self.dest, self.pool.get(self.dest.nbytes))
            self.active = False


class PeerEvents(Protocol):
    """Who is told when a peer's connection comes and goes (:mod:`decentd.membership.liveness`)."""

    def link_lost(self, src: int, reason: str) -> None:
        """Daemon ``src``'s current connection to us ended."""

    def link_bound(self, src: int) -> None:
        """Daemon ``src`` connected to us and proved who it is (HELLO)."""

    def view(self, src: int, epoch: int, live: list[int]) -> None:
        """Daemon ``src`` told us its membership view."""

    def worker_news(self, job: str, rank: int, joined: bool) -> None:
        """Worker ``rank`` of ``job`` registered (``joined``) or left."""


class Receiver:
    """Where every incoming bulk connection delivers its frames (a ``bulk.FrameSink``)."""

    def __init__(self, links: Links, mailbox: Mailbox, pool: BufferPool, one_sided: OneSided,
                 group_failed: Callable[[str, int, pb.Error], None], peers: PeerEvents,
                 parking: ParkedFrames) -> None:
        self._links = links
        #: frames of late peers kept until an op here places their rounds
        self.parking = parking
        self._peers = peers
        self._mailbox = mailbox
        self._pool = pool
        #: who serves each one-sided window request, by op
        self._one_sided = one_sided
        self._group_failed = group_failed
        self._landing: dict[Inbound, _Landing] = {}
        #: the DATA frame whose header just arrived on a connection: whether its rounds were
        #: placed, and its parts, checked
        self._heard: dict[Inbound, tuple[bool, list[pb.Part]]] = {}

    def on_header(self, conn: Inbound, header: pb.BulkHeader) -> np.ndarray | None:
        """Where a frame's payload goes: a pooled buffer of exactly its size, or the memory of
        the op that waits for its lone part."""
        try:
            return self._header(conn, header)
        except Exception as exc:
            raise _contained(exc) from None

    def _header(self, conn: Inbound, header: pb.BulkHeader) -> np.ndarray | None:
        if conn.src < 0:
            raise ValueError("data before HELLO")
        size = int(header.payload_bytes)
        if header.kind == pb.PAYLOAD:
            self._announced_size(conn.src, int(header.message_id), size)
            parts = self._mailbox.announced.payload_parts((conn.src, int(header.message_id)))
            if parts is None:  # its ops ended here: read and dropped
                return self._pool.get(size)
        elif header.kind == pb.DATA:
            parts = self._described(conn.src, header.parts, size)
            self._flow(conn.src).accept_eager(size, conn.src, len(parts))
            placed = self._place(conn.src, header)
            self._heard[conn] = (placed, parts)
            if not placed:  # a late peer's, before our op of it started: kept whole
                return self._pool.get(size)
        else:
            raise ValueError(f"a payload on a frame of kind {header.kind}")
        if any(self._one_sided.serves(p) for p in parts):
            return self._pool.get(size)
        self._mailbox.header(conn, parts)
        if len(parts) == 1:
            dest = self._mailbox.landing_target(parts[0], size)
            if dest is not None:
                landing = self._landing[conn] = _Landing(conn, parts[0], dest, self._pool)
                self._mailbox.landing(parts[0], landing)
                return dest
        return self._pool.get(size)

    def _flow(self, src: int) -> LinkFlow:
        link = self._links.link(src)
        if link is None:
            raise ValueError("data before HELLO")
        return link.flow

    def _checked(self, src: int, parts: Iterable[pb.Part]) -> list[pb.Part]:
        """``parts`` from daemon ``src``, each naming a sender there and a receiver here."""
        plist = list(parts)
        for p in plist:
            self._links.check_sender(src, p)
        return plist

    def _described(self, src: int, parts: Iterable[pb.Part], size: int) -> list[pb.Part]:
        """The parts of a message from daemon ``src`` (:meth:`_checked`), a window message
        describing its tensor exactly, and all of them ``size`` bytes (-1: announced, at most
        :data:`MAX_MESSAGE`)."""
        plist = self._checked(src, parts)
        for p in plist:
            self._one_sided.check(p)
        declared = sum(int(p.nbytes) for p in plist)
        if size < 0 and declared > MAX_MESSAGE:
            raise ValueError(f"a message of {declared} bytes announced, more than this "
                             f"machine's {MAX_MESSAGE} bytes of memory")
        if size >= 0 and declared != size:
            raise ValueError(f"parts of {declared} bytes in a {size}-byte payload")
        return plist

    def _announced_size(self, src: int, message_id: int, size: int) -> None:
        """ValueError unless a payload of ``size`` follows our CTS for its message."""
        announced = self._mailbox.announced.nbytes((src, message_id))
        if size != announced:
            raise ValueError(f"a {size}-byte payload for message {message_id}, announced with "
                             f"{announced} bytes")

    def on_progress(self, conn: Inbound, header: pb.BulkHeader, dest: np.ndarray,
                    filled: int) -> None:
        """Part of a payload arrived: a lone part's waiting op may fold it in already."""
        heard = self._heard.get(conn)
        if heard is not None and not heard[0]:
            return
        if header.kind == pb.PAYLOAD:
            parts = self._mailbox.announced.payload_parts((conn.src, int(header.message_id)))
        else:
            parts = heard[1] if heard is not None else list(header.parts)
        if parts is not None and len(parts) == 1:
            self._mailbox.progress(parts[0], dest, filled)

    def on_frame(self, conn: Inbound, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        """Dispatch one complete frame; ValueError closes the connection it came on."""
        try:
            self._frame(conn, header, payload)
        except Exception as exc:
            raise _contained(exc) from None

    def _frame(self, conn: Inbound, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        self._mailbox.arrived(conn)
        kind = header.kind
        if kind == pb.HELLO:
            if self._links.bind_inbound(conn, header) and not conn.trusted:
                self._peers.link_bound(conn.src)
            return
        src = conn.src
        link = self._links.link(src)
        if link is None:
            raise ValueError("data before HELLO")
        if not conn.trusted and link.inbound is not conn:
            return  # a connection dropped with its link: what it still carried is void
        link.last_heartbeat = time.monotonic()
        if header.credit > link.flow.lent:
            raise ValueError(f"{header.credit} bytes of credit given back, {link.flow.lent} lent")
        link.flow.returned(int(header.credit))
        landing = self._landing.pop(conn, None)
        if landing is not None:
            self._mailbox.landing(landing.part, None)
        pooled = landing is None or not landing.active
        placed, described = self._heard.pop(conn, (None, None))
        if placed is None and kind != pb.PAYLOAD:
            placed = self._place(src, header)
        if placed is False:
            if self._links.rounds.placeable(src, header):  # an op placed its rounds meanwhile
                self._replay(Parked(src, header, payload))
            else:
                self.parking.park(src, header, payload)
            return
        self._dispatch(src, header, payload, pooled, described)

    def _dispatch(self, src: int, header: pb.BulkHeader, payload: np.ndarray | None,
                  pooled: bool, described: list[pb.Part] | None = None) -> None:
        """A frame whose rounds are ours, to whoever takes it (``described``: its parts,
        checked when its header came)."""
        kind, size = header.kind, int(header.payload_bytes)
        link = self._links.link(src)
        if kind == pb.DATA:
            parts = described or self._described(src, header.parts, size)
            if not size and link is not None:  # no header call: its parts count now
                link.flow.accept_eager(0, src, len(parts))
            self._split(src, parts, payload, size, size, pooled, eager=True)
        elif kind == pb.PAYLOAD:
            if not size:
                self._announced_size(src, int(header.message_id), 0)
            cleared = self._mailbox.announced.payload_done((src, int(header.message_id)))
            if cleared is None:  # its ops ended here meanwhile
                if payload is not None and pooled:
                    self._pool.put(payload)
                return
            self._split(src, cleared, payload, size, 0, pooled)
        else:
            self._control(src, header)

    def _place(self, src: int, header: pb.BulkHeader) -> bool:
        """Put a late peer's rounds into ours (:mod:`decentd.net.late_rounds`); False: not yet (our
        op of one of its names has not started)."""
        rounds = self._links.rounds
        if not rounds.any_late or header.kind not in _PLACED_KINDS or \
                any(self._one_sided.serves(p) for p in header.parts):
            return True
        if not rounds.placeable(src, header):
            return False
        rounds.translate(header)
        return True

    def replay_placeable(self) -> None:
        """Dispatch the parked frames that can be placed now (an op just placed a late peer's
        rounds, :meth:`decentd.net.late_rounds.RoundMap.establish`)."""
        for frame in self.parking.placeable(self._links.rounds):
            self._replay(frame)

    def _replay(self, frame: Parked) -> None:
        """A parked frame can be placed now."""
        self._links.rounds.translate(frame.header)
        try:
            self._dispatch(frame.src, frame.header, frame.payload, True)
        except Exception as exc:  # its connection may be gone: only this frame is lost
            log.warning("a frame from rank %d kept for a late op failed: %s", frame.src,
                        shown(str(exc), SHOWN), extra={"peer": frame.src})

    def _control(self, src: int, header: pb.BulkHeader) -> None:
        """A frame without payload: RTS, CTS, ACK or ABORT."""
        kind = header.kind
        if kind == pb.RTS:
            mid = int(header.message_id)
            parts = self._described(src, header.parts, -1)
            if any(self._one_sided.serves(p) for p in parts):  # the window service takes it now
                self._window_rts(src, mid, header, parts)
            else:
                self._mailbox.announce(src, mid, header)
        elif kind == pb.CTS:
            self._links.outbox.cleared(src, int(header.message_id))
        elif kind == pb.SKIP:
            self._mailbox.skipped(self._checked(src, header.parts), lambda p: PeerLost(
                f"rank {p.src} ran round {p.round} without this rank (their link dropped)"))
        elif kind == pb.RAN_WITHOUT:
            self._mailbox.ran_without(self._ours(src, header.parts), lambda p: PeerLost(
                f"rank {p.src} ran round {p.round} without this rank (one of them counted the "
                "other out)"))
        elif kind == pb.VIEW:
            if len(header.view_live) > len(self._links.links) + 1:
                raise ValueError(f"a view of {len(header.view_live)} live daemons")
            self._peers.view(src, int(header.view_epoch), [int(r) for r in header.view_live])
        elif kind in (pb.WORKER_LEFT, pb.WORKER_JOINED):
            self._worker_news(src, header)
        elif kind == pb.ACK:
            self._mailbox.acked(self._checked(src, header.parts))
        elif kind == pb.ABORT:
            if not header.parts or header.error.code not in _ERROR_CODES:
                raise ValueError(f"ABORT of {len(header.parts)} ops with error code "
                                 f"{header.error.code}")
            header.error.message = header.error.message[:ERROR_TEXT]
            link = self._links.link(src)
            if link is not None:
                link.aborts_received += 1
            for p in self._checked(src, header.parts):
                if p.op == pb.GROUP_RESULT:  # a group round failed at its leader: no op of ours
                    self._group_failed(p.name, int(p.round), header.error)
                else:
                    self._mailbox.aborted([p], header.error)
        else:
            raise ValueError(f"a frame of unknown kind {kind}")

    def _ours(self, src: int, parts: Iterable[pb.Part]) -> list[pb.Part]:
        """``parts`` from daemon ``src`` (:meth:`_checked`) with their rounds in ours; those
        of a late peer that no op here placed yet are left out."""
        rounds, placed = self._links.rounds, []
        for p in self._checked(src, parts):
            ours = rounds.incoming(peer_id(int(p.src), p.name), p.name, int(p.round))
            if ours is not None:
                p.round = ours
                placed.append(p)
        return placed

    def _window_rts(self, src: int, mid: int, header: pb.BulkHeader,
                    parts: list[pb.Part]) -> None:
        """A window request too large to go eagerly travels alone, and is cleared to send at
        once when its window can take its bytes; refused (ABORT, or the group round failed
        here) when it cannot."""
        if len(parts) != 1:
            raise ValueError(f"a window request in a message of {len(parts)} parts")
        p = parts[0]
        refused = self._one_sided.admit(p)
        if refused is None:
            self._mailbox.clear_at_once(src, mid, header)
        elif p.op == pb.GROUP_RESULT:
            self._group_failed(p.name, int(p.round), refused.to_pb())
        else:
            self._links.outbox.send_abort(int(p.src), [(p.name, int(p.round))], refused.to_pb())

    def _worker_news(self, src: int, header: pb.BulkHeader) -> None:
        """Daemon ``src`` says one of its workers left or (re)joined."""
        if len(header.parts) != 1 or header.parts[0].src // self._links.per_node != src:
            raise ValueError(f"worker news from rank {src} about another daemon's worker")
        job, rank = header.parts[0].name, int(header.parts[0].src)
        self._peers.worker_news(job, rank, header.kind == pb.WORKER_JOINED)

    def _split(self, src: int, parts: Iterable[pb.Part], payload: np.ndarray | None,
               total: int, credit: int, pooled: bool, eager: bool = False) -> None:
        """Hand each part of a message to whoever takes it; the payload is released (and its
        credit given back, and its parts when it came ``eager``) with the last part."""
        plist = list(parts)
        declared = sum(int(p.nbytes) for p in plist)
        if declared != total or not plist:
            if payload is not None and pooled:
                self._pool.put(payload)
            raise ValueError(f"parts of {declared} bytes in a {total}-byte payload")
        link = self._links.link(src)
        msg = Message(src, payload if pooled else None, len(plist), credit, self._released,
                      len(plist) if eager else 0, link.generation if link is not None else 0)
        offset = 0
        for i, p in enumerate(plist):
            n = int(p.nbytes)
            data = payload[offset:offset + n] if payload is not None else _EMPTY
            offset += n
            shape = tuple(int(s) for s in p.meta.shape)
            arrival = Arrival(int(p.src), int(p.op), int(p.meta.dtype), shape, float(p.weight),
                              data, msg, step=int(p.step), p=float(p.p), topology=p.topology,
                              agreement=p.agreement)
            if not self._one_sided.serves(p):
                self._mailbox.deliver(p, arrival)
                continue
            try:
                self._one_sided.serve(p, arrival)
            except Exception:  # the message is released with what was handed out before
                msg.refs -= len(plist) - i - 1
                arrival.release()
                raise

    def _released(self, msg: Message) -> None:
        if msg.buf is not None:
            self._pool.put(msg.buf)
            msg.buf = None
        link = self._links.link(msg.src)
        if link is None or link.generation != msg.generation:
            return  # it came over connections that are gone: nothing to give back
        self._links.outbox.consumed(msg.src, msg.credit)
        if msg.parts:
            link.flow.parts_consumed(msg.parts)

    def on_lost(self, conn: Inbound, reason: str) -> None:
        """An incoming connection ended: when it was the peer's current one, the peer is down."""
        self._mailbox.arrived(conn)
        self._heard.pop(conn, None)
        landing = self._landing.pop(conn, None)
        partial = conn.take_partial()
        if landing is not None:
            self._mailbox.landing(landing.part, None)
        if partial is not None and (landing is None or not landing.active):
            self._pool.put(partial[1])
        src = self._links.inbound_lost(conn)
        if src is not None:
            self._peers.link_lost(src, reason)
