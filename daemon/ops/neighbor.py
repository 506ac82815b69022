"""Neighbor ops: averaging with this step's in-neighbors, compressed gossip, allgather.

Neighbor sums add in ascending rank order, so every run gives the same bits. A neighbor op
involves only the peers its weights name, and each pair checks the other's tensor.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np

from decent_wire import dtypes
from decent_wire.numerics import weighted_sum
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops import gossip_compressors as compression
from decentd.ops.api import (
    Arrival,
    DecentError,
    OpContext,
    OpResult,
    OpSpec,
    PartSpec,
    gather_all,
)
from decentd.ops.arriving import Arriving, OnArrival, closing, follow
from decentd.ops.faults import live_step, unless_lost, without_gone
from decentd.ops.folding import FOLD_MIN, FoldIn, lands_final
from decentd.ops.handoff import HandOff, hand_off
from decentd.ops.pairs import PAIR_MIN_BYTES, pair_exchange, pair_peer


def _weights(field: pb.RankWeights) -> dict[int, float]:
    return {int(k): float(v) for k, v in field.weights.items()}


def neighbor_plan(ctx: OpContext) -> tuple[float, dict[int, float], dict[int, float]]:
    """(self weight, {src: weight} to receive from, {dst: dst weight} to send to).

    No weights: the topology's at this step. ``src_weights`` (with ``self_weight``) reweights the
    topology's in-neighbors (those left out get weight 0). ``dst_weights`` makes the call dynamic:
    send to exactly those ranks, receive from exactly the ``src_weights`` keys. Planned once
    per op (:attr:`OpContext.plan`).
    """
    if ctx.plan is None:
        ctx.plan = _plan(ctx)
    plan: tuple[float, dict[int, float], dict[int, float]] = ctx.plan
    return plan


def _plan(ctx: OpContext) -> tuple[float, dict[int, float], dict[int, float]]:
    args = ctx.args
    assert isinstance(args, pb.NeighborAllreduce | pb.CompressedNeighborAllreduce)
    has_self, has_src = args.HasField("self_weight"), args.HasField("src_weights")
    ctx.on_topology = not args.HasField("dst_weights")
    step = live_step(ctx)
    if has_src and not has_self:
        raise DecentError(pb.INVALID_ARGUMENT,
                          f"{ctx.label}: src_weights given without self_weight; pass both")
    if args.HasField("dst_weights"):
        if not has_src:
            raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: dst_weights given without "
                              "src_weights; a dynamic call names both the ranks it sends to and "
                              "those it receives from")
        recv, send = _weights(args.src_weights), _weights(args.dst_weights)
    elif has_src:
        given = _weights(args.src_weights)
        unknown = sorted(set(given) - set(step.src_weights))
        if unknown:
            raise DecentError(pb.INVALID_ARGUMENT,
                              f"{ctx.label}: src_weights names rank(s) {unknown}, which are not "
                              f"in-neighbors of rank {ctx.rank} at this step "
                              f"({step.in_neighbors}); pass dst_weights for a dynamic call")
        recv = {j: given.get(j, 0.0) for j in step.src_weights}
        send = {d: 1.0 for d in step.dst_ranks}
    else:
        recv = dict(step.src_weights)
        send = {d: 1.0 for d in step.dst_ranks}
    ctx.check_ranks(list(recv), "src_weights")
    ctx.check_ranks(list(send), "dst_weights")
    self_weight = float(args.self_weight) if has_self else step.self_weight
    return without_gone(ctx, self_weight, recv, send)


def check_blank(ctx: OpContext, self_weight: float) -> None:
    """A request whose worker left the input out (``PartSpec.blank``) must be a call that never
    reads it: INVALID_ARGUMENT if it is not one, PEER_UNAVAILABLE once a lost in-neighbor's
    weight fell to this rank's own tensor."""
    if not any(p.input.blank for p in ctx.parts):
        return
    args = ctx.args
    if not (args.HasField("self_weight") and args.self_weight == 0.0
            and args.HasField("dst_weights") and not args.dst_weights.weights):
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: the input was left out, but only "
                          "a call with self_weight 0 and no dst_weights never reads it")
    if self_weight != 0.0:
        raise DecentError(pb.PEER_UNAVAILABLE, f"{ctx.label}: an in-neighbor is gone and its "
                          f"weight ({self_weight}) would go to this rank's own tensor, which "
                          "this receive-only call (self_weight 0, no dst_weights) did not send")


async def neighbor_allreduce(ctx: OpContext) -> OpResult:
    """``out = self_w * x + sum_j src_w[j] * d_j * x_j`` over this step's in-neighbors.

    The result is written over the input once it is sent (the client mostly gives both one
    slot, and in-place ops on shared tensors rely on it); a lone in-neighbor's tensor is folded
    in while it arrives (FoldIn), or handed to a worker that combines it itself (handoff), the
    rest once everything is there. Two ranks that are each other's
    only neighbor with equal weights average large tensors by halves (pair_exchange).
    """
    self_weight, recv, send = neighbor_plan(ctx)
    check_blank(ctx, self_weight)
    large = any(p.nbytes >= PAIR_MIN_BYTES for p in ctx.parts)
    pair = pair_peer(ctx, self_weight, recv, send) if large else None
    halves = [p for p in ctx.parts if p.nbytes >= PAIR_MIN_BYTES] if pair is not None else []
    whole = [p for p in ctx.parts if all(p is not h for h in halves)]
    jobs: list[Awaitable[Any]] = [pair_exchange(ctx, p, pair, self_weight) for p in halves
                                  if pair is not None]
    if whole:
        jobs.append(exchange_whole(ctx, whole, self_weight, recv, send))
    got = await gather_all(*jobs)
    srcs, combine = got[-1] if whole else (sorted(recv), None)
    return OpResult(sum(p.nbytes for p in ctx.parts), ctx.shape, srcs, combine=combine)


@dataclass(slots=True)
class Taking:
    """How an op takes a lone in-neighbor's tensor, when it does anything while it arrives:
    received straight into the output (``direct``), handed to a worker that combines its
    result itself (``handoff``), or folded in (``fold``); ``arriving`` is followed in the op's
    task by ``on_arrival``."""

    direct: bool = False
    handoff: HandOff | None = None
    fold: FoldIn | None = None
    arriving: Arriving | None = None
    on_arrival: OnArrival | None = None


def taking(ctx: OpContext, parts: list[PartSpec], self_weight: float, recv: dict[int, float],
           send: dict[int, float]) -> Taking:
    """How this op takes what its in-neighbors send (the sinks decide what is possible)."""
    srcs = sorted(recv)
    # nothing of our own in the result and nothing to send: the neighbor's tensor is received
    # straight into the output and only scaled there
    if self_weight == 0.0 and not send and len(srcs) == 1:
        final = lands_final(parts[0], recv[srcs[0]])
        return Taking(True, arriving=Arriving() if final else None, on_arrival=final)
    handoff = hand_off(ctx, parts, srcs, self_weight, recv)
    if handoff is not None:
        return Taking(handoff=handoff, arriving=Arriving(), on_arrival=handoff.arrived)
    if len(srcs) == 1 and len(parts) == 1 and parts[0].x.size >= FOLD_MIN:
        fold = FoldIn(ctx, parts[0], self_weight, recv[srcs[0]], list(send))
        return Taking(fold=fold, arriving=Arriving(), on_arrival=fold.arrived)
    return Taking()


async def trade(ctx: OpContext, parts: list[PartSpec], recv: dict[int, float],
                send: dict[int, float], how: Taking) -> list[list[Arrival] | None]:
    """Send ``parts`` to every out-neighbor and receive every in-neighbor's (None for one
    lost under ``reweight``), following a lone tensor's arrival as ``how`` says."""
    fold = how.fold

    async def send_to(d: int, w: float) -> None:
        await unless_lost(ctx, d, ctx.send(d, 0, weight=w, ack=d not in recv,
                                           track=fold.sends[d] if fold is not None else None,
                                           parts=parts))
        if fold is not None:
            fold.finished.add(d)

    # a peer we also receive from checks our tensor against its own and we check its: a
    # disagreement fails both sides without acknowledgements; one-way edges need them.
    # The mailbox waits for every in-neighbor's tensor before ours go out.
    expected = [ctx.expect_parts(j, 0, ack=j not in send, parts=parts,
                                 direct=how.direct or how.handoff is not None,
                                 progress=how.arriving) for j in sorted(recv)]

    async def exchange() -> list[list[Arrival] | None]:
        await gather_all(*(send_to(d, w) for d, w in send.items()))
        return [await unless_lost(ctx, e.src, ctx.arrivals(e)) for e in expected]

    try:
        if how.arriving is None or how.on_arrival is None:
            return await exchange()
        got, _ = await gather_all(closing(exchange(), how.arriving),
                                  follow(how.arriving, how.on_arrival))
        return got
    except BaseException:  # what the op no longer awaits is not left failing unseen
        for e in expected:
            e.drop()
        raise


async def exchange_whole(ctx: OpContext, parts: list[PartSpec], self_weight: float,
                         recv: dict[int, float], send: dict[int, float]
                         ) -> tuple[list[int], pb.Combine | None]:
    """neighbor_allreduce of ``parts``: whole tensors to and from every neighbor (one message
    per peer); the in-neighbors that contributed (under ``reweight``, one lost while the op
    ran is left out, its weight given to self), and the weights the worker combines by when
    it does (:mod:`decentd.ops.handoff`)."""
    srcs = sorted(recv)
    if self_weight == 0.0 and not send and len(srcs) == 1:
        await ctx.inputs_whole()  # it lands where the worker may still be copying the input
    how = taking(ctx, parts, self_weight, recv, send)
    got = await trade(ctx, parts, recv, send, how)
    arrived = [(j, a) for j, a in zip(srcs, got, strict=True) if a is not None]
    fold = how.fold
    if len(arrived) < len(srcs):
        if (fold is not None and fold.done) or how.direct:  # part of it is in the result
            raise DecentError(pb.PEER_UNAVAILABLE, f"{ctx.label}: rank {srcs[0]} was lost while "
                              "its tensor was being combined; the result cannot be reweighted")
        self_weight += sum(recv[j] for j in srcs if all(j != k for k, _ in arrived))
        check_blank(ctx, self_weight)
        fold = None
    await ctx.inputs_whole()
    if how.handoff is not None:
        return [j for j, _ in arrived], how.handoff.finish(
            arrived[0][1][0] if arrived else None, self_weight)
    combine_whole(ctx, parts, arrived, self_weight, recv, how.direct, fold)
    return [j for j, _ in arrived], None


def combine_whole(ctx: OpContext, parts: list[PartSpec], arrived: list[tuple[int, list[Arrival]]],
                  self_weight: float, recv: dict[int, float], direct: bool,
                  fold: FoldIn | None) -> None:
    """Each part's result from the in-neighbors' tensors that ``arrived`` (what of it
    ``direct`` landing or ``fold`` did already is not done again)."""
    for i, p in enumerate(parts):
        storage = dtypes.STORAGE[p.dtype]
        out = ctx.output(p, p.nbytes)
        first = arrived[0][1][i] if arrived else None
        if direct and first is not None and first.message is not None \
                and first.message.buf is None and np.may_share_memory(first.data, out):
            scale = recv[arrived[0][0]] * first.weight  # it landed in the output
            if scale != 1.0:
                weighted_sum(out, out, scale, [], p.dtype)
        elif fold is not None and fold.done and not fold.off and first is not None:
            fold.fold(first.data, first.weight, p.x.size)  # the head is combined already
        else:
            terms = [(a[i].data.view(storage), recv[j] * a[i].weight) for j, a in arrived]
            weighted_sum(out, out if p.sink.in_place else p.x, self_weight, terms, p.dtype)


async def compressed_neighbor_allreduce(ctx: OpContext) -> OpResult:
    """neighbor_allreduce of ``Q(x)``: each rank sends its compressed tensor (compression.py).

    The result has two rows: ``self_w * Q(x) + sum_j src_w[j] * d_j * Q(x_j)`` (ascending rank
    order) and ``Q(x)`` itself, decoded from the payload this rank sent, so the caller knows
    exactly what its neighbors received (CHOCO-SGD keeps public copies with it).
    """
    p = ctx.parts[0]
    spec = ctx.args.compression
    try:
        compression.validate(int(spec.kind), float(spec.ratio), p.dtype, p.x.size)
    except compression.CompressionError as exc:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: {exc}") from None
    self_weight, recv, send = neighbor_plan(ctx)
    mine = compression.describe(int(spec.kind), float(spec.ratio))
    data = compression.encode(int(spec.kind), float(spec.ratio), p.x, p.dtype)
    rows = ctx.output(p, 2 * p.nbytes).reshape(2, p.x.size)
    mixed, own = rows[0], rows[1]
    compression.decode(data, own, p.dtype)
    srcs = sorted(recv)
    got = await gather_all(
        *(ctx.recv_parts(j, 0, ack=j not in send, sized=False) for j in srcs),
        *(ctx.send(d, 0, weight=w, ack=d not in recv, data=memoryview(data))
          for d, w in send.items()))
    storage = dtypes.STORAGE[p.dtype]
    terms = []
    for j, (arrival,) in zip(srcs, got[:len(srcs)], strict=True):
        theirs = np.empty(p.x.size, storage)
        try:
            kind, _, k, _ = compression.header(arrival.data)
            if kind != spec.kind or (kind == pb.TOPK and
                                     k != compression.topk_count(spec.ratio, p.x.size)):
                ratio = k / p.x.size if kind == pb.TOPK and p.x.size else 0.0
                raise compression.CompressionError(
                    f"rank {j} compressed it with {compression.describe(kind, ratio)}, rank "
                    f"{ctx.rank} with {mine}")
            compression.decode(arrival.data, theirs, p.dtype)
        except compression.CompressionError as exc:
            raise DecentError(pb.MISMATCH, f"tensor '{p.display}' round {p.round}: {exc}") from None
        terms.append((theirs, recv[j] * arrival.weight))
    weighted_sum(mixed, own, self_weight, terms, p.dtype)
    return OpResult(2 * p.nbytes, (2, *ctx.shape))


def allgather_plan(ctx: OpContext) -> tuple[list[int], list[int]]:
    """(ranks to receive from, ranks to send to) of a neighbor allgather."""
    args = ctx.args
    assert isinstance(args, pb.NeighborAllgather)
    ctx.on_topology = not args.HasField("src_ranks")
    step = ctx.topology_step()
    if args.HasField("src_ranks") != args.HasField("dst_ranks"):
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: a dynamic allgather names both "
                                               "src_ranks and dst_ranks")
    given = list(dict.fromkeys(args.src_ranks.ranks))  # concatenated in the order given
    srcs = (given if args.concat else sorted(given)) if args.HasField("src_ranks") \
        else step.in_neighbors
    dsts = sorted(args.dst_ranks.ranks) if args.HasField("dst_ranks") else step.out_neighbors
    ctx.check_ranks(srcs, "src_ranks")
    ctx.check_ranks(dsts, "dst_ranks")
    return srcs, dsts


async def neighbor_allgather(ctx: OpContext) -> OpResult:
    """Stack the in-neighbors' tensors (ascending rank) on a new leading dimension, or
    concatenate them on the first (``concat``: in the order of ``src_ranks``, each with its
    announced number of rows)."""
    srcs, dsts = allgather_plan(ctx)
    if ctx.args.concat:
        return await _concat_neighbors(ctx, srcs, dsts)
    got = await gather_all(*(ctx.recv(j, 0, ack=True) for j in srcs),
                           *(ctx.send(d, 0, ack=True) for d in dsts))
    p = ctx.parts[0]
    out = ctx.output(p, p.nbytes * len(srcs)).reshape(len(srcs), p.x.size)
    for k, (arr, _) in enumerate(got[: len(srcs)]):
        out[k] = arr
    return OpResult(int(out.nbytes), (len(srcs), *ctx.shape), srcs)


async def _concat_neighbors(ctx: OpContext, srcs: list[int], dsts: list[int]) -> OpResult:
    p = ctx.parts[0]
    sizes = [int(s) for s in ctx.args.sizes]
    if not p.shape or len(sizes) != len(srcs):
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: concatenating needs a tensor of "
                          f"at least one dimension and a size per source ({len(sizes)} sizes "
                          f"for {len(srcs)} sources)")
    got = await gather_all(*(ctx.recv_rows(j, 0, rows, ack=True)
                             for j, rows in zip(srcs, sizes, strict=True)),
                           *(ctx.send(d, 0, ack=True) for d in dsts))
    total = sum(int(a.data.nbytes) for a in got[:len(srcs)])
    out = np.frombuffer(ctx.output(p, total).data, np.uint8) if total else np.empty(0, np.uint8)
    at = 0
    for arrival in got[:len(srcs)]:
        out[at:at + arrival.data.nbytes] = arrival.data
        at += arrival.data.nbytes
    return OpResult(total, (sum(sizes), *p.shape[1:]), srcs)


def _neighbor_peers(ctx: OpContext) -> set[int]:
    _, recv, send = neighbor_plan(ctx)
    return set(recv) | set(send)


def _neighbor_tags(ctx: OpContext) -> set[int]:
    if all(p.nbytes < PAIR_MIN_BYTES for p in ctx.parts) or \
            pair_peer(ctx, *neighbor_plan(ctx)) is None:
        return {0}
    return {1, 2} | ({0} if any(p.nbytes < PAIR_MIN_BYTES for p in ctx.parts) else set())


def _concat_rows(ctx: OpContext) -> dict[int, int] | None:
    if not ctx.args.concat:
        return None
    srcs, _ = allgather_plan(ctx)
    return dict(zip(srcs, (int(s) for s in ctx.args.sizes), strict=False))


def _allgather_peers(ctx: OpContext) -> set[int]:
    srcs, dsts = allgather_plan(ctx)
    return set(srcs) | set(dsts)


NEIGHBOR_OPS: dict[int, OpSpec] = {
    pb.NEIGHBOR_ALLREDUCE: OpSpec(
        neighbor_allreduce, _neighbor_peers, _neighbor_tags,
        tag_hint="pairwise halves vs. whole tensors: do both ranks have the same topology?"),
    pb.NEIGHBOR_ALLGATHER: OpSpec(neighbor_allgather, _allgather_peers, lambda _ctx: {0},
                                  rows=_concat_rows),
    pb.COMPRESSED_NEIGHBOR_ALLREDUCE: OpSpec(compressed_neighbor_allreduce, _neighbor_peers,
                                             lambda _ctx: {0}),
}
