"""One peer as the links see it (:class:`PeerLink`), and the small helpers of addressing:
a peer address's host, and whether it is on loopback."""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass, field

import grpc

from decent_wire.v1 import decent_pb2 as pb
from decentd.net.flow import LinkFlow
from decentd.net.inbound import Inbound
from decentd.net.loopback import LoopbackSender
from decentd.net.outbound import Sender
from decentd.net.stripes import LaneSet


def host_of(address: str) -> str:
    """The host part of a ``host:port`` peer address (IPv6 without its brackets)."""
    return address.rsplit(":", 1)[0].strip("[]")


def is_loopback(address: str) -> bool:
    """Whether a ``host:port`` peer address is on this host's loopback."""
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


@dataclass
class PeerLink:
    """Everything about one peer: control channel, bulk connections, flow, counters."""

    rank: int
    address: str
    flow: LinkFlow
    channel: grpc.aio.Channel | None = None
    sender: Sender | LoopbackSender | None = None
    inbound: Inbound | None = None
    connected: bool = False  #: our connection to the peer is up
    last_heartbeat: float = 0.0  #: when the peer was last heard from (any frame)
    heartbeat_mark: int = -1  #: bytes sent to the peer at the last heartbeat tick
    acks_early: int = 0  #: parts acknowledged before their payload had all arrived
    acks_late: int = 0  #: parts acknowledged only after: the op here started after the arrival
    aborts_received: int = 0  #: ABORT frames from the peer
    #: bumped whenever both connections are dropped and flow control starts afresh: what was
    #: received or lent before must not count against the new connections
    generation: int = 0
    #: while the link is being reopened: resolved True when it is up again, False when the
    #: peer is declared down (sends wait for it; None: no reconnect under way)
    back: asyncio.Future[bool] | None = None
    #: ABORT and SKIP frames for the peer held while the link is reopened (sent once it is up)
    held: list[pb.BulkHeader] = field(default_factory=list)
    #: the lanes of the peer's striped connection to us (:mod:`decentd.net.stripes`)
    lanes: LaneSet | None = None
    #: the round trip (seconds) our bulk connection measured when it opened
    connect_rtt: float = 0.0

    @property
    def bytes_sent(self) -> int:
        """Bytes written to the peer's bulk connection."""
        return self.sender.bytes_sent if self.sender is not None else 0

    @property
    def frames_sent(self) -> int:
        """Frames written to the peer's bulk connection."""
        return self.sender.frames if isinstance(self.sender, Sender) else 0

    @property
    def writes(self) -> int:
        """Writes (sendmsg calls) that carried them."""
        return self.sender.writes if isinstance(self.sender, Sender) else 0

    @property
    def bytes_received(self) -> int:
        """Bytes read from the peer's bulk connections."""
        lanes = self.lanes.bytes_received if self.lanes is not None else 0
        return lanes + (self.inbound.bytes_received if self.inbound is not None else 0)
