"""What ops do about peers that are gone (``faults.on_peer_loss``).

A peer is gone when its daemon is not up (:mod:`decentd.membership.view`) or its worker left. Under
``reweight`` (the default) a neighbor op leaves a gone in-neighbor out and gives its weight to
self, so the row of weights stays as stochastic as it was, and does not send to a gone
out-neighbor; a peer lost while the op runs is left out the same way, as long as nothing of
its tensor was combined yet. Under ``fail`` the op fails with PEER_UNAVAILABLE naming the rank.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable
from typing import TypeVar

from decent_wire.topology import Step, Topology, from_spec
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import PeerLost
from decentd.keys import job_of
from decentd.membership.view import PeerState
from decentd.ops.api import DecentError, OpContext

T = TypeVar("T")


def gone(ctx: OpContext, peer: int) -> str | None:
    """Why ``peer`` (a rank of ``ctx``'s level) cannot take part now, or None."""
    machine = ctx.machine_of(peer)
    members = ctx.services.members
    member = members.members.get(machine)
    if members.state(machine) is PeerState.DOWN:  # reconnecting: the op waits for it
        why = member.reason if member is not None else "down"
        return f"its daemon (rank {machine}) is down: {why}"
    if member is not None and member.afresh and members.state(machine) is not PeerState.UP:
        return (f"its daemon (rank {machine}) ran rounds without this one; it takes part again "
                "once its link is up")
    if ctx.level.node:
        per = ctx.services.per_node
        workers = range(peer * per, (peer + 1) * per)
        if all(w in members.absent for w in workers):
            return "it rejoined and its workers have not registered yet"
        absences, job = ctx.services.mailbox.absences, job_of(ctx.name)
        if all(absences.has_left(job, w) for w in workers):
            return "its workers left"
        return None
    if peer in members.absent:
        return "its node rejoined and its worker has not registered yet"
    if ctx.services.mailbox.gone(peer, ctx.name) is not None:
        return "its worker left"
    if ctx.services.mailbox.absences.horizons.gone(peer, ctx.name, ctx.round) is not None:
        return "it ran this round without this rank (one of them counted the other out)"
    return None


@functools.lru_cache(maxsize=64)
def _schedule_over(spec_json: str, size: int) -> Topology:
    """The dynamic topology of ``spec_json`` over ``size`` ranks."""
    return from_spec(json.loads(spec_json), size)


def live_step(ctx: OpContext) -> Step:
    """The topology's step at this op's round; a dynamic schedule (one-peer exponential,
    random matching) with ranks gone runs over the live ranks only, by their position among
    them, so every survivor with the same view derives the same pairs and nobody is left
    without a partner (its name carries the live ranks: views that differ fail the op with
    MISMATCH, not a wait)."""
    topo = ctx.topology
    if not topo.dynamic or not reweighting(ctx) or topo.spec.get("weights"):
        return ctx.topology_step()
    live = [r for r in range(ctx.size) if r == ctx.rank or gone(ctx, r) is None]
    if len(live) == ctx.size:
        return ctx.topology_step()
    ctx.live_schedule = "@" + ",".join(map(str, live))
    step = _schedule_over(topo.spec_json(), len(live)).step(live.index(ctx.rank), ctx.round)
    return Step(self_weight=step.self_weight,
                src_weights={live[j]: w for j, w in step.src_weights.items()},
                dst_ranks=tuple(live[d] for d in step.dst_ranks))


def reweighting(ctx: OpContext) -> bool:
    """Whether this op goes on without peers that are gone."""
    return ctx.services.on_peer_loss == "reweight"


def without_gone(ctx: OpContext, self_weight: float, recv: dict[int, float],
                 send: dict[int, float]) -> tuple[float, dict[int, float], dict[int, float]]:
    """The plan ``(self weight, {src: w}, {dst: w})`` without the peers that are gone: their
    in-weights go to self (``reweight``), or PEER_UNAVAILABLE names them (``fail``)."""
    lost = {j: why for j in {*recv, *send} if (why := gone(ctx, j)) is not None}
    if not lost:
        return self_weight, recv, send
    if not reweighting(ctx):
        j = min(lost)
        raise DecentError(pb.PEER_UNAVAILABLE, f"{ctx.label}: rank {j} is gone ({lost[j]}; "
                          "faults.on_peer_loss is fail)")
    kept = {j: w for j, w in recv.items() if j not in lost}
    moved = sum(w for j, w in recv.items() if j in lost)
    return self_weight + moved, kept, {d: w for d, w in send.items() if d not in lost}


async def unless_lost(ctx: OpContext, peer: int, aw: Awaitable[T]) -> T | None:
    """``aw`` (an exchange with ``peer``); None when ``peer`` was lost meanwhile and the op
    goes on without it (``reweight``): the peer is told once the link is back (SKIP), in case
    its op of this round still waits for us."""
    try:
        return await aw
    except PeerLost:
        if not reweighting(ctx):
            raise
        ctx.left_out.add(peer)
        return None


def reachable(ctx: OpContext, targets: dict[int, float]) -> dict[int, float]:
    """``targets`` without the peers that are gone (``reweight``); PEER_UNAVAILABLE names
    one under ``fail``."""
    lost = {j: why for j in targets if (why := gone(ctx, j)) is not None}
    if lost and not reweighting(ctx):
        j = min(lost)
        raise DecentError(pb.PEER_UNAVAILABLE, f"{ctx.label}: rank {j} is gone ({lost[j]}; "
                          "faults.on_peer_loss is fail)")
    return {j: w for j, w in targets.items() if j not in lost}


def self_for_gone(ctx: OpContext, self_weight: float, weights: dict[int, float]
                  ) -> tuple[float, dict[int, float]]:
    """``self_weight`` and ``weights`` with the gone peers' weights moved to self
    (``reweight``; PEER_UNAVAILABLE under ``fail``)."""
    kept = reachable(ctx, weights)
    return self_weight + sum(w for j, w in weights.items() if j not in kept), kept


def live_group(ctx: OpContext) -> list[int]:
    """The ranks a collective runs among: the live ones of its level, planned once per op.
    PEER_UNAVAILABLE without a quorum (a strict majority of the daemons), so that the two
    sides of a partition cannot both complete one."""
    if ctx.group is not None:
        return ctx.group
    members = ctx.services.members
    if not members.has_quorum():
        raise DecentError(pb.PEER_UNAVAILABLE, f"{ctx.label}: only daemons "
                          f"{members.live_daemons()} of {members.size} are live; a collective "
                          "needs a majority of them (two sides of a partition must not both "
                          "complete one)")
    ranks = [r for r in range(ctx.size) if r == ctx.rank or gone(ctx, r) is None]
    ctx.group = ranks
    ctx.view_name = f"{','.join(map(str, ranks))}#{members.digest()[:8]}"
    return ranks
