"""Neighbor ops: averaging with this step's in-neighbors, compressed gossip, allgather.

Neighbor sums add in ascending rank order, so every run gives the same bits. A neighbor op
involves only the peers its weights name, and each pair checks the other's tensor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
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
    Outgoing,
    PartSpec,
    Progress,
    gather_all,
)
from decentd.ops.faults import live_step, unless_lost, without_gone
from decentd.ops.handoff import HandOff, hands_off

#: a tensor still arriving is folded in once at least this many more elements are usable (the
#: receiver reports progress in large steps, halving toward the end of a payload)
FOLD_MIN = 1 << 16


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
    if not any(p.blank for p in ctx.parts):
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


def explicit_weights(ctx: OpContext) -> bool:
    """Whether the call gave any weights (else the topology's apply)."""
    args = ctx.args
    return any(args.HasField(f) for f in ("self_weight", "src_weights", "dst_weights"))


class FoldIn:
    """Folds a lone in-neighbor's tensor into the result while it is still arriving.

    The result may overwrite the input (one arena slot), so element k is combined only once the
    input's element k has gone out to every out-neighbor; on a link where sending and receiving
    run at the same pace that keeps up with the arrival, and only the tail is left at the end.
    The arriving tensor may be the slice of ``count`` elements from ``base`` of ours.
    """

    def __init__(self, ctx: OpContext, p: PartSpec, self_weight: float, src_weight: float,
                 dsts: list[int], base: int = 0, count: int | None = None) -> None:
        self.ctx, self.p = ctx, p
        self.self_weight, self.src_weight = self_weight, src_weight
        self.itemsize = dtypes.itemsize(p.dtype)
        self.base = base
        self.count = p.x.size if count is None else count
        self.done = 0  # elements combined (of the arriving tensor)
        self.sends: dict[int, list[tuple[Outgoing, int]]] = {d: [] for d in dsts}
        self.finished: set[int] = set()  # destinations whose send returned
        self.off = False

    def sent(self) -> int:
        """Input bytes known to be in the kernel for every destination (and copied in by
        the worker)."""
        fill = self.p.fill
        low = self.p.nbytes if fill is None else fill.filled
        for d, items in self.sends.items():
            if d not in self.finished:
                low = min(low, max((i.sent - h for i, h in items), default=0))
        return low

    def __call__(self, buf: np.ndarray, filled: int, weight: float, part: pb.Part) -> None:
        """``buf[:filled]`` of the neighbor's tensor has arrived."""
        p = self.p
        if self.off or not (part.op == self.ctx.op and part.meta.dtype == p.dtype
                            and tuple(part.meta.shape) == p.shape
                            and part.nbytes == self.count * self.itemsize):
            self.off = True  # anything odd: leave it to the checks after the arrival
            return
        upto = min(filled, self.sent() - self.base * self.itemsize) // self.itemsize
        if upto - self.done < FOLD_MIN:
            return
        try:
            self.fold(buf, weight, upto)
        except Exception:  # e.g. an output region too small: the op reports it at the end
            self.off = True
            self.done = 0

    def fold(self, buf: np.ndarray, weight: float, upto: int) -> None:
        """Combine elements ``[done, upto)`` of the arriving tensor."""
        p = self.p
        y = buf[:upto * self.itemsize].view(dtypes.STORAGE[p.dtype])
        out = self.ctx.output(p, p.nbytes)
        lo, b = self.done, self.base
        weighted_sum(out[b + lo:b + upto], p.x[b + lo:b + upto], self.self_weight,
                     [(y[lo:upto], self.src_weight * weight)], p.dtype)
        self.done = upto
        if p.drain is not None and b == 0:
            p.drain.final(upto * self.itemsize)


def lands_final(p: PartSpec, src_weight: float) -> Progress | None:
    """For a worker that copies ``p``'s result out as it becomes final (``PartSpec.drain``):
    the progress of a tensor received straight into the output, final as it lands unless it
    is to be scaled. None for any other request."""
    drain = p.drain
    if drain is None or not len(p.out):
        return None
    start = np.frombuffer(p.out, np.uint8).ctypes.data

    def landed(buf: np.ndarray, filled: int, weight: float, _part: pb.Part) -> None:
        if src_weight * weight == 1.0 and buf.ctypes.data == start:
            drain.final(filled)
    return landed


#: the smallest tensor a pair of ranks on one host averages by halves: below it, one message each
#: way is faster than two rounds (measured on loopback: halves lose at 1 and 4 MiB, win from
#: 16 MiB). Both ranks decide per tensor, by its size alone, so the decision agrees however each
#: side fused its requests.
PAIR_MIN_BYTES = 8 << 20


def pair_peer(ctx: OpContext, self_weight: float, recv: dict[int, float],
              send: dict[int, float]) -> int | None:
    """The peer of a symmetric pair step, whose large tensors both ranks average by halves.

    That is: topology weights (so the peer derives the same answer from the same schedule),
    this rank and the peer each other's only neighbor, all four weights equal
    (``w * x_a + w * x_b`` is the same sum on both sides), and both on one host. Halves save
    half the arithmetic, which pays where memory is the limit (loopback); across a network the
    link is, and halves move the same bytes with a wait between the rounds (measured on the
    1 Gbit/s netns benchmark: the pair step took 265-275 ms by halves, 230-246 ms whole).
    """
    if len(recv) != 1 or set(send) != set(recv) or explicit_weights(ctx) or ctx.live_schedule:
        return None
    (j,) = recv
    if not ctx.same_host(j):
        return None
    theirs = ctx.topology_step(j)
    if tuple(theirs.src_weights) != (ctx.rank,) or theirs.dst_ranks != (ctx.rank,):
        return None
    weights = {self_weight, recv[j], theirs.self_weight, theirs.src_weights[ctx.rank]}
    return j if len(weights) == 1 else None


async def pair_exchange(ctx: OpContext, p: PartSpec, j: int, weight: float) -> None:
    """Average tensor ``p`` with ``j`` by halves, like a 2-rank ring allreduce.

    Each rank combines one half (folded in while the peer's copy of it arrives) and sends the
    result to the other, which receives it straight into its output. The same bytes travel as
    with whole tensors, and each rank does half the arithmetic. The lower rank combines the
    first half.
    """
    size, isz = p.x.size, dtypes.itemsize(p.dtype)
    mid = size // 2
    mine, theirs = ((0, mid), (mid, size)) if ctx.rank < j else ((mid, size), (0, mid))
    landing = np.frombuffer(p.out, np.uint8, p.nbytes)[theirs[0] * isz:theirs[1] * isz]
    fold = FoldIn(ctx, p, weight, weight, [], base=mine[0], count=mine[1] - mine[0])

    def send(tag: int, data: memoryview, lo: int, hi: int) -> Awaitable[None]:
        return ctx.send_bytes(j, tag, data[lo * isz:hi * isz], p,
                              lo * isz if data is p.raw else None)

    def check(arrival: Arrival, count: int) -> None:
        if arrival.data.nbytes != count * isz:
            raise DecentError(pb.MISMATCH, f"tensor '{p.display}' round {p.round}: rank {j} sent "
                          f"half a tensor of {arrival.data.nbytes} bytes, rank {ctx.rank} "
                          f"expected {count * isz}")

    # the peer's half of the result may come as soon as it has ours: expected from the start
    second = asyncio.ensure_future(ctx.recv_parts(j, 2, parts=[p], sized=False, into=landing,
                                                  progress=lands_final(p, 1.0)))
    try:
        (first,), _ = await gather_all(
            ctx.recv_parts(j, 1, parts=[p], sized=False, progress=fold),
            send(1, p.raw, *theirs))
        check(first, fold.count)
        await ctx.inputs_whole()
        fold.fold(first.data, first.weight, fold.count)  # the rest of it
        ctx.release(first)
        (result,), _ = await gather_all(second, send(2, p.out, *mine))
    except BaseException:
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        raise
    check(result, theirs[1] - theirs[0])
    if not np.may_share_memory(result.data, landing):  # it came before the op ran
        landing[...] = result.data


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


async def exchange_whole(ctx: OpContext, parts: list[PartSpec], self_weight: float,
                         recv: dict[int, float], send: dict[int, float]
                         ) -> tuple[list[int], pb.Combine | None]:
    """neighbor_allreduce of ``parts``: whole tensors to and from every neighbor (one message
    per peer); the in-neighbors that contributed (under ``reweight``, one lost while the op
    ran is left out, its weight given to self), and the weights the worker combines by when
    it does (:mod:`decentd.ops.handoff`)."""
    srcs = sorted(recv)
    fold = None
    # nothing of our own in the result and nothing to send: the neighbor's tensor is received
    # straight into the output and only scaled there
    direct = self_weight == 0.0 and not send and len(srcs) == 1
    if direct:  # it lands where the worker may still be copying the input
        await ctx.inputs_whole()
    drain = None if direct else hands_off(parts[0], parts, srcs)
    handoff = None if drain is None else HandOff(ctx, parts[0], drain, srcs[0], self_weight,
                                                 recv[srcs[0]])
    if len(srcs) == 1 and len(parts) == 1 and not direct and handoff is None \
            and parts[0].x.size >= FOLD_MIN:
        fold = FoldIn(ctx, parts[0], self_weight, recv[srcs[0]], list(send))

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
                                 direct=direct or handoff is not None,
                                 progress=lands_final(parts[0], recv[j]) if direct
                                 else handoff or fold)
                for j in srcs]
    try:
        await gather_all(*(send_to(d, w) for d, w in send.items()))
        got = [await unless_lost(ctx, e.src, ctx.arrivals(e)) for e in expected]
    except BaseException:  # what the op no longer awaits is not left failing unseen
        for e in expected:
            e.drop()
        raise
    arrived = [(j, a) for j, a in zip(srcs, got, strict=True) if a is not None]
    if len(arrived) < len(srcs):
        if (fold is not None and fold.done) or direct:  # part of it is in the result already
            raise DecentError(pb.PEER_UNAVAILABLE, f"{ctx.label}: rank {srcs[0]} was lost while "
                              "its tensor was being combined; the result cannot be reweighted")
        self_weight += sum(recv[j] for j in srcs if all(j != k for k, _ in arrived))
        check_blank(ctx, self_weight)
        fold = None
    await ctx.inputs_whole()
    if handoff is not None:
        return [j for j, _ in arrived], handoff.finish(arrived[0][1][0] if arrived else None,
                                                       self_weight)
    combine_whole(ctx, parts, arrived, self_weight, recv, direct, fold)
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
            weighted_sum(out, out if p.in_place else p.x, self_weight, terms, p.dtype)


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
