"""How a neighbor op plans its exchange, decided in-process from the topology, the call's weights
and where the daemons are (no sockets: the links are built, never connected)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from decent_wire.topology import build_topology
from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import agreement, at_worker
from decentd.mailbox.slots import Mailbox
from decentd.membership.view import Membership, PeerState
from decentd.net.buffers import BufferPool
from decentd.net.links import Links
from decentd.net.peer import is_loopback
from decentd.ops.agreement import AGREE_TAG, description_parts
from decentd.ops.api import Level, OpContext, PartSpec, Services
from decentd.ops.collectives import COLLECTIVE_OPS
from decentd.ops.neighbor import NEIGHBOR_OPS, PAIR_MIN_BYTES, neighbor_plan, pair_peer
from decentd.windows.groups import GroupSums
from decentd.windows.locks import WindowLocks
from decentd.windows.store import WindowStore


def context(kind: str, n: int, rank: int, round_: int = 0, host: str = "127.0.0.1",
            args: pb.NeighborAllreduce | None = None, nbytes: int = 16,
            allreduce: pb.Agreement | None = None) -> OpContext:
    """A neighbor_allreduce of rank ``rank`` as its daemon would run it (``allreduce``: a
    node-level allreduce of a tensor with this description instead)."""
    topo = build_topology(kind, n)
    links = Links(rank, [f"{host}:{7000 + r}" for r in range(n)], "c", 1 << 20, topo.digest())
    mailbox = Mailbox(links.outbox)
    windows = WindowStore(n, links, 1.0, 1 << 20)
    members = Membership(rank, n, 1)
    for r in members.members:
        members.set_state(r, PeerState.UP)
    services = Services(machine=rank, machines=n, per_node=1, topology=topo,
                        machine_topology=topo, links=links, mailbox=mailbox, pool=BufferPool(0),
                        windows=windows, groups=GroupSums(windows, links, mailbox),
                        locks=WindowLocks(), ring_threshold=1 << 18, members=members)
    x = np.zeros(nbytes // 4, np.float32)
    raw = x.view(np.uint8).data
    part = PartSpec.over(at_worker("t", rank), "t", round_, pb.FLOAT32, x.shape, x, raw, raw)
    if allreduce is not None:
        return OpContext(services, pb.ALLREDUCE, pb.Allreduce(), [part.copy(agreement=allreduce)],
                         COLLECTIVE_OPS[pb.ALLREDUCE], Level(rank, n, topo, node=True))
    return OpContext(services, pb.NEIGHBOR_ALLREDUCE, args or pb.NeighborAllreduce(), [part],
                     NEIGHBOR_OPS[pb.NEIGHBOR_ALLREDUCE], Level(rank, n, topo))


def pair_of(ctx: OpContext) -> int | None:
    return pair_peer(ctx, *neighbor_plan(ctx))


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:5000", True), ("127.3.2.1:1", True), ("[::1]:7000", True), ("localhost:9", True),
    ("10.77.0.2:5000", False), ("[fe80::1]:5", False), ("decent-0.decent:7000", False)])
def test_loopback_addresses_are_recognized(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_two_ranks_on_one_host_average_by_halves() -> None:
    assert pair_of(context("ring", 2, 0)) == 1 and pair_of(context("ring", 2, 1)) == 0


def test_two_ranks_across_a_network_exchange_whole_tensors() -> None:
    # across a link the wire is the limit, and halves would add a wait between two rounds
    assert pair_of(context("ring", 2, 0, host="10.0.0.1")) is None


def test_a_pair_needs_each_other_as_the_only_neighbor_with_the_topology_weights() -> None:
    assert pair_of(context("ring", 3, 0)) is None  # two neighbors
    given = pb.NeighborAllreduce(self_weight=0.5, src_weights=pb.RankWeights(weights={1: 0.5}))
    assert pair_of(context("ring", 2, 0, args=given)) is None  # explicit weights
    # one-peer exponential on 4 ranks: round 0 is one-way (r -> r+1), round 1 pairs r, r+2
    assert pair_of(context("one-peer-exponential", 4, 1, round_=0)) is None
    assert pair_of(context("one-peer-exponential", 4, 1, round_=1)) == 3


def test_the_tags_a_pair_step_takes_follow_the_tensor_size() -> None:
    tags = NEIGHBOR_OPS[pb.NEIGHBOR_ALLREDUCE].tags
    assert tags(context("ring", 2, 0, nbytes=16)) == {0}  # small: whole, even on a pair
    assert tags(context("ring", 2, 0, nbytes=PAIR_MIN_BYTES)) == {1, 2}
    assert tags(context("ring", 2, 0, host="10.0.0.1")) == {0}


def test_an_agreement_takes_a_peers_verdict_as_it_is() -> None:
    """A peer's abort of an agreement may come before the description its verdict was drawn
    from: a verdict is the same on every rank, so it is taken word for word (every rank then
    fails alike), by the agreement and by the daemons' collective it decides; any other abort
    names the peer that sent it."""
    verdict = "broadcast 't' round 0: rank 1 cannot run it: root 9 is not a rank (0..3)"
    agreeing = context("ring", 4, 0)
    agreeing.op = pb.AGREEMENT
    agreeing.aborted(2, pb.Error(code=pb.INVALID_ARGUMENT, message=verdict))
    assert agreeing.failure is not None and agreeing.failure.message == verdict
    lost = context("ring", 4, 0)
    lost.op = pb.AGREEMENT
    lost.aborted(2, pb.Error(code=pb.PEER_UNAVAILABLE, message="rank 3 is down"))
    assert lost.failure is not None and lost.failure.message.startswith("rank 2 failed ")
    other = context("ring", 4, 0)
    other.aborted(2, pb.Error(code=pb.INVALID_ARGUMENT, message=verdict))
    assert other.failure is not None and other.failure.message.startswith("rank 2 failed ")
    # the daemons' collective it decides relays it as it is too (a peer's agreement may take
    # it from there): every rank that fails by it fails alike
    said = pb.Agreement(op=pb.ALLREDUCE, dtype=pb.FLOAT32, shape=[4], text="allreduce")
    relaying = context("ring", 4, 0, allreduce=said)
    relaying.aborted(2, pb.Error(code=pb.MISMATCH, message=verdict))
    assert relaying.failure is not None and relaying.failure.message == verdict
    late = context("ring", 4, 0, allreduce=said)
    late.aborted(2, pb.Error(code=pb.TIMEOUT, message="timed out"))
    assert late.failure is not None and late.failure.message.startswith("rank 2 failed ")


def test_a_small_allreduce_among_a_few_daemons_agrees_in_its_own_exchange() -> None:
    """A direct allreduce among 2 or 3 live daemons (all to all, as their agreement would be)
    carries each tensor's description in its parts; alone, among more, large enough for the
    ring, or without descriptions (several workers per node), it agrees beside."""
    said = pb.Agreement(op=pb.ALLREDUCE, dtype=pb.FLOAT32, shape=[4], text="allreduce")
    agrees = [context("ring", n, 0, allreduce=said).agrees_in_exchange for n in range(1, 6)]
    assert agrees == [False, True, True, False, False]
    assert not context("ring", 2, 0, nbytes=1 << 18, allreduce=said).agrees_in_exchange
    assert not context("ring", 2, 0, allreduce=None).agrees_in_exchange
    # they go beside the data, as an agreement of its own sends them: payload-free
    (told,) = description_parts(context("ring", 3, 1, allreduce=said))
    assert (told.name, told.tag, told.op, told.nbytes) == (agreement(at_worker("t", 1)),
                                                           AGREE_TAG, pb.AGREEMENT, 0)
    assert pb.Agreement.FromString(told.agreement) == said


def test_a_refusals_descriptions_wait_for_a_link_being_reopened() -> None:
    """A daemon that cannot run a small allreduce sends its descriptions alone, without
    waiting; while the link to a peer is being reopened they are held, as an abort is (else
    that peer would wait for them until its timeout), and dropped once the peer is given up."""
    said = pb.Agreement(op=pb.ALLREDUCE, dtype=pb.FLOAT32, shape=[4], text="allreduce")

    async def body() -> None:
        ctx = context("ring", 3, 0, allreduce=said)
        links, parts = ctx.services.links, description_parts(ctx)
        links.reopening(1)
        links.outbox.send_nowait(1, parts)
        links.outbox.send_abort(1, ctx.keys, pb.Error(code=pb.TIMEOUT, message="late"))
        assert [h.kind for h in links.links[1].held] == [pb.DATA, pb.ABORT]
        (held,) = links.links[1].held[0].parts
        assert pb.Agreement.FromString(held.agreement) == said
        links.given_up(1)
        assert links.links[1].held == []

    asyncio.run(body())
