"""The communication ops the daemon runs for its workers.

Each op reads the worker's input tensor ``x`` (a storage-dtype view of the arena), talks to exactly
the peers it involves through an :class:`~decentd.engine.OpContext`, and writes its result into the
worker's output region. Results are deterministic: neighbor sums and the direct allreduce add in
ascending rank order, the ring adds each chunk along the ring; every rank gets identical values.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import Any

import numpy as np

from decentd import compression, dtypes
from decentd.bulk import Outgoing
from decentd.engine import OpContext, OpResult, OpSpec, PartSpec
from decentd.errors import OpError
from decentd.topology import hops
from decentd.transport import Arrival
from decentd.wire import pb


async def gather_all(*coros: Awaitable[Any]) -> list[Any]:
    """Like asyncio.gather, but when one fails the others are cancelled and waited for.

    A send still reading the worker's arena slot must end before the op reports its failure
    (after which the worker may reuse the slot).
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _payload(x: np.ndarray) -> memoryview:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8).data


def _out(ctx: OpContext, p: PartSpec, nbytes: int) -> np.ndarray:
    """Part ``p``'s output region as a flat storage-dtype array of ``nbytes``."""
    if nbytes > len(p.out):
        raise OpError(pb.ARENA_ERROR, f"{ctx.label}: result of {nbytes} bytes does not fit the "
                                      f"{len(p.out)}-byte output region")
    return np.frombuffer(p.out, dtypes.STORAGE[p.dtype], nbytes // dtypes.itemsize(p.dtype))


#: elements combined per pass: small enough that the temporaries stay in cache
BLOCK = 1 << 18
#: a tensor still arriving is folded in once at least this many more elements are usable (the
#: transport reports progress in large steps, halving toward the end of a payload)
FOLD_MIN = 1 << 16


def _power_of_two(w: float) -> bool:
    return w > 0.0 and math.frexp(w)[0] == 0.5


def weighted_sum(out: np.ndarray, x: np.ndarray, self_weight: float,
                 terms: list[tuple[np.ndarray, float]], dtype: int) -> None:
    """``out = self_weight * x + sum(w * y for y, w in terms)`` in the compute dtype.

    Works block by block into ``out`` (storage dtype): no tensor-sized temporary, and the terms
    are added in the given order, so every run gives the same bits. A weight of 0 drops its term
    (its NaN/Inf too) for every dtype.
    """
    compute = dtypes.COMPUTE[dtype]
    live = [(v, w) for v, w in ((x, self_weight), *terms) if w != 0.0]
    if dtypes.STORAGE[dtype] != compute:
        acc = np.empty(min(BLOCK, x.size), compute)
        for start in range(0, x.size, BLOCK):
            end = min(start + BLOCK, x.size)
            a = acc[:end - start]
            a[...] = 0
            for v, w in live:
                a += dtypes.to_compute(v[start:end], dtype) * w
            out[start:end] = dtypes.from_compute(a, dtype)
        return
    if not live:
        out[...] = 0
        return
    # one power-of-two weight for all terms (uniform averaging over 2, 4, 8 ... members): the
    # sum is scaled once, in two passes instead of four. Scaling by a power of two is exact, so
    # the bits are those of scaling each term except at the dtype's edges, as with the averages
    # of NCCL and Horovod (sum, then scale): a sum past the largest finite value is inf, and a
    # result in the subnormal range is rounded once instead of per term
    common = live[0][1]
    factor = len(live) > 1 and all(w == common for _, w in live) and _power_of_two(common)
    # the first term is the output itself (in place): nothing to copy
    first_is_out = out.size == live[0][0].size and out.ctypes.data == live[0][0].ctypes.data
    tmp = np.empty(min(BLOCK, x.size), compute)
    for start in range(0, x.size, BLOCK):
        end = min(start + BLOCK, x.size)
        o = out[start:end]
        for i, (v, w) in enumerate(live):
            src = v[start:end]
            if i == 0:
                if factor or w == 1.0:
                    if not first_is_out:
                        np.copyto(o, src)
                else:
                    np.multiply(src, w, out=o)
            elif factor or w == 1.0:
                np.add(o, src, out=o)
            else:
                np.add(o, np.multiply(src, w, out=tmp[:end - start]), out=o)
        if factor and common != 1.0:
            np.multiply(o, common, out=o)


def _check_ranks(ctx: OpContext, ranks: list[int], what: str) -> None:
    for r in ranks:
        if not 0 <= r < ctx.size:
            raise OpError(pb.INVALID_ARGUMENT, f"{ctx.label}: {what} names rank {r}, but ranks "
                                               f"are 0..{ctx.size - 1}")
        if r == ctx.rank:
            raise OpError(pb.INVALID_ARGUMENT, f"{ctx.label}: {what} names this rank ({r}) "
                                               "itself; use self_weight for the own share")


def neighbor_plan(ctx: OpContext) -> tuple[float, dict[int, float], dict[int, float]]:
    """(self weight, {src: weight} to receive from, {dst: dst weight} to send to).

    No weights: the topology's at this step. ``src_weights`` (with ``self_weight``) reweights the
    topology's in-neighbors (those left out get weight 0). ``dst_weights`` makes the call dynamic:
    send to exactly those ranks, receive from exactly the ``src_weights`` keys.
    """
    req = ctx.req
    step = ctx.topology_step()
    if req.has_src_weights and not req.has_self_weight:
        raise OpError(pb.INVALID_ARGUMENT,
                      f"{ctx.label}: src_weights given without self_weight; pass both")
    if req.has_dst_weights:
        if not req.has_src_weights:
            raise OpError(pb.INVALID_ARGUMENT,
                          f"{ctx.label}: dst_weights given without src_weights; a dynamic call "
                          "names both the ranks it sends to and those it receives from")
        recv = {int(k): float(v) for k, v in req.src_weights.items()}
        send = {int(k): float(v) for k, v in req.dst_weights.items()}
    elif req.has_src_weights:
        unknown = sorted(set(req.src_weights) - set(step.src_weights))
        if unknown:
            raise OpError(pb.INVALID_ARGUMENT,
                          f"{ctx.label}: src_weights names rank(s) {unknown}, which are not "
                          f"in-neighbors of rank {ctx.rank} at this step "
                          f"({step.in_neighbors}); pass dst_weights for a dynamic call")
        recv = {j: float(req.src_weights.get(j, 0.0)) for j in step.src_weights}
        send = {d: 1.0 for d in step.dst_ranks}
    else:
        recv = dict(step.src_weights)
        send = {d: 1.0 for d in step.dst_ranks}
    _check_ranks(ctx, list(recv), "src_weights")
    _check_ranks(ctx, list(send), "dst_weights")
    self_weight = float(req.self_weight) if req.has_self_weight else step.self_weight
    return self_weight, recv, send


class FoldIn:
    """Folds a lone in-neighbor's tensor into the result while it is still arriving.

    The result overwrites the input (one arena slot), so element k is combined only once the
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
        """Input bytes known to be in the kernel for every destination."""
        low = self.p.nbytes
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
        upto = min(filled, self.sent()) // self.itemsize
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
        out = _out(self.ctx, p, p.nbytes)
        lo, b = self.done, self.base
        weighted_sum(out[b + lo:b + upto], p.x[b + lo:b + upto], self.self_weight,
                     [(y[lo:upto], self.src_weight * weight)], p.dtype)
        self.done = upto


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
    req = ctx.req
    if len(recv) != 1 or set(send) != set(recv) or req.has_self_weight \
            or req.has_src_weights or req.has_dst_weights:
        return None
    (j,) = recv
    if not ctx.transport.same_host(j):
        return None
    theirs = ctx.engine.topology.step(j, ctx.round)
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
        return ctx.transport.send_data(j, p.name, p.round, tag, ctx.op, p.dtype, p.shape,
                                       data[lo * isz:hi * isz])

    def check(arrival: Arrival, count: int) -> None:
        if arrival.data.nbytes != count * isz:
            raise OpError(pb.MISMATCH, f"tensor '{p.display}' round {p.round}: rank {j} sent "
                          f"half a tensor of {arrival.data.nbytes} bytes, rank {ctx.rank} "
                          f"expected {count * isz}")

    # the peer's half of the result may come as soon as it has ours: expected from the start
    second = asyncio.ensure_future(ctx.recv_parts(j, 2, parts=[p], sized=False, into=landing))
    try:
        (first,), _ = await gather_all(
            ctx.recv_parts(j, 1, parts=[p], sized=False, progress=fold),
            send(1, p.raw, *theirs))
        check(first, fold.count)
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

    The result is written over the input once it is sent (the client gives both one slot, and
    in-place ops on shared tensors rely on it); a lone in-neighbor's tensor is folded in while
    it arrives (FoldIn), the rest once everything is there. Two ranks that are each other's
    only neighbor with equal weights average large tensors by halves (pair_exchange).
    """
    self_weight, recv, send = neighbor_plan(ctx)
    pair = pair_peer(ctx, self_weight, recv, send)
    halves = [p for p in ctx.parts if p.nbytes >= PAIR_MIN_BYTES] if pair is not None else []
    whole = [p for p in ctx.parts if all(p is not h for h in halves)]
    jobs = [pair_exchange(ctx, p, pair, self_weight) for p in halves if pair is not None]
    if whole:
        jobs.append(exchange_whole(ctx, whole, self_weight, recv, send))
    await gather_all(*jobs)
    return OpResult(sum(p.nbytes for p in ctx.parts), ctx.shape)


async def exchange_whole(ctx: OpContext, parts: list[PartSpec], self_weight: float,
                         recv: dict[int, float], send: dict[int, float]) -> None:
    """neighbor_allreduce of ``parts``: whole tensors to and from every neighbor (one message
    per peer)."""
    srcs = sorted(recv)
    fold = None
    # nothing of our own in the result and nothing to send: the neighbor's tensor is received
    # straight into the output and only scaled there
    direct = self_weight == 0.0 and not send and len(srcs) == 1
    if len(srcs) == 1 and len(parts) == 1 and not direct:
        fold = FoldIn(ctx, parts[0], self_weight, recv[srcs[0]], list(send))

    async def send_to(d: int, w: float) -> None:
        await ctx.send(d, 0, weight=w, ack=d not in recv,
                       track=fold.sends[d] if fold is not None else None, parts=parts)
        if fold is not None:
            fold.finished.add(d)

    # a peer we also receive from checks our tensor against its own and we check its: a
    # disagreement fails both sides without acknowledgements; one-way edges need them
    got = await gather_all(
        *(ctx.recv_parts(j, 0, ack=j not in send, parts=parts, progress=fold, direct=direct)
          for j in srcs),
        *(send_to(d, w) for d, w in send.items()))
    for i, p in enumerate(parts):
        storage = dtypes.STORAGE[p.dtype]
        out = _out(ctx, p, p.nbytes)
        if direct and got[0][i].message is not None and got[0][i].message.buf is None \
                and np.may_share_memory(got[0][i].data, out):  # it landed in the output
            scale = recv[srcs[0]] * got[0][i].weight
            if scale != 1.0:
                weighted_sum(out, out, scale, [], p.dtype)
        elif fold is not None and fold.done and not fold.off:  # the head is combined already
            fold.fold(got[0][i].data, got[0][i].weight, p.x.size)
        else:
            terms = [(got[k][i].data.view(storage), recv[j] * got[k][i].weight)
                     for k, j in enumerate(srcs)]
            weighted_sum(out, p.x, self_weight, terms, p.dtype)


async def compressed_neighbor_allreduce(ctx: OpContext) -> OpResult:
    """neighbor_allreduce of ``Q(x)``: each rank sends its compressed tensor (compression.py).

    The result has two rows: ``self_w * Q(x) + sum_j src_w[j] * d_j * Q(x_j)`` (ascending rank
    order) and ``Q(x)`` itself, decoded from the payload this rank sent, so the caller knows
    exactly what its neighbors received (CHOCO-SGD keeps public copies with it).
    """
    p = ctx.parts[0]
    spec = ctx.req.compression
    try:
        compression.validate(int(spec.kind), float(spec.ratio), p.dtype, p.x.size)
    except compression.CompressionError as exc:
        raise OpError(pb.INVALID_ARGUMENT, f"{ctx.label}: {exc}") from None
    self_weight, recv, send = neighbor_plan(ctx)
    mine = compression.describe(int(spec.kind), float(spec.ratio))
    data = compression.encode(int(spec.kind), float(spec.ratio), p.x, p.dtype)
    rows = _out(ctx, p, 2 * p.nbytes).reshape(2, p.x.size)
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
            raise OpError(pb.MISMATCH, f"tensor '{p.display}' round {p.round}: {exc}") from None
        terms.append((theirs, recv[j] * arrival.weight))
    weighted_sum(mixed, own, self_weight, terms, p.dtype)
    return OpResult(2 * p.nbytes, (2, *ctx.shape))


def allgather_plan(ctx: OpContext) -> tuple[list[int], list[int]]:
    """(ranks to receive from, ranks to send to) of a neighbor allgather."""
    req = ctx.req
    step = ctx.topology_step()
    if req.has_dst_weights != req.has_src_weights:
        raise OpError(pb.INVALID_ARGUMENT, f"{ctx.label}: a dynamic allgather names both "
                                           "src_ranks and dst_ranks")
    srcs = sorted(req.src_weights) if req.has_src_weights else step.in_neighbors
    dsts = sorted(req.dst_weights) if req.has_dst_weights else step.out_neighbors
    _check_ranks(ctx, srcs, "src_ranks")
    _check_ranks(ctx, dsts, "dst_ranks")
    return srcs, dsts


async def neighbor_allgather(ctx: OpContext) -> OpResult:
    """Stack the in-neighbors' tensors (ascending rank) on a new leading dimension."""
    srcs, dsts = allgather_plan(ctx)
    got = await gather_all(*(ctx.recv(j, 0, ack=True) for j in srcs),
                           *(ctx.send(d, 0, ack=True) for d in dsts))
    p = ctx.parts[0]
    out = _out(ctx, p, p.nbytes * len(srcs)).reshape(len(srcs), p.x.size)
    for k, (arr, _) in enumerate(got[: len(srcs)]):
        out[k] = arr
    return OpResult(int(out.nbytes), (len(srcs), *ctx.shape), srcs)


async def _allreduce_direct(ctx: OpContext) -> int:
    """Everyone sends its tensors to everyone; each rank sums all n in rank order, per tensor."""
    others = [r for r in range(ctx.size) if r != ctx.rank]
    got = await gather_all(*(ctx.recv_parts(r, 0) for r in others),
                           *(ctx.send(r, 0) for r in others))
    total = 0
    for i, p in enumerate(ctx.parts):
        storage = dtypes.STORAGE[p.dtype]
        parts = {r: got[k][i].data.view(storage) for k, r in enumerate(others)}
        parts[ctx.rank] = p.x
        acc = dtypes.to_accum(parts[0], p.dtype)
        for r in range(1, ctx.size):
            acc += dtypes.to_accum(parts[r], p.dtype)
        total += _finish_allreduce(ctx, p, acc)
    return total


def _finish_allreduce(ctx: OpContext, p: PartSpec, acc: np.ndarray) -> int:
    """Write a sum (or average) in the accumulation dtype to part ``p``'s output."""
    divide = ctx.size if ctx.req.reduce_op == pb.AVERAGE else 1
    out = _out(ctx, p, p.nbytes)
    if acc.dtype == out.dtype and p.dtype not in dtypes.INTEGER:
        if divide == 1:
            np.copyto(out, acc)
        else:
            np.multiply(acc, acc.dtype.type(1.0 / divide), out=out)
    else:
        out[...] = dtypes.from_accum(acc, p.dtype, divide)
    return p.nbytes


async def _allreduce_ring(ctx: OpContext) -> int:
    """Bandwidth-optimal ring: reduce-scatter then allgather, 2(n-1) steps of 1/n each.

    Partial sums travel in the accumulation dtype (float32 for 16-bit floats, int64 for
    integers), so they neither overflow nor lose precision on the way; each chunk is summed along
    the ring once and then copied, so every rank ends with bit-identical values. The working
    copy comes from the daemon's buffer pool, so a training step allocates nothing new.
    """
    p = ctx.parts[0]
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    accum = dtypes.ACCUM[p.dtype]
    pool = ctx.transport.pool
    block = pool.get(p.x.size * accum.itemsize)
    try:
        work = block.view(accum)
        if p.dtype == pb.BFLOAT16:
            np.left_shift(p.x, 16, out=work.view(np.uint32), dtype=np.uint32)
        else:
            np.copyto(work, p.x, casting="safe")
        bounds = np.linspace(0, work.size, n + 1).astype(np.int64)

        def chunk(i: int) -> np.ndarray:
            i %= n
            return work[bounds[i]:bounds[i + 1]]

        async def step(tag: int, send: np.ndarray, into: np.ndarray, add: bool) -> None:
            (arrival,), _ = await gather_all(ctx.recv_parts(left, tag, sized=False),
                                             _send_chunk(ctx, right, tag, send))
            got = arrival.data.view(work.dtype)
            if got.size != into.size:
                raise OpError(pb.MISMATCH, f"tensor '{ctx.display}' round {ctx.round}: rank "
                              f"{left} sent a ring chunk of {got.size} elements, rank {r} "
                              f"expected {into.size}")
            if add:
                into += got
            else:
                into[...] = got
            ctx.release(arrival)

        for s in range(n - 1):
            await step(1 + s, chunk(r - s), chunk(r - s - 1), True)
        for s in range(n - 1):
            await step(n + s, chunk(r + 1 - s), chunk(r - s), False)
        return _finish_allreduce(ctx, p, work)
    finally:
        pool.put(block)


async def _send_chunk(ctx: OpContext, dst: int, tag: int, chunk: np.ndarray) -> None:
    """Send one ring chunk; the header carries the whole tensor's meta, so mismatches show."""
    await ctx.transport.send_data(
        dst, ctx.name, ctx.round, tag, ctx.op, ctx.dtype, ctx.shape, _payload(chunk)
    )


async def allreduce(ctx: OpContext) -> OpResult:
    """Sum or average over all ranks (ring for large tensors, direct exchange for small)."""
    if ctx.size == 1:
        total = sum(_finish_allreduce(ctx, p, dtypes.to_accum(p.x, p.dtype)) for p in ctx.parts)
    elif _uses_ring(ctx):
        total = await _allreduce_ring(ctx)
    else:
        total = await _allreduce_direct(ctx)
    return OpResult(total, ctx.shape)


def _uses_ring(ctx: OpContext) -> bool:
    """A lone tensor at or above the ring threshold (fused requests are small tensors)."""
    if len(ctx.parts) != 1:
        return False
    return ctx.req.nbytes >= ctx.engine.ring_threshold and ctx.parts[0].x.size >= ctx.size


def _root(ctx: OpContext) -> int:
    root = int(ctx.req.root)
    if not 0 <= root < ctx.size:
        raise OpError(pb.INVALID_ARGUMENT, f"{ctx.label}: root {root} is not a rank "
                                           f"(0..{ctx.size - 1})")
    return root


async def broadcast(ctx: OpContext) -> OpResult:
    """Every rank gets ``root``'s tensors."""
    root = _root(ctx)  # the tag is the root, so ranks that disagree on it notice
    if ctx.rank == root:
        others = [r for r in range(ctx.size) if r != root]
        await gather_all(*(ctx.send(r, root, ack=True) for r in others))
        values = [p.x for p in ctx.parts]
    else:  # a lone tensor is received straight into the output
        got = await ctx.recv_parts(root, root, ack=True, direct=len(ctx.parts) == 1)
        values = [a.data.view(dtypes.STORAGE[p.dtype]) for a, p in zip(got, ctx.parts,
                                                                        strict=True)]
    total = 0
    for p, v in zip(ctx.parts, values, strict=True):
        out = _out(ctx, p, p.nbytes)
        if not np.may_share_memory(out, v):
            out[...] = v
        total += p.nbytes
    return OpResult(total, ctx.shape)


async def barrier(ctx: OpContext) -> OpResult:
    """Dissemination barrier: ceil(log2 n) rounds, in round k send to r+2^k, hear from r-2^k."""
    n, r = ctx.size, ctx.rank
    empty = memoryview(b"")
    for k, hop in enumerate(hops(n)):
        await gather_all(
            ctx.recv((r - hop) % n, k),
            ctx.transport.send_data((r + hop) % n, ctx.name, ctx.round, k, ctx.op, ctx.dtype,
                                    ctx.shape, empty),
        )
    return OpResult(0, ())


def _others(ctx: OpContext) -> set[int]:
    return set(range(ctx.size)) - {ctx.rank}


def _neighbor_peers(ctx: OpContext) -> set[int]:
    _, recv, send = neighbor_plan(ctx)
    return set(recv) | set(send)


def _neighbor_tags(ctx: OpContext) -> set[int]:
    if pair_peer(ctx, *neighbor_plan(ctx)) is None:
        return {0}
    return {1, 2} | ({0} if any(p.nbytes < PAIR_MIN_BYTES for p in ctx.parts) else set())


def _allgather_peers(ctx: OpContext) -> set[int]:
    srcs, dsts = allgather_plan(ctx)
    return set(srcs) | set(dsts)


def _allreduce_peers(ctx: OpContext) -> set[int]:
    if ctx.size > 1 and _uses_ring(ctx):
        return {(ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size}
    return _others(ctx)


def _broadcast_peers(ctx: OpContext) -> set[int]:
    root = _root(ctx)
    return _others(ctx) if ctx.rank == root else {root}


def _barrier_peers(ctx: OpContext) -> set[int]:
    n, r = ctx.size, ctx.rank
    return {(r + h) % n for h in hops(n)} | {(r - h) % n for h in hops(n)}


def _allreduce_tags(ctx: OpContext) -> set[int]:
    if ctx.size > 1 and _uses_ring(ctx):
        return set(range(1, 2 * ctx.size - 1))
    return {0}


OPS: dict[int, OpSpec] = {
    pb.NEIGHBOR_ALLREDUCE: OpSpec(neighbor_allreduce, _neighbor_peers, _neighbor_tags,
                                  fusable=True),
    pb.NEIGHBOR_ALLGATHER: OpSpec(neighbor_allgather, _allgather_peers, lambda _ctx: {0}),
    pb.ALLREDUCE: OpSpec(allreduce, _allreduce_peers, _allreduce_tags, fusable=True),
    pb.BROADCAST: OpSpec(broadcast, _broadcast_peers, lambda ctx: {_root(ctx)}, fusable=True),
    pb.COMPRESSED_NEIGHBOR_ALLREDUCE: OpSpec(compressed_neighbor_allreduce, _neighbor_peers,
                                             lambda _ctx: {0}),
    pb.BARRIER: OpSpec(barrier, _barrier_peers,
                       lambda ctx: set(range(len(hops(ctx.size))))),
}
