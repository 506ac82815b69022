"""Two ranks that are each other's only neighbor average large tensors by halves, like a 2-rank
ring allreduce (:func:`pair_exchange`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import numpy as np

from decent_wire import dtypes
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops.api import Arrival, DecentError, OpContext, PartSpec, gather_all
from decentd.ops.arriving import Arriving, closing, follow
from decentd.ops.folding import FoldIn, lands_final


def explicit_weights(ctx: OpContext) -> bool:
    """Whether the call gave any weights (else the topology's apply)."""
    args = ctx.args
    return any(args.HasField(f) for f in ("self_weight", "src_weights", "dst_weights"))


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
    landed, folding = Arriving(), Arriving()
    second = asyncio.ensure_future(closing(ctx.recv_parts(j, 2, parts=[p], sized=False,
                                                          into=landing, progress=landed), landed))
    final = lands_final(p, 1.0)  # told as the peer's half lands, across both rounds
    telling = asyncio.ensure_future(follow(landed, final)) if final is not None else None
    try:
        (first,), *_ = await gather_all(
            closing(ctx.recv_parts(j, 1, parts=[p], sized=False, progress=folding), folding),
            send(1, p.raw, *theirs), follow(folding, fold.arrived))
        check(first, fold.count)
        await ctx.inputs_whole()
        fold.fold(first.data, first.weight, fold.count)  # the rest of it
        ctx.release(first)
        (result,), _ = await gather_all(second, send(2, p.out, *mine))
        if telling is not None:
            await telling
    except BaseException:
        landed.close()
        waiting = [t for t in (second, telling) if t is not None]
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        raise
    check(result, theirs[1] - theirs[0])
    if not np.may_share_memory(result.data, landing):  # it came before the op ran
        landing[...] = result.data
