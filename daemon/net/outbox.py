"""What goes out to the peers: messages of tensors (eager within the receiver's window, else
announced by RTS and sent once cleared), payload-free control frames, acknowledgements, aborts,
and credit given back for what we consumed.

The :class:`Outbox` addresses peers through the links (:mod:`decentd.net.links`), which own
it: a part goes to the daemon of its receiver under the receiver's key, translated for a peer
that joined late.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import PeerLost
from decentd.keys import OpKey, display_name, owner, part
from decentd.net.flow import Rendezvous
from decentd.net.outbound import Buffer, Outgoing, Sender
from decentd.net.peer import PeerLink
from decentd.workers.staging import FillGate

log = logging.getLogger("decentd.net.outbox")


class Peers(Protocol):
    """How the outbox finds and addresses a peer (:class:`decentd.net.links.Links`)."""

    rank: int
    links: dict[int, PeerLink]
    per_node: int

    def link(self, machine: int) -> PeerLink | None:
        """The link to daemon ``machine``."""

    def link_of(self, peer: int, name: str) -> PeerLink | None:
        """The link that reaches ``peer`` for key ``name``."""

    def unplaced(self, peer: int, parts: list[pb.Part]) -> bool:
        """Whether late ``peer`` cannot place a round of ``parts``."""

    def addressed(self, peer: int, parts: list[pb.Part]) -> list[pb.Part]:
        """Copies of ``parts`` addressed to ``peer``."""


#: parts per RAN_WITHOUT frame (a daemon remembers a few thousand keys)
RAN_WITHOUT_PARTS = 1024
#: a cancelled op whose half-written message is still not out after this long says so in the log
WRITE_GRACE = 5.0
#: payload-free frames held while a link is reopened, sent once it is up: an op's failure, its
#: skip, and parts without payload (a refusal's descriptions, a window unlock), whose peers
#: would otherwise wait for them until their timeout
HELD_WHILE_REOPENING = frozenset({pb.ABORT, pb.SKIP, pb.DATA})


def _settle(fut: asyncio.Future[None], err: BaseException | None, rank: int, name: str) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    elif isinstance(err, asyncio.CancelledError):
        fut.set_exception(DecentError(pb.ABORTED, f"op '{display_name(name)}': cancelled "
                                                  "before it was sent"))
    else:
        fut.set_exception(PeerLost(f"op '{display_name(name)}': sending to rank {rank} failed "
                                   f"({type(err).__name__}: {err})"))


def _striped(link: PeerLink, size: int) -> int:
    """Bytes of a ``size``-byte payload to ``link`` that go over its lanes."""
    return link.sender.stripe_bytes(size) if link.sender is not None else 0


class Outbox:
    """Every frame this daemon sends to its peers (and to itself, over its loopback link)."""

    def __init__(self, peers: Peers) -> None:
        self._peers = peers

    async def _link(self, dst: int, name: str) -> PeerLink:
        """The link to ``dst``, waiting while it is reopened; PeerLost once it is down."""
        link = self._peers.link_of(dst, name)
        if link is not None and not link.connected and link.back is not None and \
                not await asyncio.shield(link.back):
            raise PeerLost(f"op '{display_name(name)}': rank {dst} went down while the op "
                           "waited for its link to come back")
        if link is None or link.sender is None or not link.connected:
            raise PeerLost(f"op '{display_name(name)}': rank {dst} is not connected to rank "
                           f"{self._peers.rank}")
        return link

    async def _write(self, link: PeerLink, buffers: list[Buffer], name: str,
                     refund: tuple[int, int] | None = None,
                     track: list[tuple[Outgoing, int]] | None = None, header: int = 0,
                     gate: FillGate | None = None, striped: int = 0) -> None:
        """Write one frame to ``link`` and wait until the kernel has all of it.

        A frame is never abandoned half-way: its payload is read straight from the worker's arena
        slot, so a cancelled op waits for a frame already being written (a torn frame would break
        the stream, and a freed slot could send its next tensor under this key). A frame still
        queued when its op is cancelled is skipped.
        """
        assert link.sender is not None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        flow = link.flow  # a link torn down meanwhile has another

        def done(err: BaseException | None) -> None:
            if isinstance(err, asyncio.CancelledError) and refund is not None:
                flow.refund(*refund)  # skipped: the peer never saw it
            _settle(fut, err, link.rank, name)

        gate = None if gate is None else gate.with_head(header)
        item = link.sender.send(buffers, done, gate, striped)
        if item is not None and track is not None:
            track.append((item, header))  # (frame, header bytes): its payload's progress
        if item is None:
            await fut
            return
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self._abandon(fut, item, link, name)
            raise

    @staticmethod
    async def _abandon(fut: asyncio.Future[None], item: Outgoing, link: PeerLink,
                       name: str) -> None:
        """Skip a queued frame; wait (through cancellations) for one already being written."""
        if link.sender is None or not link.sender.abandon(item):
            return
        warned = False
        while not fut.done():
            try:
                await asyncio.wait({fut}, timeout=WRITE_GRACE)
            except asyncio.CancelledError:
                continue
            if not fut.done() and not warned:
                warned = True
                log.warning("op '%s': a message to rank %d is still being written %gs after "
                            "its op ended; rank %d is not reading: closing the connection",
                            display_name(name), link.rank, WRITE_GRACE, link.rank)
                link.connected = False
                if link.sender is not None:
                    link.sender.abort()

    async def send_parts(self, dst: int, parts: list[pb.Part], payload: list[memoryview],
                         track: list[tuple[Outgoing, int]] | None = None,
                         gate: FillGate | None = None) -> None:
        """Send one message to ``dst``: ``parts`` with their bytes ``payload`` (one buffer per
        part, gathered by the kernel: nothing is copied into a message buffer).

        Returns once the kernel has every byte: eagerly when the receiver's window has room,
        otherwise after the receiver's CTS. ``gate``: the one payload is an input still being
        copied in; a sender thread writes it as it is copied (this daemon's own workers get it
        once it is whole).
        """
        name = parts[0].name
        link = self._peers.link_of(dst, name)
        if link is None or link.sender is None or not link.connected:  # it may come back
            link = await self._link(dst, name)
        if gate is not None and not isinstance(link.sender, Sender):
            await gate.fill.whole()
            gate = None
        if self._peers.unplaced(dst, parts):
            raise PeerLost(f"rank {dst} ran rounds of '{display_name(name)}' without this one "
                           "since this op started: it knows nothing of this round")
        parts = self._peers.addressed(dst, parts)
        payload = [b for b in payload if len(b)]
        size = sum(len(b) for b in payload)
        flow = link.flow
        mid = flow.next_id()
        if flow.take(size):
            striped = _striped(link, size)
            header = pb.BulkHeader(kind=pb.DATA, message_id=mid, payload_bytes=size, parts=parts,
                                   stripe_bytes=striped)
            stamped = flow.stamp(header)
            await self._write(link, [stamped, *payload], name, (size, int(header.credit)),
                              track, len(stamped), gate, striped)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        rdv = Rendezvous(payload, name, done, gate=gate)
        flow.rendezvous[mid] = rdv
        try:
            rts = pb.BulkHeader(kind=pb.RTS, message_id=mid, payload_bytes=0, parts=parts)
            await self._write(link, [flow.stamp(rts)], name)
            await asyncio.shield(done)  # the CTS queues the payload; this is its write
        except BaseException:
            flow.rendezvous.pop(mid, None)
            if isinstance(rdv.queued, Outgoing) and not done.done():  # queued or going out
                await self._abandon(done, rdv.queued, link, name)
            raise

    def cleared(self, dst: int, mid: int) -> None:
        """Daemon ``dst`` cleared our message ``mid`` to send: its payload goes out now."""
        link = self._peers.link(dst)
        if link is None:
            return
        rdv = link.flow.rendezvous.pop(mid, None)
        if rdv is None or rdv.done.done() or link.sender is None:
            return  # its op gave up meanwhile
        size = sum(len(b) for b in rdv.payload)
        striped = _striped(link, size)
        header = pb.BulkHeader(kind=pb.PAYLOAD, message_id=mid, payload_bytes=size,
                               stripe_bytes=striped)
        done, name = rdv.done, rdv.name  # not rdv: the callback must not keep its payload
        stamped = link.flow.stamp(header)
        gate = None if rdv.gate is None else rdv.gate.with_head(len(stamped))
        item = link.sender.send([stamped, *rdv.payload],
                                lambda err: _settle(done, err, link.rank, name), gate, striped)
        rdv.queued = item if item is not None else Outgoing([], None, started=True)

    async def send_data(
        self, dst: int, name: str, round_: int, tag: int, op: int, dtype: int,
        shape: tuple[int, ...], payload: memoryview, weight: float = 1.0,
        gate: FillGate | None = None,
    ) -> None:
        """Send one tensor to ``dst`` (a one-part message)."""
        await self.send_parts(
            dst, [part(name, round_, tag, op, dtype, shape, len(payload), weight)], [payload],
            gate=gate)

    def control(self, dst: int, header: pb.BulkHeader) -> None:
        """Send a payload-free frame to daemon ``dst`` (best effort: a dead peer is ignored;
        an ABORT, a SKIP or parts without payload wait while the link is reopened)."""
        link = self._peers.link(dst)
        if link is None:
            return
        if link.sender is None or not link.connected:
            if link.back is not None and header.kind in HELD_WHILE_REOPENING:
                link.held.append(header)
            return
        link.sender.send([link.flow.stamp(header)])

    def send_skip(self, dst: int, keys: list[OpKey]) -> None:
        """Tell peer ``dst`` that our op of ``keys`` ran without it (its link dropped)."""
        self._to_peer(dst, [pb.Part(name=name, round=round_) for name, round_ in keys],
                      pb.BulkHeader(kind=pb.SKIP))

    def send_ran_without(self, machine: int, keys: list[OpKey]) -> None:
        """Tell daemon ``machine``, counted out and back, the last round of each of our keys
        that ran without it (:mod:`decentd.mailbox.horizons`), addressed to each of its
        workers (or to it, for node-level keys); rounds it cannot place yet are left out."""
        per = self._peers.per_node
        parts: list[pb.Part] = []
        for name, round_ in keys:
            try:
                node_level = owner(name) is None
            except ValueError:  # no owner: no peer's op pairs with it
                continue
            ours = [pb.Part(name=name, round=round_)]
            peers = [machine] if node_level else range(machine * per, (machine + 1) * per)
            for peer in peers:
                if not self._peers.unplaced(peer, ours):
                    parts.extend(self._peers.addressed(peer, ours))
        for at in range(0, len(parts), RAN_WITHOUT_PARTS):
            self.control(machine, pb.BulkHeader(kind=pb.RAN_WITHOUT,
                                                 parts=parts[at:at + RAN_WITHOUT_PARTS]))

    def tell_all(self, header: pb.BulkHeader) -> None:
        """Send a payload-free frame to every daemon, this one included (best effort)."""
        for machine in [self._peers.rank, *self._peers.links]:
            self.control(machine, header)

    def _to_peer(self, dst: int, parts: list[pb.Part], header: pb.BulkHeader) -> None:
        """A payload-free frame of ``parts`` (ours) to peer ``dst`` (best effort)."""
        if not parts or self._peers.unplaced(dst, parts):
            return
        link = self._peers.link_of(dst, parts[0].name)
        if link is not None:
            header.parts.extend(self._peers.addressed(dst, parts))
            self.control(link.rank, header)

    def send_nowait(self, dst: int, parts: list[pb.Part]) -> None:
        """Send parts without payload to peer ``dst`` now, not waiting for the kernel (nor
        for a link being reopened: they go out once it is up)."""
        link = self._peers.link_of(dst, parts[0].name) if parts else None
        if link is not None:
            self._to_peer(dst, parts, pb.BulkHeader(kind=pb.DATA, payload_bytes=0,
                                                    message_id=link.flow.next_id()))

    def send_acks(self, dst: int, keys: list[OpKey], tag: int, arrived: bool) -> None:
        """Tell peer ``dst`` that its parts with ``tag`` were matched here by our ops of
        ``keys``; ``arrived``: only after their payload had all arrived (counted apart)."""
        link = self._peers.link_of(dst, keys[0][0]) if keys else None
        if link is not None:
            if arrived:
                link.acks_late += len(keys)
            else:
                link.acks_early += len(keys)
        self._to_peer(dst, [pb.Part(name=name, round=round_, tag=tag) for name, round_ in keys],
                      pb.BulkHeader(kind=pb.ACK))

    def send_cts(self, dst: int, message_id: int) -> None:
        """Clear daemon ``dst`` to send the payload of its message ``message_id``."""
        self.control(dst, pb.BulkHeader(kind=pb.CTS, message_id=message_id))

    def send_abort(self, dst: int, keys: list[OpKey], error: pb.Error,
                   op: int = pb.OP_UNSPECIFIED) -> None:
        """Tell peer ``dst`` that our op of the tensors ``keys`` failed here (``op``
        GROUP_RESULT: that a group round failed at its leader)."""
        self._to_peer(dst, [pb.Part(name=name, round=round_, op=op) for name, round_ in keys],
                      pb.BulkHeader(kind=pb.ABORT, error=error))

    # ------------------------------------------------------------------ credit given back

    def consumed(self, src: int, credit: int) -> None:
        """We consumed ``credit`` eager bytes from daemon ``src``: given back on the next frame
        to it, or by itself a moment later (:meth:`LinkFlow.consumed`)."""
        link = self._peers.link(src)
        if link is None or not credit:
            return
        delay = link.flow.consumed(credit)
        if delay is not None:
            asyncio.get_running_loop().call_later(delay, self._flush_credit, link)

    def _flush_credit(self, link: PeerLink) -> None:
        if link.flow.flush_due():
            self.control(link.rank, pb.BulkHeader(kind=pb.ACK))
