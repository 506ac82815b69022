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

from decentd import dtypes
from decentd.engine import OpContext, OpResult, OpSpec
from decentd.errors import OpError
from decentd.topology import hops
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


def _write(out: memoryview, values: np.ndarray, what: str) -> int:
    raw = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    if raw.size > len(out):
        raise OpError(pb.ARENA_ERROR, f"{what}: result of {raw.size} bytes does not fit the "
                                      f"{len(out)}-byte output region")
    np.frombuffer(out, np.uint8, count=raw.size)[...] = raw
    return int(raw.size)


def _payload(x: np.ndarray) -> memoryview:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8).data


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


async def neighbor_allreduce(ctx: OpContext, x: np.ndarray, out: memoryview) -> OpResult:
    """``out = self_w * x + sum_j src_w[j] * d_j * x_j`` over this step's in-neighbors."""
    self_weight, recv, send = neighbor_plan(ctx)
    payload = _payload(x)
    sends = [ctx.send(d, 0, payload, weight=w, ack=True) for d, w in send.items()]
    srcs = sorted(recv)
    got = await gather_all(*(ctx.recv(j, 0, ack=True) for j in srcs), *sends)
    acc = dtypes.to_compute(x.reshape(-1), ctx.dtype) * self_weight
    for j, (arr, d) in zip(srcs, got[: len(srcs)], strict=True):
        acc += dtypes.to_compute(arr, ctx.dtype) * (recv[j] * d)
    n = _write(out, dtypes.from_compute(acc, ctx.dtype), ctx.label)
    return OpResult(n, ctx.shape)


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


async def neighbor_allgather(ctx: OpContext, x: np.ndarray, out: memoryview) -> OpResult:
    """Stack the in-neighbors' tensors (ascending rank) on a new leading dimension."""
    srcs, dsts = allgather_plan(ctx)
    payload = _payload(x)
    sends = [ctx.send(d, 0, payload, ack=True) for d in dsts]
    got = await gather_all(*(ctx.recv(j, 0, ack=True) for j in srcs), *sends)
    parts = [arr for arr, _ in got[: len(srcs)]]
    stacked = np.stack(parts) if parts else np.empty((0, *ctx.shape), x.dtype)
    n = _write(out, stacked, ctx.label)
    return OpResult(n, (len(srcs), *ctx.shape), srcs)


async def _allreduce_direct(ctx: OpContext, flat: np.ndarray) -> np.ndarray:
    """Everyone sends its tensor to everyone; each rank sums all n in rank order."""
    others = [r for r in range(ctx.size) if r != ctx.rank]
    payload = _payload(flat)
    got = await gather_all(
        *(ctx.recv(r, 0) for r in others), *(ctx.send(r, 0, payload) for r in others)
    )
    parts = dict(zip(others, (arr for arr, _ in got[: len(others)]), strict=True))
    parts[ctx.rank] = flat
    acc = dtypes.to_accum(parts[0], ctx.dtype)
    for r in range(1, ctx.size):
        acc += dtypes.to_accum(parts[r], ctx.dtype)
    return acc


async def _allreduce_ring(ctx: OpContext, flat: np.ndarray) -> np.ndarray:
    """Bandwidth-optimal ring: reduce-scatter then allgather, 2(n-1) steps of 1/n each.

    Partial sums travel in the accumulation dtype (float32 for 16-bit floats, int64 for
    integers), so they neither overflow nor lose precision on the way; each chunk is summed along
    the ring once and then copied, so every rank ends with bit-identical values.
    """
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    work = dtypes.to_accum(flat, ctx.dtype)
    bounds = np.linspace(0, work.size, n + 1).astype(np.int64)

    def chunk(i: int) -> np.ndarray:
        i %= n
        return work[bounds[i]:bounds[i + 1]]

    async def step(tag: int, send: np.ndarray, into: np.ndarray) -> np.ndarray:
        (arr, _), _ = await gather_all(ctx.recv(left, tag), _send_chunk(ctx, right, tag, send))
        got = arr.view(np.uint8).view(work.dtype)
        if got.size != into.size:
            raise OpError(pb.MISMATCH, f"tensor '{ctx.display}' round {ctx.round}: rank {left} "
                          f"sent a ring chunk of {got.size} elements, rank {r} expected "
                          f"{into.size}")
        return got

    for s in range(n - 1):
        into = chunk(r - s - 1)
        into += await step(1 + s, chunk(r - s), into)
    for s in range(n - 1):
        into = chunk(r - s)
        into[...] = await step(n + s, chunk(r + 1 - s), into)
    return work


async def _send_chunk(ctx: OpContext, dst: int, tag: int, part: np.ndarray) -> None:
    """Send one ring chunk; the header carries the whole tensor's meta, so mismatches show."""
    await ctx.transport.send_data(
        dst, ctx.name, ctx.round, tag, ctx.op, ctx.dtype, ctx.shape, _payload(part)
    )


async def allreduce(ctx: OpContext, x: np.ndarray, out: memoryview) -> OpResult:
    """Sum or average over all ranks (ring for large tensors, direct exchange for small)."""
    flat = x.reshape(-1)
    if ctx.size == 1:
        total = dtypes.to_accum(flat, ctx.dtype)
    elif _uses_ring(ctx):
        total = await _allreduce_ring(ctx, flat)
    else:
        total = await _allreduce_direct(ctx, flat)
    divide = ctx.size if ctx.req.reduce_op == pb.AVERAGE else 1
    return OpResult(_write(out, dtypes.from_accum(total, ctx.dtype, divide), ctx.label),
                    ctx.shape)


def _uses_ring(ctx: OpContext) -> bool:
    return ctx.req.nbytes >= ctx.engine.ring_threshold and math.prod(ctx.shape) >= ctx.size


def _root(ctx: OpContext) -> int:
    root = int(ctx.req.root)
    if not 0 <= root < ctx.size:
        raise OpError(pb.INVALID_ARGUMENT, f"{ctx.label}: root {root} is not a rank "
                                           f"(0..{ctx.size - 1})")
    return root


async def broadcast(ctx: OpContext, x: np.ndarray, out: memoryview) -> OpResult:
    """Every rank gets ``root``'s tensor."""
    root = _root(ctx)  # the tag is the root, so ranks that disagree on it notice
    if ctx.rank == root:
        others = [r for r in range(ctx.size) if r != root]
        payload = _payload(x)
        await gather_all(*(ctx.send(r, root, payload, ack=True) for r in others))
        value = x
    else:
        value, _ = await ctx.recv(root, root, ack=True)
    return OpResult(_write(out, value, ctx.label), ctx.shape)


async def barrier(ctx: OpContext, x: np.ndarray, out: memoryview) -> OpResult:
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
    pb.NEIGHBOR_ALLREDUCE: OpSpec(neighbor_allreduce, _neighbor_peers, lambda _ctx: {0}),
    pb.NEIGHBOR_ALLGATHER: OpSpec(neighbor_allgather, _allgather_peers, lambda _ctx: {0}),
    pb.ALLREDUCE: OpSpec(allreduce, _allreduce_peers, _allreduce_tags),
    pb.BROADCAST: OpSpec(broadcast, _broadcast_peers, lambda ctx: {_root(ctx)}),
    pb.BARRIER: OpSpec(barrier, _barrier_peers,
                       lambda ctx: set(range(len(hops(ctx.size))))),
}
