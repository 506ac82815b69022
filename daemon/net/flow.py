"""Per-link flow control: how many eager bytes may be in flight each way between two daemons.

Memory is bounded by credit. A sender may have at most the receiver's window of eagerly sent
bytes that the receiver has not consumed yet; a message that does not fit goes as RTS (header
only) and its payload follows the receiver's CTS. The receiver gives consumed bytes back as credit
on the next frame it sends that way, or on its own a moment later (see below).

One :class:`LinkFlow` per peer holds both directions: what we may send (``credits``, our messages
waiting for a CTS) and what the peer may send us (``unconsumed`` bytes against ``window`` and
parts against :data:`MAX_PARTS`, credit we owe it). :class:`Announced` holds the peers' messages
announced by RTS, as many parts per peer at most. Nothing here touches a socket: the link writes
what this decides.

Credit owed goes back on its own only when no frame carried it for a while: soon
(:data:`CREDIT_SOON`) once a quarter of the window is owed (the peer may be running short),
else after :data:`CREDIT_IDLE` (a link that carries frames both ways never needs a frame
of its own for it).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass, field

from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb
from decentd.workers.staging import FillGate

#: the smallest receive window a peer gets, however many peers share the early-arrival budget
MIN_WINDOW = 1 << 20
#: parts a peer may have unconsumed here, each a slot and an arrival whatever its bytes (a flood
#: of empty parts is bounded by this, as bytes are by the window); also the parts it may have
#: announced by RTS and not sent yet
MAX_PARTS = 1 << 16
#: payloads cleared to send whose ops all ended here: dropped if they still come
DISCARD_MEMORY = 4096

#: owed credit of at least a quarter of the window goes back on its own this soon (seconds)
CREDIT_SOON = 0.002
#: less than that goes back on its own this late, if no frame carried it meanwhile
CREDIT_IDLE = 0.05

#: (sending daemon, message id): one message on one link
MessageId = tuple[int, int]


class FlowError(ValueError):
    """A peer broke the flow-control contract (sent past its window)."""


def window_per_peer(early_limit: int, peers: int) -> int:
    """Each peer's share of the early-arrival budget, at least :data:`MIN_WINDOW`."""
    return max(MIN_WINDOW, early_limit // max(1, peers))


@dataclass(eq=False)
class Rendezvous:
    """A message of ours waiting for the receiver's CTS: its payload and who waits for it."""

    payload: list[memoryview]
    name: str
    done: asyncio.Future[None]
    #: the payload frame once queued (its write may be waited for, or skipped)
    queued: object | None = None
    #: the payload is an input its worker is still copying in: it goes out as it is copied
    gate: FillGate | None = None


@dataclass(eq=False)
class LinkFlow:
    """Credit in both directions of one peer link."""

    window: int  #: eager bytes the peer may have unconsumed here
    credits: int = 0  #: eager bytes we may still send before the peer consumes some
    lent: int = 0  #: eager bytes we sent that the peer has not given back yet
    unconsumed: int = 0  #: eager bytes the peer sent that we have not consumed yet
    unconsumed_parts: int = 0  #: parts of those eager messages (empty ones too)
    owed: int = 0  #: credit for consumed payloads not yet given back
    #: the delay of the earliest credit flush scheduled (None: none is)
    flush_pending: float | None = None
    rendezvous: dict[int, Rendezvous] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # ------------------------------------------------------------------ sending

    def next_id(self) -> int:
        """A fresh message id on this link."""
        return next(self.ids)

    def take(self, nbytes: int) -> bool:
        """Spend ``nbytes`` of credit if there is that much (the message may go eagerly)."""
        if nbytes > self.credits:
            return False
        self.credits -= nbytes
        self.lent += nbytes
        return True

    def refund(self, credits: int, owed: int) -> None:
        """A DATA frame was skipped before it went out: its credit, and the credit its header
        carried back to the peer, are ours again."""
        self.credits += credits
        self.lent -= credits
        self.owed += owed

    def returned(self, credit: int) -> None:
        """The peer gave back ``credit`` bytes (the receiver checks it against ``lent``)."""
        self.credits += credit
        self.lent = max(0, self.lent - credit)

    def stamp(self, header: pb.BulkHeader) -> bytes:
        """``header`` encoded as a frame, carrying the credit we owe the peer (and none that
        another peer's stamp left in it: one header may go to every peer)."""
        header.credit = 0
        if self.owed:
            header.credit += self.owed
            self.owed = 0
        return framing.encode(header)

    def fail_rendezvous(self, error: BaseException) -> None:
        """The link is gone: every message waiting for a CTS fails with ``error``."""
        for rdv in self.rendezvous.values():
            if not rdv.done.done():
                rdv.done.set_exception(error)
        self.rendezvous.clear()

    # ------------------------------------------------------------------ receiving

    def accept_eager(self, nbytes: int, peer: int, parts: int = 0) -> None:
        """The peer sent ``nbytes`` eagerly in ``parts`` parts; FlowError past its window (or
        past :data:`MAX_PARTS` parts unconsumed)."""
        if self.unconsumed + nbytes > self.window:
            raise FlowError(f"rank {peer} sent {nbytes} eager bytes with {self.unconsumed} of "
                            f"its {self.window}-byte window in use")
        if self.unconsumed_parts + parts > MAX_PARTS:
            raise FlowError(f"rank {peer} sent {parts} eager parts with {self.unconsumed_parts} "
                            f"unconsumed (at most {MAX_PARTS})")
        self.unconsumed += nbytes
        self.unconsumed_parts += parts

    def parts_consumed(self, parts: int) -> None:
        """``parts`` eager parts were consumed (their credit goes back with their bytes)."""
        self.unconsumed_parts -= parts

    def consumed(self, nbytes: int) -> float | None:
        """``nbytes`` of eager payload were consumed: the delay after which a credit flush
        should run, or None when one as soon is scheduled already."""
        self.unconsumed -= nbytes
        self.owed += nbytes
        delay = CREDIT_SOON if 4 * self.owed >= self.window else CREDIT_IDLE
        if self.flush_pending is not None and self.flush_pending <= delay:
            return None
        self.flush_pending = delay
        return delay

    def flush_due(self) -> bool:
        """A scheduled flush is here: True when credit is still owed (nothing carried it)."""
        self.flush_pending = None
        return self.owed > 0


class Announced:
    """The peers' messages announced by RTS and not sent yet: ``waiting`` for an op here,
    ``cleared`` to send, and of those the ones whose ops all ended here (``discard``: read and
    dropped if they still come, at most :data:`DISCARD_MEMORY`). A link has at most
    :data:`MAX_PARTS` parts waiting or cleared and not to be dropped."""

    def __init__(self) -> None:
        self.waiting: dict[MessageId, pb.BulkHeader] = {}
        self.cleared: dict[MessageId, pb.BulkHeader] = {}
        self.discard: collections.OrderedDict[MessageId, None] = collections.OrderedDict()
        self._parts: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.cleared)

    def hold(self, msg: MessageId, header: pb.BulkHeader, cleared: bool) -> None:
        """Note an announced message; FlowError for an id in use, or past the link's parts."""
        if msg in self.waiting or msg in self.cleared:
            raise FlowError(f"message {msg[1]} announced twice")
        if self._parts[msg[0]] + len(header.parts) > MAX_PARTS:
            raise FlowError(f"more than {MAX_PARTS} parts announced and not sent")
        self._parts[msg[0]] += len(header.parts)
        (self.cleared if cleared else self.waiting)[msg] = header

    def pop(self, msg: MessageId) -> pb.BulkHeader | None:
        """Forget a message (sent, or not to be); its header."""
        counted = msg not in self.discard
        header = self.waiting.pop(msg, None)
        header = self.cleared.pop(msg, None) if header is None else header
        self.discard.pop(msg, None)
        if header is not None and counted:
            self._parts[msg[0]] -= len(header.parts)
        return header

    def dropping(self, msg: MessageId) -> None:
        """A cleared message is about to join ``discard``: its parts stop counting, and the
        oldest there are forgotten to make room for it."""
        header = self.cleared.get(msg)
        if header is None or msg in self.discard:
            return
        self._parts[msg[0]] -= len(header.parts)
        while len(self.discard) >= DISCARD_MEMORY:
            self.pop(next(iter(self.discard)))

    def forget(self) -> None:
        """A new job: no message waits for an op any more, the cleared ones are dropped."""
        for msg in list(self.waiting):
            self.pop(msg)
        for msg in list(self.cleared):
            if msg in self.cleared:
                self.dropping(msg)
                self.discard[msg] = None

    def nbytes(self, msg: MessageId) -> int:
        """The bytes the payload of a cleared message must have; FlowError if not cleared."""
        header = self.cleared.get(msg)
        if header is None:
            raise FlowError(f"a payload for message {msg[1]}, which was not cleared to send")
        return sum(int(p.nbytes) for p in header.parts)

    def payload_parts(self, msg: MessageId) -> list[pb.Part] | None:
        """The parts of a payload that follows our CTS; None when it is to be dropped.
        FlowError for a payload that was never cleared to send."""
        self.nbytes(msg)
        return None if msg in self.discard else list(self.cleared[msg].parts)

    def payload_done(self, msg: MessageId) -> list[pb.Part] | None:
        """A payload after our CTS is complete: its parts (None: drop it)."""
        dropped, header = msg in self.discard, self.cleared.get(msg)
        if header is not None:
            self.pop(msg)
        return None if header is None or dropped else list(header.parts)

    def drop_link(self, link: int) -> None:
        """Daemon ``link`` is gone: its messages will not come."""
        for msg in [m for m in (*self.waiting, *self.cleared) if m[0] == link]:
            self.pop(msg)
        self._parts.pop(link, None)
