"""Every daemon's status, asked by one of them (``decentctl status --cluster``).

The local daemon asks each peer over the peer channel it already holds. In secret mode each
request answers a fresh Challenge with an HMAC of both nonces (as a handshake does); in mtls the
caller's certificate names its rank; a peer that cannot be reached or refuses is listed with its
error, so the table shows who is missing.
"""

from __future__ import annotations

import asyncio

import grpc

from decent_wire.v1 import decent_pb2 as pb
from decent_wire.v1 import decent_pb2_grpc as pb_grpc
from decentd.net.links import Links
from decentd.net.peer import PeerLink
from decentd.security.auth import new_nonce, shown

#: seconds to wait for one peer's status
PEER_STATUS_TIMEOUT = 5.0


async def cluster_status(links: Links, own: pb.StatusReply) -> list[pb.StatusReply]:
    """Every daemon's status in rank order: ``own`` for this one, the peers' as they answer."""
    peers = [link for link in links.links.values() if link.rank != links.rank]
    answers = await asyncio.gather(*(_ask(links, link) for link in peers))
    everyone = {int(own.rank): own, **{link.rank: a for link, a in zip(peers, answers,
                                                                        strict=True)}}
    return [everyone[r] for r in sorted(everyone)]


async def _ask(links: Links, link: PeerLink) -> pb.StatusReply:
    """One peer's status, or its rank, address and why not."""
    if link.channel is None:
        return _failed(link, pb.PEER_UNAVAILABLE, "no channel to it")
    stub = pb_grpc.PeerStub(link.channel)
    request = pb.PeerStatusRequest(cluster_id=links.cluster_id, from_rank=links.rank,
                                   to_rank=link.rank)
    try:
        if links.auth.mode == "secret":
            why = await _prove(links, link, stub, request)
            if why is not None:
                return _failed(link, pb.UNAUTHENTICATED, why)
        reply: pb.StatusReply = await stub.Status(request, timeout=PEER_STATUS_TIMEOUT)
    except grpc.RpcError as exc:
        details = shown(exc.details() or "")
        return _failed(link, pb.PEER_UNAVAILABLE, f"{exc.code().name}: {details}")
    if reply.error.code != pb.OK:
        return _failed(link, reply.error.code, shown(reply.error.message, 300))
    return reply


async def _prove(links: Links, link: PeerLink, stub: pb_grpc.PeerStub,
                 request: pb.PeerStatusRequest) -> str | None:
    """Secret mode: answer the peer's challenge in ``request``; why not, when it fails."""
    nonce = new_nonce()
    reply: pb.ChallengeReply = await stub.Challenge(pb.ChallengeRequest(
        cluster_id=links.cluster_id, from_rank=links.rank, to_rank=link.rank,
        client_nonce=nonce), timeout=PEER_STATUS_TIMEOUT)
    if reply.error.code != pb.OK:
        return f"it refused our challenge: {shown(reply.error.message, 300)}"
    if not links.auth.server_proof_ok(links.rank, link.rank, nonce, reply.server_nonce,
                                      reply.server_proof):
        return "it does not hold this cluster's secret"
    request.server_nonce = reply.server_nonce
    request.proof = links.auth.status_proof(links.rank, link.rank, nonce, reply.server_nonce)
    return None


def _failed(link: PeerLink, code: int, message: str) -> pb.StatusReply:
    return pb.StatusReply(rank=link.rank, address=link.address,
                          error=pb.Error(code=code, message=message))
