"""The daemon's links to its peers: addressing, connections, heartbeat (sending is the
:class:`~decentd.net.outbox.Outbox`'s).

gRPC carries the handshake (cluster id, protocol version, ranks, the bulk port and receive
window). Tensor data goes over :mod:`decentd.net.inbound` connections, one per direction of each
peer pair: this module opens ours and writes to it; :mod:`decentd.mailbox.receiver` reads the
peer's. Every frame counts as a heartbeat; an idle link gets an empty frame every interval."""

from __future__ import annotations

import asyncio
import logging
import ssl

from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import owner, readdress
from decentd.net.flow import LinkFlow
from decentd.net.inbound import FrameSink, Gate, Inbound
from decentd.net.late_rounds import RoundMap, peer_id
from decentd.net.loopback import LoopbackSender
from decentd.net.outbound import Sender
from decentd.net.outbox import Outbox
from decentd.net.peer import PeerLink, is_loopback
from decentd.net.stripes import MAX_STRIPES, LaneSet, Striping
from decentd.security.auth import PeerAuth, shown
from decentd.security.refusals import Refusals

log = logging.getLogger("decentd.net.links")



class Links:
    """The links of one daemon to every peer daemon, and to itself (its own workers).

    Ops address peers by the ranks of their level: worker ranks for a worker's keys, daemon
    ranks for node-level keys (:mod:`decentd.keys`). A part goes to the daemon of its
    receiver under the receiver's key, with the sender in ``Part.src``.
    """

    def __init__(self, rank: int, addresses: list[str], cluster_id: str, window: int,
                 topology_digest: str, per_node: int = 1, machine_digest: str = "",
                 auth: PeerAuth | None = None, auth_timeout: float = 10.0,
                 incarnation: int = 0, refusals: Refusals | None = None,
                 striping: Striping | None = None) -> None:
        self.rank = rank
        #: how many connections our link to each peer opens (:mod:`decentd.net.stripes`)
        self.striping = striping or Striping()
        #: this daemon's start (ns since the epoch), told at every handshake
        self.incarnation = incarnation
        self.cluster_id = cluster_id
        #: what peers prove at handshake and HELLO (:mod:`decentd.security.auth`)
        self.auth = auth or PeerAuth("insecure", cluster_id)
        #: incoming bulk connections until their HELLO
        self.gate = Gate(auth_timeout, refusals=refusals)
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
        #: what goes out to the peers: messages, control frames, acknowledgements, credit
        self.outbox = Outbox(self)

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

    def bind_inbound(self, conn: Inbound, hello: pb.BulkHeader) -> bool:
        """A bulk connection said ``hello`` (as rank ``from_rank``, with a ``proof``,
        :mod:`decentd.security.auth`); ValueError closes it if it cannot be that rank's.
        True for the link's main connection, False for a lane of a striped one."""
        src, cluster_id = int(hello.from_rank), hello.cluster_id
        if conn.src >= 0:
            raise ValueError("a second HELLO")
        link = self.link(src)
        if cluster_id != self.cluster_id or link is None:
            raise ValueError(f"HELLO from rank {src} of cluster {shown(cluster_id)}")
        if (src == self.rank) != conn.trusted:
            raise ValueError(f"HELLO as rank {src} (this daemon's own) from the network")
        if not conn.trusted and not self.auth.admit_hello(src, self.rank, hello):
            raise ValueError(f"HELLO as rank {src} without a valid proof (security mode "
                             f"{self.auth.mode})")
        stripes, index = max(1, int(hello.stripes)), int(hello.stripe)
        if stripes > MAX_STRIPES or index >= stripes or (stripes > 1 and conn.trusted):
            raise ValueError(f"HELLO for stripe {index} of {stripes}")
        if not conn.trusted:
            self.gate.settled(conn)
        if index:
            conn.lane = self._lanes(link, stripes, int(hello.bundle)).attach(index, conn)
            conn.src = src
            return False
        if link.inbound is not None:  # a new one comes after a handshake that drops the old
            raise ValueError(f"a second HELLO from rank {src}, which is already connected")
        conn.src = src
        link.inbound = conn
        if stripes > 1:
            conn.lanes = self._lanes(link, stripes, int(hello.bundle))
            conn.lanes.main = conn
        return True

    @staticmethod
    def _lanes(link: PeerLink, stripes: int, bundle: int) -> LaneSet:
        """The lanes of the link opening ``bundle``: an older opening's give way, unless its
        main connection is up (then ``bundle`` is the stale one: ValueError)."""
        lanes = link.lanes
        if lanes is not None and not lanes.closed and lanes.bundle == bundle and \
                lanes.stripes == stripes:
            return lanes
        if lanes is not None and not lanes.closed and lanes.main is not None:
            raise ValueError(f"a stripe of link opening {bundle} while {lanes.bundle} is up")
        if lanes is not None:
            lanes.close("a newer opening of the link")
        link.lanes = LaneSet(stripes, bundle)
        return link.lanes

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
                self.outbox.control(link.rank, beat)
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
        lanes, link.lanes = link.lanes, None
        if lanes is not None:
            lanes.close("the link was dropped")
        link.flow = LinkFlow(self.window)
        link.generation += 1
        link.heartbeat_mark = -1
        return old

    def reopening(self, machine: int) -> None:
        """The link to ``machine`` is being reopened: sends to it wait, payload-free frames
        that must arrive are held (:data:`decentd.net.outbox.HELD_WHILE_REOPENING`)."""
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
                self.outbox.control(machine, header)
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
