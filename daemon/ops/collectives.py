"""Collectives over every rank: allreduce, allgather, broadcast, barrier.

Results are deterministic: the direct allreduce combines (adds, or takes the minimum, maximum or
product) in ascending rank order, the ring combines each chunk along the ring, so every rank gets
identical values.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np

from decent_wire import dtypes
from decent_wire.graphs import hops
from decent_wire.numerics import (
    ACCUM,
    INTEGER,
    REDUCERS,
    divide,
    from_accum,
    reduce_into,
    to_accum,
)
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import VERDICT_CODES
from decentd.keys import agreement
from decentd.ops.agreement import (
    AGREE_TAG,
    agrees_in_exchange,
    description_parts,
    first_against,
    ruling,
)
from decentd.ops.api import (
    Arrival,
    DecentError,
    OpContext,
    OpResult,
    OpSpec,
    PartSpec,
    gather_all,
)
from decentd.ops.faults import live_group
from decentd.ops.parts import Expected

#: the message tag of the direct allreduce (the ring's steps are 1 .. 2(n - 1))
DIRECT_TAG = 0
#: seconds a direct allreduce that agrees in its exchange waits for the descriptions of a peer
#: whose data disagreed first (a collective sends them with its data; a neighbor op sends none)
DESCRIBED_WITHIN = 1.0


async def _allreduce_direct(ctx: OpContext) -> int:
    """Everyone sends its tensors to everyone; each rank sums all n in rank order, per tensor
    (among a few, the parts carry their descriptions: the ranks agree in this exchange)."""
    group = live_group(ctx)
    others = [r for r in group if r != ctx.rank]
    if ctx.agrees_in_exchange:
        got = await _exchange_agreed(ctx, others)
    else:
        got = await gather_all(*(ctx.recv_parts(r, DIRECT_TAG) for r in others),
                               *(ctx.send(r, DIRECT_TAG) for r in others))
    total = 0
    for i, p in enumerate(ctx.parts):
        storage = dtypes.STORAGE[p.dtype]
        parts = {r: got[k][i].data.view(storage) for k, r in enumerate(others)}
        parts[ctx.rank] = p.x
        acc = to_accum(parts[group[0]], p.dtype)
        for r in group[1:]:
            reduce_into(acc, to_accum(parts[r], p.dtype), ctx.args.reduce_op)
        total += _finish_allreduce(ctx, p, acc)
    return total


async def _exchange_agreed(ctx: OpContext, others: list[int]) -> list[list[Arrival]]:
    """Send this op's tensors to every one of ``others``, its descriptions in the same
    message under the agreement's keys (as an agreement of its own would send them: a peer
    that runs one takes them), and receive theirs. Each tensor's verdict is drawn from every
    description before the data is looked at, and raised if against (the same everywhere, even
    when a peer's data disagreed first); then the data, checked as
    :meth:`OpContext.recv_parts` checks it, by peer in ``others``' order."""
    keys = [(agreement(p.name), p.round) for p in ctx.parts]
    mailbox = ctx.services.mailbox
    for src, error in mailbox.open(keys, ctx):  # a peer's abort of them reaches this op
        ctx.aborted(src, error)
    said = [mailbox.expect(r, name, round_, AGREE_TAG) for r in others for name, round_ in keys]
    data: list[Expected] = []
    sends: list[asyncio.Future[None]] = []
    try:
        data = [ctx.expect_parts(r, DIRECT_TAG) for r in others]
        described = description_parts(ctx)
        sent: DecentError | None = None
        if len(others) == 1:  # one peer: its send needs no task of its own (a loop pass less)
            sent = await _send_unless_ruled(ctx, others[0], described)
        else:
            sends = [asyncio.ensure_future(ctx.send(r, DIRECT_TAG, extra=described))
                     for r in others]
        ruled = await _rule_first(ctx, said, others)
        if ruled is not None:
            raise ruled
        got = [await ctx.arrivals(e) for e in data]
        if sent is not None:
            raise sent
        await asyncio.gather(*sends)
        return got
    except BaseException:
        for t in sends:
            t.cancel()
        # the sends end before the op reports (a peer's failure meanwhile must not replace it)
        await _through_cancels(asyncio.gather(*sends, return_exceptions=True))
        for f in said:
            f.cancel()
            f.add_done_callback(_seen)
        for e in data:
            e.drop()
        raise
    finally:  # what a peer sends under them later is dropped
        mailbox.close(keys)


async def _send_unless_ruled(ctx: OpContext, peer: int, described: list[pb.Part]
                             ) -> DecentError | None:
    """Send this op's tensors and descriptions to ``peer``; how the send failed, if it did (the
    caller raises it after the verdict, as it would a send task's). A disagreement that fails
    the op meanwhile stops the send, and the verdict is drawn next (:func:`_rule_first`)."""
    try:
        await ctx.send(peer, DIRECT_TAG, extra=described)
    except asyncio.CancelledError:
        if ctx.failure is None or ctx.failure.code not in VERDICT_CODES:
            raise
    except DecentError as err:
        return err
    return None


def _seen(fut: asyncio.Future[Any]) -> None:
    """Mark ``fut``'s exception as retrieved (its op has failed already)."""
    if not fut.cancelled():
        fut.exception()


async def _rule_first(ctx: OpContext, said: list[asyncio.Future[Arrival]], others: list[int]
                      ) -> DecentError | None:
    """The verdict from every peer's descriptions (``said``: theirs, peer by peer, part by
    part, from ``others``). The op failed for a disagreement before they came (a peer's data
    disagreed with ours, or a peer failed it and told us, before or after it started here): a
    collective's descriptions come with its data, so they are waited for a while
    (:data:`DESCRIBED_WITHIN`), and their verdict, the same on every rank, is raised instead
    (a neighbor op under the same name sends none)."""
    if ctx.failure is None and all(f.done() and not f.cancelled() and f.exception() is None
                                   for f in said):  # all here: no wait
        return _rule(ctx, [f.result() for f in said], others)
    together = asyncio.gather(*said)
    together.add_done_callback(_seen)
    if ctx.failure is None:
        try:
            return _rule(ctx, await asyncio.shield(together), others)
        except asyncio.CancelledError:
            if ctx.failure is None or ctx.failure.code not in VERDICT_CODES:
                raise
    failure = ctx.failure
    assert failure is not None
    await _through_cancels(together, DESCRIBED_WITHIN)
    if not together.done() or together.cancelled() or together.exception() is not None:
        raise failure
    raise _rule(ctx, together.result(), others) or failure


async def _through_cancels(fut: asyncio.Future[Any], within: float | None = None) -> None:
    """Wait until ``fut`` is done (or ``within`` seconds have passed), whatever cancels this
    task meanwhile (more failures of the op: the peer that disagreed tells us too)."""
    loop = asyncio.get_running_loop()
    deadline = None if within is None else loop.time() + within
    while not fut.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            return
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({fut}, timeout=left)


def _rule(ctx: OpContext, arrived: list[Arrival], others: list[int]) -> DecentError | None:
    """The op's verdict from ``arrived`` (every peer's description of each part, peer by
    peer) and its own."""
    n = len(ctx.parts)
    rulings = []
    for i, p in enumerate(ctx.parts):
        assert p.agreement is not None
        theirs = dict(zip(others, arrived[i::n], strict=True))
        rulings.append(ruling(ctx, i, p.agreement, theirs))
    return first_against(rulings)


def _finish_allreduce(ctx: OpContext, p: PartSpec, acc: np.ndarray,
                      averaged: bool = False) -> int:
    """Write a sum (or average) in the accumulation dtype to part ``p``'s output
    (``averaged``: ``acc`` holds the average already)."""
    average = ctx.args.reduce_op == pb.AVERAGE and not averaged
    divisor = len(live_group(ctx)) if average else 1
    out = ctx.output(p, p.nbytes)
    if acc.dtype == out.dtype and p.dtype not in INTEGER:
        if divisor == 1:
            if not _same_memory(out, acc):  # summed in place already
                np.copyto(out, acc)
        else:
            divide(acc, divisor, out)
    else:
        out[...] = from_accum(acc, p.dtype, divisor)
    return p.nbytes


async def _allreduce_ring(ctx: OpContext) -> int:
    """Bandwidth-optimal ring: reduce-scatter then allgather, 2(n-1) steps of 1/n each.

    Partial sums travel in the accumulation dtype (float32 for 16-bit floats, int64 for
    integers), so they neither overflow nor lose precision on the way; each chunk is summed along
    the ring once (and averaged once, by the rank that summed it last) and then copied, so every
    rank ends with bit-identical values. A float tensor summed in its own dtype is reduced in
    its output region (read from the tensor, the last chunks received straight into place: no
    whole-tensor copy; if the op fails, part of an in-place tensor may hold sums already, as
    with neighbor ops); others in a working copy from the daemon's buffer pool, so a training
    step allocates nothing new.
    """
    p = ctx.parts[0]
    group = live_group(ctx)
    n, r = len(group), group.index(ctx.rank)
    right, left = group[(r + 1) % n], group[(r - 1) % n]
    own, work = _ring_memory(ctx, p)
    block = None if work is not None else ctx.services.pool.get(
        p.x.size * ACCUM[p.dtype].itemsize)
    try:
        if work is None:
            assert block is not None
            work = own = block.view(ACCUM[p.dtype])
            _accumulate_from(p.x, p.dtype, work)
        bounds = np.linspace(0, work.size, n + 1).astype(np.int64)

        def chunk(i: int, of: np.ndarray = work) -> np.ndarray:
            i %= n
            return of[bounds[i]:bounds[i + 1]]

        async def step(tag: int, send: np.ndarray, into: int, mine: np.ndarray | None) -> None:
            """Send ``send``; the left neighbour's chunk comes into chunk ``into``: combined
            with ``mine`` (this rank's values of it), or as it is (None: straight into place
            where it can land there)."""
            out = chunk(into)
            land = out.view(np.uint8) if mine is None and block is None else None
            (arrival,), _ = await gather_all(ctx.recv_parts(left, tag, sized=False, into=land),
                                             _send_chunk(ctx, right, tag, send))
            got = arrival.data.view(work.dtype)
            _check_chunk(ctx, left, got.size, out.size)
            if mine is not None:
                REDUCERS[ctx.args.reduce_op](mine, got, out=out)
            elif not _same_memory(got, out):
                out[...] = got
            ctx.release(arrival)

        for s in range(n - 1):
            await step(1 + s, chunk(r - s, own if s == 0 else work), r - s - 1,
                       chunk(r - s - 1, own))
        # in the output region, an average divides only the chunk this rank summed last
        averaged = block is None and ctx.args.reduce_op == pb.AVERAGE
        if averaged:
            divide(chunk(r + 1), n, chunk(r + 1))
        for s in range(n - 1):
            await step(n + s, chunk(r + 1 - s), r - s, None)
        return _finish_allreduce(ctx, p, work, averaged)
    finally:
        if block is not None:
            ctx.services.pool.put(block)


def _check_chunk(ctx: OpContext, left: int, got: int, want: int) -> None:
    """MISMATCH unless the ring chunk from rank ``left`` has the ``want`` elements expected."""
    if got != want:
        raise DecentError(pb.MISMATCH, f"tensor '{ctx.display}' round {ctx.round}: rank {left} "
                          f"sent a ring chunk of {got} elements, rank {ctx.rank} expected {want}")


def _accumulate_from(x: np.ndarray, dtype: int, work: np.ndarray) -> None:
    """``work`` (in the accumulation dtype) holds ``x`` (a tensor of ``dtype``) from now on."""
    if dtype == pb.BFLOAT16:
        np.left_shift(x, 16, out=work.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(work, x, casting="safe")


def _ring_memory(ctx: OpContext, p: PartSpec) -> tuple[np.ndarray, np.ndarray | None]:
    """(this rank's values, the region the ring sums in): the tensor and its output region for
    a float tensor summed in its own dtype whose output is the tensor itself or apart from it;
    else (the tensor, None): a working copy is needed."""
    x = p.x.reshape(-1)
    if p.dtype in INTEGER or p.dtype == pb.BFLOAT16 or x.dtype != ACCUM[p.dtype]:
        return x, None
    out = ctx.output(p, p.nbytes).view(x.dtype)
    if np.may_share_memory(out, x) and not _same_memory(out, x):
        return x, None
    return x, out


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the same bytes."""
    return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                and a.nbytes == b.nbytes)


async def _send_chunk(ctx: OpContext, dst: int, tag: int, chunk: np.ndarray) -> None:
    """Send one ring chunk; the header carries the whole tensor's meta, so mismatches show."""
    await ctx.send_bytes(dst, tag, np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data)


async def allreduce(ctx: OpContext) -> OpResult:
    """Sum or average over the live ranks (ring for large tensors, direct exchange for small);
    the result names the ranks it covers."""
    if len(live_group(ctx)) == 1:
        total = sum(_finish_allreduce(ctx, p, to_accum(p.x, p.dtype)) for p in ctx.parts)
    elif _uses_ring(ctx):
        total = await _allreduce_ring(ctx)
    else:
        total = await _allreduce_direct(ctx)
    return OpResult(total, ctx.shape, live_group(ctx))


def _agrees_itself(ctx: OpContext) -> bool:
    """Whether an allreduce agrees in its own exchange: a direct one among a few."""
    return agrees_in_exchange(ctx) and not _uses_ring(ctx)


def _uses_ring(ctx: OpContext) -> bool:
    """A lone tensor at or above the ring threshold (fused requests are small tensors)."""
    if len(ctx.parts) != 1:
        return False
    p = ctx.parts[0]
    return p.nbytes >= ctx.services.ring_threshold and p.x.size >= len(live_group(ctx))


def _root(ctx: OpContext) -> int:
    root = int(ctx.args.root)
    if not 0 <= root < ctx.size:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: root {root} is not a rank "
                                           f"(0..{ctx.size - 1})")
    return root


async def broadcast(ctx: OpContext) -> OpResult:
    """Every live rank gets ``root``'s tensors."""
    root = _root(ctx)  # the tag is the root, so ranks that disagree on it notice
    if ctx.rank == root:
        others = [r for r in live_group(ctx) if r != root]
        await gather_all(*(ctx.send(r, root) for r in others))
        values = [p.x for p in ctx.parts]
    else:  # a lone tensor is received straight into the output
        got = await ctx.recv_parts(root, root, direct=len(ctx.parts) == 1)
        values = [a.data.view(dtypes.STORAGE[p.dtype]) for a, p in zip(got, ctx.parts,
                                                                        strict=True)]
    total = 0
    for p, v in zip(ctx.parts, values, strict=True):
        out = ctx.output(p, p.nbytes)
        if not np.may_share_memory(out, v):
            out[...] = v
        total += p.nbytes
    return OpResult(total, ctx.shape, live_group(ctx))


async def barrier(ctx: OpContext) -> OpResult:
    """Dissemination barrier over the live ranks: ceil(log2 n) rounds, in round k send to
    r+2^k, hear from r-2^k (positions among them)."""
    group = live_group(ctx)
    n, r = len(group), group.index(ctx.rank)
    empty = memoryview(b"")
    for k, hop in enumerate(hops(n)):
        await gather_all(
            ctx.recv(group[(r - hop) % n], k),
            ctx.send_bytes(group[(r + hop) % n], k, empty),
        )
    return OpResult(0, (), group)


async def allgather(ctx: OpContext) -> OpResult:
    """Every rank's tensor concatenated on the first dimension, in rank order (the first
    dimensions may differ: ``sizes`` has every rank's, exchanged by the clients first)."""
    p = ctx.parts[0]
    sizes = [int(s) for s in ctx.args.sizes]
    if not p.shape or len(sizes) != ctx.size or sizes[ctx.rank] != p.shape[0]:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: allgather needs a tensor of at "
                          f"least one dimension and one size per rank with this rank's first "
                          f"({p.shape[0] if p.shape else None}); got sizes {sizes}")
    others = [r for r in range(ctx.size) if r != ctx.rank]
    got = await gather_all(*(ctx.recv_rows(r, 0, sizes[r]) for r in others),
                           *(ctx.send(r, 0) for r in others))
    pieces = {r: a.data for r, a in zip(others, got, strict=False)}
    pieces[ctx.rank] = p.x.view(np.uint8)
    total = sum(int(v.nbytes) for v in pieces.values())
    out = ctx.output(p, total).view(np.uint8) if total else np.empty(0, np.uint8)
    at = 0
    for r in range(ctx.size):
        out[at:at + pieces[r].nbytes] = pieces[r]
        at += pieces[r].nbytes
    return OpResult(total, (sum(sizes), *p.shape[1:]))


def _allgather_rows(ctx: OpContext) -> dict[int, int]:
    return dict(enumerate(int(s) for s in ctx.args.sizes))


def _others(ctx: OpContext) -> set[int]:
    return set(range(ctx.size)) - {ctx.rank}


def _live_others(ctx: OpContext) -> set[int]:
    return set(live_group(ctx)) - {ctx.rank}


def _allreduce_peers(ctx: OpContext) -> set[int]:
    group = live_group(ctx)
    if len(group) > 1 and _uses_ring(ctx):
        n, r = len(group), group.index(ctx.rank)
        return {group[(r + 1) % n], group[(r - 1) % n]}
    return _live_others(ctx)


def _allreduce_tags(ctx: OpContext) -> set[int]:
    n = len(live_group(ctx))
    if n > 1 and _uses_ring(ctx):
        return set(range(1, 2 * n - 1))
    return {DIRECT_TAG}


def _broadcast_peers(ctx: OpContext) -> set[int]:
    root = _root(ctx)
    group = live_group(ctx)
    if root not in group:
        raise DecentError(pb.PEER_UNAVAILABLE, f"{ctx.label}: root {root} is not live (live "
                          f"ranks: {group})")
    return _live_others(ctx) if ctx.rank == root else {root}


def _barrier_peers(ctx: OpContext) -> set[int]:
    group = live_group(ctx)
    n, r = len(group), group.index(ctx.rank)
    return {group[(r + h) % n] for h in hops(n)} | {group[(r - h) % n] for h in hops(n)}


COLLECTIVE_OPS: dict[int, OpSpec] = {
    pb.ALLREDUCE: OpSpec(
        allreduce, _allreduce_peers, _allreduce_tags,
        tag_hint="ring vs. direct exchange: is transport.ring_threshold_bytes the same "
                 "everywhere?", agrees_itself=_agrees_itself),
    pb.BROADCAST: OpSpec(broadcast, _broadcast_peers, lambda ctx: {_root(ctx)},
                         tag_hint="different broadcast roots"),
    pb.BARRIER: OpSpec(barrier, _barrier_peers,
                       lambda ctx: set(range(len(hops(len(live_group(ctx))))))),
    pb.ALLGATHER: OpSpec(allgather, _others, lambda _ctx: {0}, rows=_allgather_rows),
}
