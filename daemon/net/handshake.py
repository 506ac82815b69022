"""The callee's checks of a peer's handshake: the same cluster, protocol, rank, workers per node
and topologies, and a rank that is one of our peers."""

from __future__ import annotations

from decent_wire.protocol import PROTOCOL_VERSION
from decent_wire.v1 import decent_pb2 as pb
from decentd.net.links import Links
from decentd.security.auth import shown


def check_handshake(links: Links, request: pb.HandshakeRequest) -> pb.Error | None:
    """Validate a peer's handshake; an Error to send back when it must be refused."""
    theirs = request.from_rank
    if request.cluster_id != links.cluster_id:
        return pb.Error(code=pb.CLUSTER_MISMATCH, message=(
            f"rank {theirs} is in cluster {shown(request.cluster_id)}, this daemon (rank "
            f"{links.rank}) is in {links.cluster_id!r}"))
    if request.protocol_version != PROTOCOL_VERSION:
        return pb.Error(code=pb.VERSION_MISMATCH, message=(
            f"rank {theirs} speaks protocol {request.protocol_version}, rank {links.rank} "
            f"speaks {PROTOCOL_VERSION}"))
    if request.to_rank != links.rank:
        return pb.Error(code=pb.RANK_MISMATCH, message=(
            f"rank {theirs} expected rank {request.to_rank} here, but this daemon is rank "
            f"{links.rank}"))
    if request.workers_per_node != links.per_node:
        return pb.Error(code=pb.CLUSTER_MISMATCH, message=(
            f"rank {theirs} serves {request.workers_per_node} workers per node, rank "
            f"{links.rank} {links.per_node}: give every daemon the same workers_per_node"))
    if request.topology_digest != links.topology_digest:
        return pb.Error(code=pb.CLUSTER_MISMATCH, message=(
            f"rank {theirs} runs another topology than rank {links.rank} (digest "
            f"{request.topology_digest[:12] or 'none'} vs "
            f"{links.topology_digest[:12] or 'none'}): give every daemon the same topology "
            "settings (kind, scheme, options, weights)"))
    if request.machine_topology_digest != links.machine_digest:
        return pb.Error(code=pb.CLUSTER_MISMATCH, message=(
            f"rank {theirs} runs another machine topology than rank {links.rank}: give "
            "every daemon the same machine_topology settings"))
    if theirs not in links.links:
        return pb.Error(code=pb.RANK_MISMATCH,
                        message=f"rank {theirs} is not a peer of rank {links.rank}")
    return None
