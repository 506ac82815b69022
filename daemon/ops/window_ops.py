"""The worker's window ops (BlueFog's one-sided vocabulary, AD-PSGD, WAGMA, window mutexes) over
the daemon's window services (:mod:`decentd.windows`).

Local ops (create, publish, update, add, free) change this daemon's windows only. Put,
accumulate, get and exchange send one request per target and complete when every target's daemon
answered; the targets' workers take no part. Window ops have no participants to abort: a target
holds no op of ours (its daemon answered already, or the request never reached it).
"""

from __future__ import annotations

import numpy as np

from decent_wire import dtypes
from decent_wire.graphs import butterfly_group
from decent_wire.numerics import weighted_sum
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops.api import Arrival, DecentError, OpContext, OpResult, OpSpec, gather_all, part
from decentd.ops.faults import reachable, self_for_gone, unless_lost
from decentd.windows.groups import GroupSum, group_terms, late_call
from decentd.windows.store import REPLY, REQUEST, Window, WindowStore


def _store(ctx: OpContext) -> WindowStore:
    return ctx.services.windows


def _local(ctx: OpContext) -> tuple[Window, np.ndarray]:
    """The op's window (created here, holding the op's dtype and shape) and its own copy."""
    p = ctx.parts[0]
    w = _store(ctx).local(p.name, p.display)
    if (p.dtype, p.shape) != (w.dtype, w.shape):
        raise DecentError(pb.INVALID_ARGUMENT, f"window '{w.display}' holds {w.describe()} but "
                          f"the tensor is {dtypes.describe(p.dtype, p.shape)}")
    assert w.own is not None
    return w, w.own


def _answer(w: Window, j: int, a: Arrival, rank: int) -> np.ndarray:
    """Rank ``j``'s answer as the window's elements; MISMATCH unless it is exactly a tensor
    like the window's."""
    if (a.dtype, a.shape) != (w.dtype, w.shape) or a.data.nbytes != w.nbytes:
        raise DecentError(pb.MISMATCH, f"window '{w.display}': rank {j} holds "
                          f"{dtypes.describe(a.dtype, a.shape)} ({a.data.nbytes} bytes) but "
                          f"rank {rank} holds {w.describe()}")
    return a.data.view(dtypes.STORAGE[w.dtype])


def _echo(ctx: OpContext) -> OpResult:
    """The op's result is its input (put, accumulate, publish, create)."""
    p = ctx.parts[0]
    out = ctx.output(p, p.nbytes)
    if p.nbytes and not np.may_share_memory(out, p.x):
        out[...] = p.x
    return OpResult(p.nbytes, p.shape)


def _static_step(ctx: OpContext, what: str) -> tuple[float, dict[int, float], list[int]]:
    """The topology's self weight, in-weights and out-neighbors (windows use a static graph
    unless the call names its ranks)."""
    topo = ctx.topology
    if topo.dynamic:
        raise DecentError(pb.INVALID_ARGUMENT, f"window '{ctx.display}': topology {topo.kind!r} "
                          f"changes from step to step; pass {what} explicitly")
    s = topo.step(ctx.rank, 0)
    return s.self_weight, dict(s.src_weights), list(s.dst_ranks)


def _ranks(ctx: OpContext, field: pb.RankWeights, what: str) -> dict[int, float]:
    weights = {int(k): float(v) for k, v in field.weights.items()}
    ctx.check_ranks(list(weights), what)
    return weights


async def _exchange(ctx: OpContext, targets: dict[int, float], step: int,
                    payload: memoryview, p_own: float = 0.0) -> dict[int, Arrival]:
    """Send this op's request to every target and wait for every answer (a write carries the
    associated ``p_own`` times its weight)."""
    p = ctx.parts[0]
    targets = reachable(ctx, targets)
    futs = {j: ctx.expect(j, REPLY) for j in targets}

    async def ask(j: int, weight: float) -> None:
        request = part(p.name, p.round, REQUEST, ctx.op, p.dtype, p.shape, len(payload), weight)
        request.step = step
        request.p = p_own * weight
        await ctx.send_part(j, request, payload)

    async def answer(j: int) -> Arrival:
        await ask(j, targets[j])
        return await futs[j]

    ctx.waiting.update(targets)
    answers = await gather_all(*(unless_lost(ctx, j, answer(j)) for j in targets))
    ctx.waiting.difference_update(targets)
    return {j: a for j, a in zip(targets, answers, strict=True) if a is not None}


async def win_create(ctx: OpContext) -> OpResult:
    """``win_create``: local (buffers for the topology's in-neighbors when it is static)."""
    p = ctx.parts[0]
    assert isinstance(ctx.args, pb.WinCreate)
    topo = ctx.topology
    neighbors = [] if topo.dynamic else list(topo.step(ctx.rank, 0).src_weights)
    _store(ctx).create(p.name, p.dtype, p.shape, p.x, ctx.args.zero_init, neighbors)
    return _echo(ctx)


async def win_publish(ctx: OpContext) -> OpResult:
    """``win_publish``: the own copy becomes the tensor (what peers' gets are served)."""
    assert isinstance(ctx.args, pb.WinPublish)
    w, own = _local(ctx)
    own[...] = ctx.parts[0].x
    w.stamp(int(ctx.args.step))
    return _echo(ctx)


async def win_write(ctx: OpContext) -> OpResult:
    """``win_put`` / ``win_accumulate``: publish, then write into each destination's buffer
    (with its associated p); with ``self_weight``, the own copy and p are scaled after (the
    result is the scaled tensor)."""
    p = ctx.parts[0]
    args = ctx.args
    assert isinstance(args, pb.WinWrite)
    w, own = _local(ctx)
    if args.HasField("dst_weights"):
        dsts = _ranks(ctx, args.dst_weights, "dst_weights")
    else:
        dsts = {d: 1.0 for d in _static_step(ctx, "dst_weights")[2]}
    own[...] = p.x
    w.stamp(int(args.step))
    got = await _exchange(ctx, dsts, w.step, p.raw, w.p)
    for arrival in got.values():
        arrival.release()
    if not args.HasField("self_weight"):
        return _echo(ctx)
    weighted_sum(own, own, float(args.self_weight), [], w.dtype)
    w.p *= float(args.self_weight)
    ctx.output(p, p.nbytes)[...] = own
    return OpResult(p.nbytes, p.shape)


async def win_get(ctx: OpContext) -> OpResult:
    """``win_get``: buffer[j] = w_j * (j's own copy) for each source."""
    p = ctx.parts[0]
    args = ctx.args
    assert isinstance(args, pb.WinGet)
    w = _store(ctx).local(p.name, p.display)
    if args.HasField("src_weights"):
        srcs = _ranks(ctx, args.src_weights, "src_weights")
    else:
        srcs = {j: 1.0 for j in _static_step(ctx, "src_weights")[1]}
    got = await _exchange(ctx, srcs, w.step, memoryview(b""))
    for j, arrival in got.items():
        weighted_sum(w.buffer(j), _answer(w, j, arrival, ctx.rank), srcs[j], [], w.dtype)
        w.wrote(j, arrival.step)
        arrival.release()
    return OpResult(0, (0,))


def _update_weights(ctx: OpContext, w: Window) -> tuple[float, dict[int, float]]:
    """``win_update``'s self weight and buffer weights: given, else the static topology's."""
    args = ctx.args
    assert isinstance(args, pb.WinUpdate)
    given_self, given_src = args.HasField("self_weight"), args.HasField("src_weights")
    if given_self and given_src:
        self_weight, weights = float(args.self_weight), _ranks(ctx, args.src_weights,
                                                               "neighbor_weights")
    else:
        self_default, in_default, _ = _static_step(ctx, "self_weight and neighbor_weights")
        self_weight = float(args.self_weight) if given_self else self_default
        weights = _ranks(ctx, args.src_weights, "neighbor_weights") if given_src else in_default
    missing = sorted(j for j in weights if j not in w.buffers)
    if missing:
        raise DecentError(pb.INVALID_ARGUMENT, f"window '{w.display}' on rank {ctx.rank} has no "
                          f"buffer from rank(s) {missing}: they never wrote to it and are not "
                          "in-neighbors of the topology")
    return self_weight, weights


async def win_update(ctx: OpContext) -> OpResult:
    """``win_update``: ``self_w * x + sum_j w_j * buffer[j]`` (and the same of the associated
    p's); becomes the own copy unless ``clone``; the buffers read have version 0 again (and are
    zeroed with ``reset``)."""
    p = ctx.parts[0]
    args = ctx.args
    assert isinstance(args, pb.WinUpdate)
    w, own = _local(ctx)
    self_weight, weights = self_for_gone(ctx, *_update_weights(ctx, w))
    out = ctx.output(p, p.nbytes)
    weighted_sum(out, p.x, self_weight, [(w.buffers[j], wj) for j, wj in weights.items()],
                 p.dtype)
    w.p = self_weight * w.p + sum(wj * w.ps.get(j, 0.0) for j, wj in weights.items())
    if not args.clone:
        own[...] = out
        w.stamp(int(args.step))
    for j in weights:
        w.max_staleness = max(w.max_staleness, w.step - min(w.step, w.steps.get(j, 0)))
        w.versions[j] = 0
        if args.reset:
            w.buffers[j][...] = 0
            w.ps[j] = 0.0
    return OpResult(p.nbytes, p.shape)


async def win_exchange(ctx: OpContext) -> OpResult:
    """``win_exchange``: atomically average with one peer's own copy (AD-PSGD); the average is
    the result and this rank's own copy."""
    p = ctx.parts[0]
    args = ctx.args
    assert isinstance(args, pb.WinExchange)
    w, own = _local(ctx)
    j = int(args.peer)
    ctx.check_ranks([j], "peer")
    a = (await _exchange(ctx, {j: 0.5}, w.step, p.raw)).get(j)
    out = ctx.output(p, p.nbytes)
    if a is None:  # the peer is gone (reweight): nothing to average with
        out[...] = p.x
        own[...] = out
        return OpResult(p.nbytes, p.shape, [])
    out[...] = _answer(w, j, a, ctx.rank)
    a.release()
    own[...] = out
    w.versions[j] = w.versions.get(j, 0) + 1
    return OpResult(p.nbytes, p.shape, [j])


async def win_add(ctx: OpContext) -> OpResult:
    """``win_add``: own copy += tensor, atomically with peers' exchanges; the result is the
    new own copy."""
    p = ctx.parts[0]
    assert isinstance(ctx.args, pb.WinAdd)
    w, own = _local(ctx)
    weighted_sum(own, own, 1.0, [(p.x, 1.0)], p.dtype)
    w.stamp(int(ctx.args.step))
    ctx.output(p, p.nbytes)[...] = own
    return OpResult(p.nbytes, p.shape)


def _group(ctx: OpContext) -> tuple[int, int]:
    """(group size, group round) of a group_allreduce, checked."""
    args = ctx.args
    assert isinstance(args, pb.GroupAllreduce)
    s, n = int(args.group_size), ctx.size
    if s < 1 or s & (s - 1) or n & (n - 1) or s > n:
        raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{ctx.display}': group_allreduce needs "
                          "a power-of-two group_size <= size and a power-of-two size; got "
                          f"group_size {s}, size {n}")
    if args.group_round < 1:
        raise DecentError(pb.INVALID_ARGUMENT, f"tensor '{ctx.display}': group_round must be "
                                               ">= 1 (the client counts its calls from 1)")
    return s, int(args.group_round)


async def group_allreduce(ctx: OpContext) -> OpResult:
    """WAGMA's wait-avoiding group average over this round's butterfly group.

    The tensor becomes the window's own copy (published); if the group's sum for this round is
    here already (another member triggered it) it is used at once, otherwise the leader is
    triggered and the sum awaited. Members that had not arrived contributed their last own copy.
    """
    p = ctx.parts[0]
    w, own = _local(ctx)
    size, gr = _group(ctx)
    assert isinstance(ctx.args, pb.GroupAllreduce)
    terms = group_terms(p.dtype, p.shape, size, int(ctx.args.rule))
    own[...] = p.x
    w.step = gr
    group = butterfly_group(ctx.rank, ctx.size, size, gr)
    members = [m for m in group if m == ctx.rank or m in reachable(ctx, {m: 1.0})]
    out = ctx.output(p, p.nbytes)
    got = None if len(members) == 1 else await unless_lost(
        ctx, members[0], _group_sum(ctx, members[0], size, gr, terms))
    if got is None:  # alone (the others gone, or its leader lost meanwhile): its own copy
        out[...] = p.x
        return OpResult(p.nbytes, p.shape, [ctx.rank])
    total, staleness, count, decided = got
    if decided != terms:  # the round ran before this call reached its leader
        raise late_call(w.display, gr, members[0], decided, ctx.rank, terms)
    if total.dtype != dtypes.STORAGE[p.dtype] or total.nbytes != p.nbytes:
        raise DecentError(pb.MISMATCH, f"window '{w.display}': the group sum of round {gr} is "
                          f"{total.size} {total.dtype} elements, the window "
                          f"{dtypes.describe(p.dtype, p.shape)}")
    w.max_staleness = max(w.max_staleness, staleness)
    g = count
    if ctx.args.rule == pb.GROUP_WITH_SELF:
        # the input first: the output may be the input's own slot (written as it goes)
        weighted_sum(out, p.x, 1.0 / (g + 1), [(total, 1.0 / (g + 1))], p.dtype)
    else:
        weighted_sum(out, total, 1.0 / g, [], p.dtype)
    return OpResult(p.nbytes, p.shape)


async def _group_sum(ctx: OpContext, leader: int, size: int, gr: int, terms: str
                     ) -> GroupSum:
    """This round's group sum: here already, or led here, or asked of the leader."""
    p, groups = ctx.parts[0], ctx.services.groups
    key = (p.name, gr)
    got = groups.result(key)
    if got is not None:
        return got
    fut = groups.wait(key, leader)
    try:
        if leader == ctx.rank:
            groups.lead(p.name, gr, ctx.rank, size, p.dtype, p.shape, terms)
        else:
            trigger = part(p.name, gr, REQUEST, pb.GROUP_TRIGGER, p.dtype, p.shape, 0,
                           float(size))
            trigger.topology = terms
            await ctx.send_part(leader, trigger, memoryview(b""))
        ctx.waiting.add(leader)
        return await fut
    finally:
        groups.stop_waiting(key)


async def win_free(ctx: OpContext) -> OpResult:
    """``win_free``: local (its group rounds may start from 1 again)."""
    p = ctx.parts[0]
    _store(ctx).free(p.name, p.display)
    ctx.services.groups.forget(p.name)
    return OpResult(0, (0,))


def _lock_slots(ctx: OpContext) -> tuple[list[int], bool]:
    args = ctx.args
    assert isinstance(args, pb.WinLock)
    ranks = sorted({int(r) for r in args.ranks})  # in rank order: no two lockers deadlock
    ctx.check_ranks(ranks, "ranks")
    return ranks, bool(args.for_self)


async def _remote_lock(ctx: OpContext, op: int, r: int) -> None:
    """Ask rank ``r``'s daemon for (or to release) this rank's slot of the window."""
    p = ctx.parts[0]
    fut = ctx.expect(r, REPLY)
    request = part(p.name, p.round, REQUEST, op, pb.FLOAT32, (0,), 0)
    request.step = ctx.rank
    ctx.waiting.add(r)
    await ctx.send_part(r, request, memoryview(b""))
    (await fut).release()
    ctx.waiting.discard(r)


async def win_lock(ctx: OpContext) -> OpResult:
    """``win_mutex`` enter: this rank's slot of the window at each of ``ranks`` (``for_self``:
    this rank's own slots of ``ranks``), one at a time in rank order; on failure what was taken
    is given back."""
    p = ctx.parts[0]
    ranks, for_self = _lock_slots(ctx)
    locks, holder = ctx.services.locks, (ctx.rank, p.name)
    taken: list[int] = []
    try:
        for r in ranks:
            taken.append(r)
            if for_self:
                await locks.acquire_local(p.name, r, holder)
            else:
                await _remote_lock(ctx, pb.WIN_LOCK, r)
    except BaseException:
        for r in taken:
            if for_self:
                locks.release(p.name, r, holder)
            else:  # still in line or granted meanwhile: give it back
                unlock = part(p.name, p.round, REQUEST, pb.WIN_UNLOCK, pb.FLOAT32, (0,), 0)
                unlock.step = ctx.rank
                ctx.services.links.outbox.send_nowait(r, [unlock])
        raise
    return OpResult(0, (0,))


async def win_unlock(ctx: OpContext) -> OpResult:
    """``win_mutex`` exit: the slots :func:`win_lock` took are released."""
    p = ctx.parts[0]
    ranks, for_self = _lock_slots(ctx)
    for r in ranks:
        if for_self:
            ctx.services.locks.release(p.name, r, (ctx.rank, p.name))
        else:
            await _remote_lock(ctx, pb.WIN_UNLOCK, r)
    return OpResult(0, (0,))


def _no_peers(_ctx: OpContext) -> set[int]:
    """Window ops abort nobody: an ABORT would hit a target's own op of the same key."""
    return set()


def _replies(_ctx: OpContext) -> set[int]:
    return {REPLY}


WINDOW_OPS: dict[int, OpSpec] = {
    pb.WIN_CREATE: OpSpec(win_create, _no_peers),
    pb.WIN_PUBLISH: OpSpec(win_publish, _no_peers),
    pb.WIN_PUT: OpSpec(win_write, _no_peers, _replies),
    pb.WIN_ACCUMULATE: OpSpec(win_write, _no_peers, _replies),
    pb.WIN_GET: OpSpec(win_get, _no_peers, _replies),
    pb.WIN_UPDATE: OpSpec(win_update, _no_peers),
    pb.WIN_FREE: OpSpec(win_free, _no_peers),
    pb.WIN_EXCHANGE: OpSpec(win_exchange, _no_peers, _replies),
    pb.WIN_ADD: OpSpec(win_add, _no_peers),
    pb.GROUP_ALLREDUCE: OpSpec(group_allreduce, _no_peers),
    pb.WIN_LOCK: OpSpec(win_lock, _no_peers, _replies),
    pb.WIN_UNLOCK: OpSpec(win_unlock, _no_peers, _replies),
}
