"""Per-link flow control: how many eager bytes may be in flight each way between two daemons.

Memory is bounded by credit. A sender may have at most the receiver's window of eagerly sent
bytes that the receiver has not consumed yet; a message that does not fit goes as RTS (header
only) and its payload follows the receiver's CTS. The receiver gives consumed bytes back as credit
on the next frame it sends that way, or on its own a moment later.

One :class:`LinkFlow` per peer holds both directions: what we may send (``credits``, our messages
waiting for a CTS) and what the peer may send us (``unconsumed`` against ``window``, credit we owe
it). Nothing here touches a socket: the link writes what this decides.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb

#: the smallest receive window a peer gets, however many peers share the early-arrival budget
MIN_WINDOW = 1 << 20


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


@dataclass(eq=False)
class LinkFlow:
    """Credit in both directions of one peer link."""

    window: int  #: eager bytes the peer may have unconsumed here
    credits: int = 0  #: eager bytes we may still send before the peer consumes some
    unconsumed: int = 0  #: eager bytes the peer sent that we have not consumed yet
    owed: int = 0  #: credit for consumed payloads not yet given back
    flush_scheduled: bool = False
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
        return True

    def refund(self, credits: int, owed: int) -> None:
        """A DATA frame was skipped before it went out: its credit, and the credit its header
        carried back to the peer, are ours again."""
        self.credits += credits
        self.owed += owed

    def returned(self, credit: int) -> None:
        """The peer gave back ``credit`` bytes."""
        self.credits += credit

    def stamp(self, header: pb.BulkHeader) -> bytes:
        """``header`` encoded as a frame, carrying the credit we owe the peer."""
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

    def accept_eager(self, nbytes: int, peer: int) -> None:
        """The peer sent ``nbytes`` eagerly; FlowError past its window."""
        if self.unconsumed + nbytes > self.window:
            raise FlowError(f"rank {peer} sent {nbytes} eager bytes with {self.unconsumed} of "
                            f"its {self.window}-byte window in use")
        self.unconsumed += nbytes

    def consumed(self, nbytes: int) -> bool:
        """``nbytes`` of eager payload were consumed; True when a credit flush should be
        scheduled (none is pending)."""
        self.unconsumed -= nbytes
        self.owed += nbytes
        if self.flush_scheduled:
            return False
        self.flush_scheduled = True
        return True

    def flush_due(self) -> bool:
        """The scheduled flush is here: True when credit is still owed (nothing carried it)."""
        self.flush_scheduled = False
        return self.owed > 0
