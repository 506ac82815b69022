"""Rows to and from chosen ranks: ``alltoall`` (agreed among every worker first) and
``sendrecv`` (between the ranks it names only).

One op serves torch.distributed's ``scatter``, ``gather``, ``all_to_all``, ``reduce``,
``reduce_scatter`` and ``send``/``recv``: rank ``r`` sends ``send_rows[j]`` first-dimension rows
of its tensor to each rank ``j`` (in rank order: the rows for rank 0 first) and receives
``recv_rows[i]`` rows from each rank ``i``. The pieces received (its own included) are
concatenated in rank order, or, with ``reduce``, combined element-wise in rank order in the
accumulation dtype (so every rank's result is the same whatever order they arrive in). Every
piece is checked against what the receiver expects (dtype, rows, the rest of the shape).
"""

from __future__ import annotations

import numpy as np

from decent_wire import dtypes
from decent_wire.numerics import from_accum, reduce_into, to_accum
from decent_wire.ops import exchanged_rows
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops.api import DecentError, OpContext, OpResult, OpSpec, gather_all


def rows_of(ctx: OpContext) -> tuple[list[int], list[int]]:
    """The op's (send_rows, recv_rows), one entry per rank, checked against its tensor."""
    send = [int(r) for r in ctx.args.send_rows]
    recv = [int(r) for r in ctx.args.recv_rows]
    p = ctx.parts[0]
    if len(send) != ctx.size or len(recv) != ctx.size:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: {len(send)} send and "
                          f"{len(recv)} receive row counts for {ctx.size} ranks")
    if not p.shape or sum(send) != p.shape[0]:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: sends {sum(send)} rows in all, "
                          f"but its tensor is {dtypes.describe(p.dtype, p.shape)}")
    if send[ctx.rank] != recv[ctx.rank]:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: sends {send[ctx.rank]} rows to "
                          f"itself but expects {recv[ctx.rank]}")
    if ctx.args.HasField("reduce") and len({r for r in recv if r}) > 1:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: reduces pieces of different "
                          f"rows {recv}")
    return send, recv


async def exchange(ctx: OpContext) -> OpResult:
    """Send each rank its rows, receive theirs, then concatenate or reduce them."""
    p = ctx.parts[0]
    send, recv = rows_of(ctx)
    rest = tuple(p.shape[1:])
    row_bytes = dtypes.nbytes(p.dtype, rest)
    starts = np.concatenate([[0], np.cumsum(send)]).astype(np.int64) * row_bytes
    raw = p.raw
    srcs = [i for i in range(ctx.size) if i != ctx.rank and recv[i]]
    sends = [ctx.send_bytes(j, 0, raw[starts[j]:starts[j + 1]], shape=(send[j], *rest))
             for j in range(ctx.size) if j != ctx.rank and send[j]]
    got = await gather_all(*(ctx.recv_rows(i, 0, recv[i]) for i in srcs), *sends)
    pieces = {i: a.data.view(np.uint8) for i, a in zip(srcs, got, strict=False)}
    if recv[ctx.rank]:  # a copy: the output may be the input's own region
        pieces[ctx.rank] = np.frombuffer(raw, np.uint8)[starts[ctx.rank]:
                                                         starts[ctx.rank + 1]].copy()
    rows = exchanged_rows(ctx.args)
    nbytes = rows * row_bytes
    out = ctx.output(p, nbytes).view(np.uint8) if nbytes else np.empty(0, np.uint8)
    ordered = [pieces[i] for i in sorted(pieces)]
    if ctx.args.HasField("reduce") and ordered:
        _reduce(ctx, ordered, out)
    else:
        at = 0
        for piece in ordered:
            out[at:at + piece.nbytes] = piece
            at += piece.nbytes
    return OpResult(nbytes, (rows, *rest), sorted(pieces))


def _reduce(ctx: OpContext, pieces: list[np.ndarray], out: np.ndarray) -> None:
    """``out`` = the pieces combined by the op's ``reduce``, in rank order."""
    storage, dtype, op = dtypes.STORAGE[ctx.dtype], ctx.dtype, ctx.args.reduce
    acc = to_accum(pieces[0].view(storage), dtype)
    for piece in pieces[1:]:
        reduce_into(acc, to_accum(piece.view(storage), dtype), op)
    out.view(storage)[...] = from_accum(acc, dtype, len(pieces) if op == pb.AVERAGE else 1)


def _peers(ctx: OpContext) -> set[int]:
    send, recv = rows_of(ctx)
    return {r for r in range(ctx.size) if r != ctx.rank and (send[r] or recv[r])}


def _rows(ctx: OpContext) -> dict[int, int]:
    return {i: int(r) for i, r in enumerate(ctx.args.recv_rows)}


EXCHANGE_OPS: dict[int, OpSpec] = {
    pb.ALLTOALL: OpSpec(exchange, _peers, lambda _ctx: {0}, rows=_rows),
    pb.SENDRECV: OpSpec(exchange, _peers, lambda _ctx: {0}, rows=_rows),
}
