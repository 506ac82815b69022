"""The daemon's links to its peers: connect, handshake, heartbeat, and sending.

gRPC carries the handshake (cluster id, protocol version, ranks, the bulk port and receive
window). Tensor data goes over :mod:`decentd.net.inbound` connections, one per direction of each
peer pair: this module opens ours and writes to it; :mod:`decentd.mailbox.receiver` reads the
peer's. Every frame counts as a heartbeat; an idle link gets an empty frame every interval."""

from __future__ import annotations

import asyncio
import logging
import ssl

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import PeerLost
from decentd.keys import OpKey, display_name, owner, part, readdress
from decentd.net.flow import LinkFlow, Rendezvous
from decentd.net.inbound import FrameSink, Gate, Inbound
from decentd.net.late_rounds import RoundMap, peer_id
from decentd.net.loopback import LoopbackSender
from decentd.net.outbound import Buffer, Outgoing, Sender
from decentd.net.peer import PeerLink, is_loopback
from decentd.security.auth import PeerAuth, shown
from decentd.workers.staging import FillGate

log = logging.getLogger("decentd.net.links")



#: a cancelled op whose half-written message is still not out after this long says so in the log
WRITE_GRACE = 5.0


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


class Links:
    """The links of one daemon to every peer daemon, and to itself (its own workers).

    Ops address peers by the ranks of their level: worker ranks for a worker's keys, daemon
    ranks for node-level keys (:mod:`decentd.keys`). A part goes to the daemon of its
    receiver under the receiver's key, with the sender in ``Part.src``.
    """

    def __init__(self, rank: int, addresses: list[str], cluster_id: str, window: int,
                 topology_digest: str, per_node: int = 1, machine_digest: str = "",
                 auth: PeerAuth | None = None, auth_timeout: float = 10.0,
                 incarnation: int = 0) -> None:
        self.rank = rank
        #: this daemon's start (ns since the epoch), told at every handshake
        self.incarnation = incarnation
        self.cluster_id = cluster_id
        #: what peers prove at handshake and HELLO (:mod:`decentd.security.auth`)
        self.auth = auth or PeerAuth("insecure", cluster_id)
        #: incoming bulk connections until their HELLO
        self.gate = Gate(auth_timeout)
        #: eager bytes each peer may have unconsumed here (its receive window)
        self.window = window
        #: Topology.digest() of this daemon's topology: peers must have the same
        self.topology_digest = topology_digest
        #: workers per daemon: worker r is on daemon r // per_node
        self.per_node = per_node
        #: Topology.digest() of the daemons' machine topology: peers must have the same
        self.machine_digest = machine_digest
        self.links = {r: PeerLink(r, a, LinkFlow(window)) for r, a in enumerate(addresses)
                      if r != rank}
        #: this daemon as its own peer: parts between its workers (see :meth:`start_loopback`)
        self.own = PeerLink(rank, addresses[rank] if addresses else "local", LinkFlow(window))
        self._loopback = [is_loopback(a) for a in addresses]
        self.data_port = 0
        self._server: asyncio.Server | None = None
        #: round offsets of peers that joined late (restarted, or not up at start)
        self.rounds = RoundMap()

    # ------------------------------------------------------------------ addressing

    def machine_of(self, peer: int, name: str) -> int:
        """The daemon of ``peer``, a worker rank for a worker's key ``name``, a daemon rank for
        a node-level key."""
        return peer if owner(name) is None else peer // self.per_node

    def link(self, machine: int) -> PeerLink | None:
        """The link to daemon ``machine`` (this one's own for itself)."""
        return self.own if machine == self.rank else self.links.get(machine)

    def link_of(self, peer: int, name: str) -> PeerLink | None:
        """The link that reaches ``peer`` for key ``name``."""
        return self.link(self.machine_of(peer, name))

    def unplaced(self, peer: int, parts: list[pb.Part]) -> bool:
        """Whether any of ``parts`` names a round that late ``peer`` cannot place (our op
        started before it came back, :mod:`decentd.net.late_rounds`)."""
        return self.rounds.any_late and any(
            self.rounds.unplaced(peer_id(peer, p.name), p) for p in parts)

    def addressed(self, peer: int, parts: list[pb.Part]) -> list[pb.Part]:
        """Copies of our ``parts`` addressed to ``peer``: under its key, from us."""
        out = []
        for p in parts:
            q = pb.Part()
            q.CopyFrom(p)
            who = owner(p.name)
            if self.rounds.any_late:
                q.round = self.rounds.outgoing(peer_id(peer, p.name), p.name, int(p.round))
            if who is None:
                q.src = self.rank
            else:
                q.src = who
                q.name = readdress(p.name, peer)
            out.append(q)
        return out

    def check_sender(self, machine: int, part: pb.Part) -> None:
        """ValueError unless ``part``, which came from daemon ``machine``, names a sender there
        and a receiver here."""
        who = owner(part.name)
        if who is None:
            if part.src != machine:
                raise ValueError(f"a node-level part from rank {machine} claims rank {part.src}")
            return
        if part.src // self.per_node != machine or who // self.per_node != self.rank:
            raise ValueError(f"a part from worker {part.src} to worker {who} came from daemon "
                             f"{machine} to daemon {self.rank}")

    def start_loopback(self, sink: FrameSink) -> None:
        """Connect this daemon to itself: frames between its workers go to ``sink`` in-process."""
        self.own.sender = LoopbackSender(sink, self.rank, self.cluster_id)
        self.own.connected = True

    # ------------------------------------------------------------------ connection setup

    async def listen(self, host: str, port: int, sink: FrameSink,
                     tls: ssl.SSLContext | None = None) -> int:
        """Accept the peers' bulk connections on ``host`` (port 0: any free one), each read by
        an :class:`~decentd.net.inbound.Inbound` that hands its frames to ``sink`` (over TLS with
        ``tls``); the port."""
        loop = asyncio.get_running_loop()
        bind = host.strip("[]") or "0.0.0.0"  # one address family: never a second port
        self._server = await loop.create_server(
            lambda: Inbound(sink, self.gate), bind, port, reuse_address=True, ssl=tls,
            ssl_handshake_timeout=self.gate.timeout if tls else None)
        self.data_port = int(self._server.sockets[0].getsockname()[1])
        return self.data_port

    def bind_inbound(self, conn: Inbound, src: int, cluster_id: str, proof: bytes) -> None:
        """A bulk connection said HELLO as rank ``src`` with ``proof``
        (:mod:`decentd.security.auth`); ValueError closes it if it cannot be that rank's."""
        if conn.src >= 0:
            raise ValueError("a second HELLO")
        link = self.link(src)
        if cluster_id != self.cluster_id or link is None:
            raise ValueError(f"HELLO from rank {src} of cluster {shown(cluster_id)}")
        if (src == self.rank) != conn.trusted:
            raise ValueError(f"HELLO as rank {src} (this daemon's own) from the network")
        if not conn.trusted and not self.auth.admit_hello(src, self.rank, proof):
            raise ValueError(f"HELLO as rank {src} without a valid proof (security mode "
                             f"{self.auth.mode})")
        if not conn.trusted:
            self.gate.settled(conn)
        if link.inbound is not None:  # a new one comes after a handshake that drops the old
            raise ValueError(f"a second HELLO from rank {src}, which is already connected")
        conn.src = src
        link.inbound = conn

    def inbound_lost(self, conn: Inbound) -> int | None:
        """A bulk connection ended: its peer's rank when it was that peer's current one."""
        link = self.links.get(conn.src)
        if link is None or link.inbound is not conn:
            return None
        link.inbound = None
        return link.rank

    def heartbeat(self, beat: pb.BulkHeader) -> None:
        """One heartbeat tick: send ``beat`` on each bulk connection that carried nothing since
        the last tick, so that every peer hears from us at least every two intervals (its
        ``last_heartbeat``). Any frame counts, so busy links cost nothing, and an idle one
        costs one small write."""
        for link in self.links.values():
            if link.sender is None or not link.connected:
                continue
            # a link that is busy, or stuck behind a peer that stopped reading, gets none:
            # heartbeats must not pile up in its queue
            if link.sender.bytes_sent == link.heartbeat_mark and link.sender.idle:
                self.control(link.rank, beat)
            link.heartbeat_mark = link.sender.bytes_sent

    def teardown(self, machine: int) -> Sender | LoopbackSender | None:
        """Drop both connections with daemon ``machine`` and start its flow control afresh
        (frames still queued fail); the old sender, for the caller to close off the loop."""
        link = self.links[machine]
        old, link.sender = link.sender, None
        link.connected = False
        if old is not None:
            old.abort()
        inbound, link.inbound = link.inbound, None
        if inbound is not None and inbound.transport is not None:
            inbound.transport.abort()
        link.flow = LinkFlow(self.window)
        link.generation += 1
        link.heartbeat_mark = -1
        return old

    def reopening(self, machine: int) -> None:
        """The link to ``machine`` is being reopened: sends to it wait, ABORT and SKIP frames
        are held."""
        link = self.links[machine]
        if link.back is None:
            link.back = asyncio.get_running_loop().create_future()

    def reopened(self, machine: int, flush: bool) -> None:
        """The link is up again: what waited goes on, and the held frames go out (``flush``),
        or are dropped (the peer restarted, or both sides counted it out)."""
        link = self.links[machine]
        held, link.held = link.held, []
        if flush:
            for header in held:
                self.control(machine, header)
        self._settle_back(link, True)

    def given_up(self, machine: int) -> None:
        """The peer is down: sends that waited for the link fail; held frames are dropped."""
        link = self.links[machine]
        link.held = []
        self._settle_back(link, False)

    @staticmethod
    def _settle_back(link: PeerLink, up: bool) -> None:
        back, link.back = link.back, None
        if back is not None and not back.done():
            back.set_result(up)

    async def close(self) -> None:
        """Close every connection and channel."""
        loop = asyncio.get_running_loop()
        senders = [link.sender for link in self.links.values() if link.sender is not None]
        await asyncio.gather(*(loop.run_in_executor(None, s.close) for s in senders))
        if self.own.sender is not None:
            self.own.sender.close()
        self.own.connected = False
        for link in self.links.values():
            link.connected = False
            if link.inbound is not None and link.inbound.transport is not None:
                link.inbound.transport.close()
            if link.channel is not None:
                await link.channel.close(grace=None)
        if self._server is not None:
            self._server.close()

    def same_host(self, machine: int) -> bool:
        """Daemon ``machine`` is this one, or both are addressed on loopback in the cluster's
        peer list (which every daemon shares, so ``machine`` gives the same answer about us)."""
        return machine == self.rank or (self._loopback[self.rank] and self._loopback[machine])

    # ------------------------------------------------------------------ sending

    async def _link(self, dst: int, name: str) -> PeerLink:
        """The link to ``dst``, waiting while it is reopened; PeerLost once it is down."""
        link = self.link_of(dst, name)
        if link is not None and not link.connected and link.back is not None and \
                not await asyncio.shield(link.back):
            raise PeerLost(f"op '{display_name(name)}': rank {dst} went down while the op "
                           "waited for its link to come back")
        if link is None or link.sender is None or not link.connected:
            raise PeerLost(f"op '{display_name(name)}': rank {dst} is not connected to rank "
                           f"{self.rank}")
        return link

    async def _write(self, link: PeerLink, buffers: list[Buffer], name: str,
                     refund: tuple[int, int] | None = None,
                     track: list[tuple[Outgoing, int]] | None = None, header: int = 0,
                     gate: FillGate | None = None) -> None:
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

        item = link.sender.send(buffers, done, None if gate is None else gate.with_head(header))
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
        link = self.link_of(dst, name)
        if link is None or link.sender is None or not link.connected:  # it may come back
            link = await self._link(dst, name)
        if gate is not None and not isinstance(link.sender, Sender):
            await gate.fill.whole()
            gate = None
        if self.unplaced(dst, parts):
            raise PeerLost(f"rank {dst} ran rounds of '{display_name(name)}' without this one "
                           "since this op started: it knows nothing of this round")
        parts = self.addressed(dst, parts)
        payload = [b for b in payload if len(b)]
        size = sum(len(b) for b in payload)
        flow = link.flow
        mid = flow.next_id()
        if flow.take(size):
            header = pb.BulkHeader(kind=pb.DATA, message_id=mid, payload_bytes=size, parts=parts)
            stamped = flow.stamp(header)
            await self._write(link, [stamped, *payload], name, (size, int(header.credit)),
                              track, len(stamped), gate)
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
        link = self.link(dst)
        if link is None:
            return
        rdv = link.flow.rendezvous.pop(mid, None)
        if rdv is None or rdv.done.done() or link.sender is None:
            return  # its op gave up meanwhile
        size = sum(len(b) for b in rdv.payload)
        header = pb.BulkHeader(kind=pb.PAYLOAD, message_id=mid, payload_bytes=size)
        done, name = rdv.done, rdv.name  # not rdv: the callback must not keep its payload
        stamped = link.flow.stamp(header)
        item = link.sender.send([stamped, *rdv.payload],
                                lambda err: _settle(done, err, link.rank, name),
                                None if rdv.gate is None else rdv.gate.with_head(len(stamped)))
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
        an ABORT or SKIP waits while the link is reopened)."""
        link = self.link(dst)
        if link is None:
            return
        if link.sender is None or not link.connected:
            if link.back is not None and header.kind in (pb.ABORT, pb.SKIP):
                link.held.append(header)
            return
        link.sender.send([link.flow.stamp(header)])

    def send_skip(self, dst: int, keys: list[OpKey]) -> None:
        """Tell peer ``dst`` that our op of ``keys`` ran without it (its link dropped)."""
        self._to_peer(dst, [pb.Part(name=name, round=round_) for name, round_ in keys],
                      pb.BulkHeader(kind=pb.SKIP))

    def tell_all(self, header: pb.BulkHeader) -> None:
        """Send a payload-free frame to every daemon, this one included (best effort)."""
        for machine in [self.rank, *self.links]:
            self.control(machine, header)

    def _to_peer(self, dst: int, parts: list[pb.Part], header: pb.BulkHeader) -> None:
        """A payload-free frame of ``parts`` (ours) to peer ``dst`` (best effort)."""
        if not parts or self.unplaced(dst, parts):
            return
        link = self.link_of(dst, parts[0].name)
        if link is not None:
            header.parts.extend(self.addressed(dst, parts))
            self.control(link.rank, header)

    def send_nowait(self, dst: int, parts: list[pb.Part]) -> None:
        """Send parts without payload to peer ``dst`` now, not waiting for the kernel."""
        link = self.link_of(dst, parts[0].name) if parts else None
        if link is not None:
            self._to_peer(dst, parts, pb.BulkHeader(kind=pb.DATA, payload_bytes=0,
                                                    message_id=link.flow.next_id()))

    def send_acks(self, dst: int, keys: list[OpKey], tag: int, arrived: bool) -> None:
        """Tell peer ``dst`` that its parts with ``tag`` were matched here by our ops of
        ``keys``; ``arrived``: only after their payload had all arrived (counted apart)."""
        link = self.link_of(dst, keys[0][0]) if keys else None
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
        link = self.link(src)
        if link is None or not credit:
            return
        delay = link.flow.consumed(credit)
        if delay is not None:
            asyncio.get_running_loop().call_later(delay, self._flush_credit, link)

    def _flush_credit(self, link: PeerLink) -> None:
        if link.flow.flush_due():
            self.control(link.rank, pb.BulkHeader(kind=pb.ACK))
