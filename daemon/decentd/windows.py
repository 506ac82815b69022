"""One-sided window ops (BlueFog's vocabulary), served by the daemon without its worker.

A window is a named tensor on every rank that creates it. Its daemon holds

* the *own copy*: the tensor as last created, put, accumulated, published or updated by the local
  worker, with the worker's step; peers' ``win_get`` are answered from it at once;
* one *buffer* per rank that wrote into it (``win_put`` replaces it, ``win_accumulate`` adds to
  it, ``win_get`` fetches it), with a version (writes since ``win_update`` last read it) and the
  writer's step.

Everything a window holds is changed only on the daemon's event loop, one message at a time, so
no lock exists and none is held across a network round trip: a write from a peer is applied when
its last byte arrives and answered with ``WIN_REPLY`` (or an ABORT naming what was wrong), and
the requester's op completes when every target answered. A write to a window this rank has not
created yet is kept (the buffer exists from then on, and ``win_create`` adopts it when dtype and
shape agree), so workers may create windows in any order.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from decentd import dtypes
from decentd.engine import OpContext, OpResult, OpSpec
from decentd.errors import OpError
from decentd.ops import _check_ranks, _out, gather_all, weighted_sum
from decentd.topology import butterfly_group
from decentd.transport import Arrival, display_name, part
from decentd.wire import pb

if TYPE_CHECKING:
    from decentd.transport import Transport

log = logging.getLogger("decentd.windows")

#: message tags of a window exchange: the request, and the target's answer
REQUEST, REPLY = 0, 1
#: names of freed windows remembered (writes to them fail instead of creating a buffer)
FREED_MEMORY = 4096
#: group rounds remembered (results not yet collected, rounds a leader ran)
GROUP_MEMORY = 4096
#: rounds of the leader's own reads of its members' copies: far above any worker's round
FETCH_BASE = 1 << 62


@dataclass
class Window:
    """One window on this rank."""

    name: str  # wire name (job-qualified)
    dtype: int
    shape: tuple[int, ...]
    own: np.ndarray | None = None  # storage dtype, flat; None until the local worker creates it
    step: int = 0
    buffers: dict[int, np.ndarray] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    served: int = 0
    max_staleness: int = 0

    @property
    def display(self) -> str:
        """The user's name of the window."""
        return display_name(self.name)

    @property
    def size(self) -> int:
        """Elements of the tensor."""
        return int(np.prod(self.shape, dtype=np.int64))

    def describe(self) -> str:
        """``float32[4, 2]``."""
        return dtypes.describe(self.dtype, self.shape)

    def buffer(self, src: int) -> np.ndarray:
        """The buffer for ``src`` (created at zero on its first write)."""
        buf = self.buffers.get(src)
        if buf is None:
            buf = self.buffers[src] = np.zeros(self.size, dtypes.STORAGE[self.dtype])
            self.versions.setdefault(src, 0)
            self.steps.setdefault(src, 0)
        return buf

    def stamp(self, step: int) -> None:
        """The own copy changed: at ``step``, or one step on when no step was given (0)."""
        self.step = step if step > 0 else self.step + 1


class Windows:
    """Every window of this daemon, and the answers to peers' window messages."""

    def __init__(self, rank: int, size: int, transport: Transport, timeout: float) -> None:
        self.rank = rank
        self.size = size
        self.transport = transport
        self.timeout = timeout
        self.windows: dict[str, Window] = {}
        self.freed: dict[str, None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: group sums that came before their member asked: (name, round) -> (sum, staleness)
        self.group_results: collections.OrderedDict[tuple[str, int], tuple[np.ndarray, int]] = (
            collections.OrderedDict())
        self.group_waiters: dict[tuple[str, int], asyncio.Future[tuple[np.ndarray, int]]] = {}
        self._led: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        #: group rounds whose leader failed, for members that have not asked yet
        self.group_failures: collections.OrderedDict[tuple[str, int], OpError] = (
            collections.OrderedDict())
        self._fetches = itertools.count(1)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ local worker

    def local(self, name: str, display: str) -> Window:
        """A window the local worker created; NOT_FOUND otherwise."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            raise OpError(pb.NOT_FOUND, f"window '{display}' does not exist on rank {self.rank} "
                                        "(call win_create first)")
        return w

    def create(self, name: str, dtype: int, shape: tuple[int, ...], x: np.ndarray,
               zero_init: bool, neighbors: list[int]) -> Window:
        """The local worker's ``win_create``: own copy = ``x``; buffers for ``neighbors`` start
        as a copy of ``x`` (or at zero), next to those peers already wrote."""
        w = self.windows.get(name)
        if w is not None and w.own is not None:
            raise OpError(pb.INVALID_ARGUMENT, f"window '{w.display}' already exists on rank "
                                               f"{self.rank} (win_free it first)")
        if w is not None and (w.dtype, w.shape) != (dtype, shape):
            writers = sorted(w.buffers)
            raise OpError(pb.MISMATCH, f"window '{w.display}': rank {self.rank} creates it as "
                          f"{dtypes.describe(dtype, shape)} but rank(s) {writers} already wrote "
                          f"{w.describe()} into it")
        if w is None:
            w = self.windows[name] = Window(name, dtype, shape)
        self.freed.pop(name, None)
        w.own = np.array(x, copy=True)
        w.step = 0
        for j in neighbors:
            if j not in w.buffers:
                buf = w.buffer(j)
                if not zero_init:
                    buf[...] = x
        return w

    def free(self, name: str, display: str) -> None:
        """The local worker's ``win_free``."""
        self.local(name, display)
        del self.windows[name]
        self._forget_groups(name)
        self.freed[name] = None
        while len(self.freed) > FREED_MEMORY:
            self.freed.pop(next(iter(self.freed)))

    def _forget_groups(self, name: str) -> None:
        """A window is freed: its group rounds may start from 1 again."""
        for table in (self._led, self.group_results, self.group_failures):
            for key in [k for k in table if k[0] == name]:
                del table[key]

    def info(self, name: str) -> pb.WindowInfo:
        """What the window holds here (``Worker.Window``)."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            return pb.WindowInfo(error=pb.Error(
                code=pb.NOT_FOUND, message=f"window '{display_name(name)}' does not exist on "
                                           f"rank {self.rank}"))
        return pb.WindowInfo(meta=pb.TensorMeta(dtype=w.dtype, shape=w.shape), step=w.step,
                             versions=w.versions, steps=w.steps, served=w.served,
                             max_staleness=w.max_staleness)

    # ------------------------------------------------------------------ peers

    def on_message(self, src: int, name: str, round_: int, arrival: Arrival) -> None:
        """A window message from ``src``: applied or answered now, without the worker."""
        if arrival.op == pb.GROUP_TRIGGER:
            self.transport.release(arrival)
            self.lead(name, round_, int(arrival.weight), arrival.dtype, arrival.shape)
            return
        if arrival.op == pb.GROUP_RESULT:
            total = arrival.data.view(dtypes.STORAGE[arrival.dtype]).copy()
            self.transport.release(arrival)
            self.group_arrived(name, round_, total, arrival.step)
            return
        try:
            payload = self._apply(src, name, arrival)
        except OpError as err:
            self.transport.send_abort(src, [(name, round_)], err.to_pb())
            return
        finally:
            self.transport.release(arrival)
        w = self.windows[name]
        data = memoryview(b"") if payload is None else payload.view(np.uint8).data
        reply = part(name, round_, REPLY, pb.WIN_REPLY, w.dtype, w.shape, len(data))
        reply.step = w.step
        self._spawn(self._reply(src, reply, data))

    async def _reply(self, dst: int, reply: pb.Part, data: memoryview) -> None:
        try:
            await self.transport.send_parts(dst, [reply], [data])
        except Exception as exc:  # the requester is gone: its op fails there by itself
            log.info("window reply to rank %d not sent: %s", dst, exc)

    def _apply(self, src: int, name: str, arrival: Arrival) -> np.ndarray | None:
        display = display_name(name)
        w = self.windows.get(name)
        if arrival.op == pb.WIN_GET:
            if w is None or w.own is None:
                raise OpError(pb.NOT_FOUND, f"rank {src} reads window '{display}', which does "
                                            f"not exist on rank {self.rank}")
            w.served += 1
            return w.own.copy()  # a snapshot: the next local write must not tear what is sent
        if arrival.op == pb.WIN_EXCHANGE:
            if w is None or w.own is None:
                raise OpError(pb.NOT_FOUND, f"rank {src} averages with window '{display}', "
                                            f"which does not exist on rank {self.rank}")
            if (arrival.dtype, arrival.shape) != (w.dtype, w.shape):
                raise OpError(pb.MISMATCH, f"window '{display}': rank {src} sent "
                              f"{dtypes.describe(arrival.dtype, arrival.shape)} but rank "
                              f"{self.rank} holds {w.describe()}")
            # both halves weigh 1/2: (own + x) * 0.5, the same bits on both sides
            weighted_sum(w.own, w.own, 0.5, [(arrival.data.view(dtypes.STORAGE[w.dtype]), 0.5)],
                         w.dtype)
            w.versions[src] = w.versions.get(src, 0) + 1
            w.steps[src] = arrival.step
            return w.own.copy()
        if name in self.freed:
            raise OpError(pb.NOT_FOUND, f"rank {src} writes window '{display}', which rank "
                                        f"{self.rank} has freed")
        if w is None:  # not created here yet: keep the write for win_create to adopt
            w = self.windows[name] = Window(name, arrival.dtype, arrival.shape)
        if (arrival.dtype, arrival.shape) != (w.dtype, w.shape):
            raise OpError(pb.MISMATCH, f"window '{display}': rank {src} wrote "
                          f"{dtypes.describe(arrival.dtype, arrival.shape)} but rank "
                          f"{self.rank} holds {w.describe()}")
        x = arrival.data.view(dtypes.STORAGE[w.dtype])
        buf = w.buffer(src)
        if arrival.op == pb.WIN_PUT:
            weighted_sum(buf, x, arrival.weight, [], w.dtype)
        else:
            weighted_sum(buf, buf, 1.0, [(x, arrival.weight)], w.dtype)
        w.versions[src] = w.versions.get(src, 0) + 1
        w.steps[src] = arrival.step
        return None


    # ------------------------------------------------------------------ WAGMA groups

    def lead(self, name: str, round_: int, group_size: int, dtype: int,
             shape: tuple[int, ...]) -> None:
        """A member of this rank's group at ``round_`` arrived: sum the group once."""
        key = (name, round_)
        if key in self._led:
            return
        self._led[key] = None
        while len(self._led) > GROUP_MEMORY:
            self._led.popitem(last=False)
        self._spawn(self._sum_group(name, round_, group_size, dtype, shape))

    async def _sum_group(self, name: str, round_: int, group_size: int, dtype: int,
                         shape: tuple[int, ...]) -> None:
        members = butterfly_group(self.rank, self.size, group_size, round_)
        fetch = FETCH_BASE + next(self._fetches)
        others = [m for m in members if m != self.rank]
        try:
            w = self.windows.get(name)
            if w is None or w.own is None:
                raise OpError(pb.NOT_FOUND, f"window '{display_name(name)}' does not exist on "
                                            f"rank {self.rank}, the leader of group {members}")
            if (w.dtype, w.shape) != (dtype, shape):
                raise OpError(pb.MISMATCH, f"window '{w.display}': a member of group {members} "
                              f"has {dtypes.describe(dtype, shape)}, its leader rank "
                              f"{self.rank} {w.describe()}")
            copies = {self.rank: (w.own.copy(), w.step)}
            futs = {m: self.transport.expect(m, name, fetch, REPLY) for m in others}
            ask = part(name, fetch, REQUEST, pb.WIN_GET, dtype, shape, 0)
            await asyncio.wait_for(gather_all(
                *(self.transport.send_parts(m, [ask], [memoryview(b"")]) for m in others)),
                self.timeout)
            for m, fut in futs.items():
                a = await asyncio.wait_for(fut, self.timeout)
                if (a.dtype, a.shape) != (dtype, shape):
                    raise OpError(pb.MISMATCH, f"window '{w.display}': rank {m} holds "
                                  f"{dtypes.describe(a.dtype, a.shape)}, its group leader rank "
                                  f"{self.rank} {w.describe()}")
                copies[m] = (a.data.view(dtypes.STORAGE[dtype]).copy(), a.step)
                self.transport.release(a)
            ordered = [copies[m][0] for m in members]
            total = np.empty_like(ordered[0])
            weighted_sum(total, ordered[0], 1.0, [(c, 1.0) for c in ordered[1:]], dtype)
            staleness = max(round_ - min(round_, step) for _, step in copies.values())
            result = part(name, round_, REQUEST, pb.GROUP_RESULT, dtype, shape, total.nbytes)
            result.step = staleness
            payload = total.view(np.uint8).data
            self.group_arrived(name, round_, total, staleness)
            await gather_all(*(self.transport.send_parts(m, [result], [payload])
                               for m in others))
        except (OpError, TimeoutError, ConnectionError) as exc:
            err = exc if isinstance(exc, OpError) else OpError(
                pb.TIMEOUT if isinstance(exc, (TimeoutError, asyncio.TimeoutError))
                else pb.PEER_UNAVAILABLE,
                f"group of window '{display_name(name)}' round {round_} (leader rank "
                f"{self.rank}, members {members}): {exc!r}")
            log.warning("%s", err)
            for m in others:
                self.transport.send_abort(m, [(name, round_)], err.to_pb(), pb.GROUP_RESULT)
            self.group_failed(name, round_, err.to_pb())
        finally:
            self.transport.close_ops([(name, fetch)])

    def group_failed(self, name: str, round_: int, error: pb.Error) -> None:
        """The leader could not sum group round ``round_``: its members' ops fail with why."""
        err = OpError(error.code or pb.ABORTED, error.message)
        waiter = self.group_waiters.pop((name, round_), None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(err)
            return
        self.group_failures[(name, round_)] = err
        while len(self.group_failures) > GROUP_MEMORY:
            self.group_failures.popitem(last=False)

    def group_arrived(self, name: str, round_: int, total: np.ndarray, staleness: int) -> None:
        """The group sum of ``round_``: to the member's waiting op, or kept until it asks."""
        fut = self.group_waiters.pop((name, round_), None)
        if fut is not None and not fut.done():
            fut.set_result((total, staleness))
            return
        self.group_results[(name, round_)] = (total, staleness)
        while len(self.group_results) > GROUP_MEMORY:
            self.group_results.popitem(last=False)


# ---------------------------------------------------------------------- the worker's ops


def _windows(ctx: OpContext) -> Windows:
    windows = ctx.engine.windows
    if windows is None:  # pragma: no cover - the server always installs them
        raise OpError(pb.INTERNAL, "this daemon has no window service")
    return windows


def _check_tensor(ctx: OpContext, w: Window) -> None:
    p = ctx.parts[0]
    if (p.dtype, p.shape) != (w.dtype, w.shape):
        raise OpError(pb.INVALID_ARGUMENT, f"window '{w.display}' holds {w.describe()} but the "
                      f"tensor is {dtypes.describe(p.dtype, p.shape)}")


def _echo(ctx: OpContext) -> OpResult:
    """The op's result is its input (put, accumulate, publish, create)."""
    p = ctx.parts[0]
    out = _out(ctx, p, p.nbytes)
    if p.nbytes and not np.may_share_memory(out, p.x):
        out[...] = p.x
    return OpResult(p.nbytes, p.shape)


def _static_step(ctx: OpContext, what: str) -> tuple[float, dict[int, float], list[int]]:
    """The topology's self weight, in-weights and out-neighbors (windows use a static graph
    unless the call names its ranks)."""
    topo = ctx.engine.topology
    if topo.dynamic:
        raise OpError(pb.INVALID_ARGUMENT, f"window '{ctx.display}': topology {topo.kind!r} "
                      f"changes from step to step; pass {what} explicitly")
    s = topo.step(ctx.rank, 0)
    return s.self_weight, dict(s.src_weights), list(s.dst_ranks)


def _ranks(ctx: OpContext, weights: dict[int, float], what: str) -> dict[int, float]:
    _check_ranks(ctx, list(weights), what)
    return weights


async def _exchange(ctx: OpContext, targets: dict[int, float], step: int,
                    payload: memoryview) -> dict[int, Arrival]:
    """Send this op's request to every target and wait for every answer."""
    p = ctx.parts[0]
    futs = {j: ctx.transport.expect(j, p.name, p.round, REPLY) for j in targets}

    async def ask(j: int, weight: float) -> None:
        request = part(p.name, p.round, REQUEST, ctx.op, p.dtype, p.shape, len(payload), weight)
        request.step = step
        await ctx.transport.send_parts(j, [request], [payload])

    ctx.waiting.update(targets)
    await gather_all(*(ask(j, w) for j, w in targets.items()))
    got: dict[int, Arrival] = {}
    for j, fut in futs.items():
        got[j] = await fut
        ctx.waiting.discard(j)
    return got


async def win_create(ctx: OpContext) -> OpResult:
    """``win_create``: local (buffers for the topology's in-neighbors when it is static)."""
    p = ctx.parts[0]
    topo = ctx.engine.topology
    neighbors = [] if topo.dynamic else list(topo.step(ctx.rank, 0).src_weights)
    _windows(ctx).create(p.name, p.dtype, p.shape, p.x, ctx.req.zero_init, neighbors)
    return _echo(ctx)


async def win_publish(ctx: OpContext) -> OpResult:
    """``win_publish``: the own copy becomes the tensor (what peers' gets are served)."""
    p = ctx.parts[0]
    w = _windows(ctx).local(p.name, p.display)
    _check_tensor(ctx, w)
    assert w.own is not None
    w.own[...] = p.x
    w.stamp(int(ctx.req.step))
    return _echo(ctx)


async def win_write(ctx: OpContext) -> OpResult:
    """``win_put`` / ``win_accumulate``: publish, then write into each destination's buffer."""
    p = ctx.parts[0]
    w = _windows(ctx).local(p.name, p.display)
    _check_tensor(ctx, w)
    if ctx.req.has_dst_weights:
        dsts = _ranks(ctx, dict(ctx.req.dst_weights), "dst_weights")
    else:
        dsts = {d: 1.0 for d in _static_step(ctx, "dst_weights")[2]}
    assert w.own is not None
    w.own[...] = p.x
    w.stamp(int(ctx.req.step))
    got = await _exchange(ctx, dsts, w.step, p.raw)
    for arrival in got.values():
        ctx.release(arrival)
    return _echo(ctx)


async def win_get(ctx: OpContext) -> OpResult:
    """``win_get``: buffer[j] = w_j * (j's own copy) for each source."""
    p = ctx.parts[0]
    w = _windows(ctx).local(p.name, p.display)
    if ctx.req.has_src_weights:
        srcs = _ranks(ctx, dict(ctx.req.src_weights), "src_weights")
    else:
        srcs = {j: 1.0 for j in _static_step(ctx, "src_weights")[1]}
    got = await _exchange(ctx, srcs, w.step, memoryview(b""))
    for j, arrival in got.items():
        if (arrival.dtype, arrival.shape) != (w.dtype, w.shape):
            raise OpError(pb.MISMATCH, f"window '{w.display}': rank {j} holds "
                          f"{dtypes.describe(arrival.dtype, arrival.shape)} but rank {ctx.rank} "
                          f"holds {w.describe()}")
        weighted_sum(w.buffer(j), arrival.data.view(dtypes.STORAGE[w.dtype]), srcs[j], [],
                     w.dtype)
        w.versions[j] = w.versions.get(j, 0) + 1
        w.steps[j] = arrival.step
        ctx.release(arrival)
    return OpResult(0, (0,))


async def win_update(ctx: OpContext) -> OpResult:
    """``win_update``: ``self_w * x + sum_j w_j * buffer[j]``; becomes the own copy; the buffers
    read have version 0 again (and are zeroed with ``reset``)."""
    p = ctx.parts[0]
    w = _windows(ctx).local(p.name, p.display)
    _check_tensor(ctx, w)
    req = ctx.req
    if req.has_self_weight and req.has_src_weights:
        self_weight, weights = float(req.self_weight), dict(req.src_weights)
    else:
        self_default, in_default, _ = _static_step(ctx, "self_weight and neighbor_weights")
        self_weight = float(req.self_weight) if req.has_self_weight else self_default
        weights = dict(req.src_weights) if req.has_src_weights else in_default
    _ranks(ctx, weights, "neighbor_weights")
    missing = sorted(j for j in weights if j not in w.buffers)
    if missing:
        raise OpError(pb.INVALID_ARGUMENT, f"window '{w.display}' on rank {ctx.rank} has no "
                      f"buffer from rank(s) {missing}: they never wrote to it and are not "
                      "in-neighbors of the topology")
    out = _out(ctx, p, p.nbytes)
    weighted_sum(out, p.x, self_weight, [(w.buffers[j], wj) for j, wj in weights.items()],
                 p.dtype)
    assert w.own is not None
    w.own[...] = out
    w.stamp(int(req.step))
    for j in weights:
        w.max_staleness = max(w.max_staleness, w.step - min(w.step, w.steps.get(j, 0)))
        w.versions[j] = 0
        if req.reset:
            w.buffers[j][...] = 0
    return OpResult(p.nbytes, p.shape)


async def win_exchange(ctx: OpContext) -> OpResult:
    """``win_exchange``: atomically average with one peer's own copy (AD-PSGD); the average is
    the result and this rank's own copy."""
    p = ctx.parts[0]
    w = _windows(ctx).local(p.name, p.display)
    _check_tensor(ctx, w)
    peers = _ranks(ctx, dict(ctx.req.dst_weights), "dst_weights")
    if len(peers) != 1:
        raise OpError(pb.INVALID_ARGUMENT, f"window '{w.display}': win_exchange averages with "
                      f"exactly one peer, got {sorted(peers)}")
    (j,) = peers
    got = await _exchange(ctx, {j: 0.5}, w.step, p.raw)
    a = got[j]
    if (a.dtype, a.shape) != (w.dtype, w.shape):  # pragma: no cover - the peer checked it
        raise OpError(pb.MISMATCH, f"window '{w.display}': rank {j} answered "
                      f"{dtypes.describe(a.dtype, a.shape)}")
    out = _out(ctx, p, p.nbytes)
    out[...] = a.data.view(dtypes.STORAGE[w.dtype])
    ctx.release(a)
    assert w.own is not None
    w.own[...] = out
    w.versions[j] = w.versions.get(j, 0) + 1
    return OpResult(p.nbytes, p.shape)


async def win_add(ctx: OpContext) -> OpResult:
    """``win_add``: own copy += tensor, atomically with peers' exchanges; the result is the
    new own copy."""
    p = ctx.parts[0]
    w = _windows(ctx).local(p.name, p.display)
    _check_tensor(ctx, w)
    assert w.own is not None
    weighted_sum(w.own, w.own, 1.0, [(p.x, 1.0)], p.dtype)
    w.stamp(int(ctx.req.step))
    out = _out(ctx, p, p.nbytes)
    out[...] = w.own
    return OpResult(p.nbytes, p.shape)


def _group_size(ctx: OpContext) -> int:
    s, n = int(ctx.req.group_size), ctx.size
    if s < 1 or s & (s - 1) or n & (n - 1) or s > n:
        raise OpError(pb.INVALID_ARGUMENT, f"tensor '{ctx.display}': group_allreduce needs a "
                      f"power-of-two group_size <= size and a power-of-two size; got group_size "
                      f"{s}, size {n}")
    return s


async def group_allreduce(ctx: OpContext) -> OpResult:
    """WAGMA's wait-avoiding group average over this round's butterfly group.

    The tensor becomes the window's own copy (published); if the group's sum for this round is
    here already (another member triggered it) it is used at once, otherwise the leader is
    triggered and the sum awaited. Members that had not arrived contributed their last own copy.
    """
    p = ctx.parts[0]
    windows = _windows(ctx)
    w = windows.local(p.name, p.display)
    _check_tensor(ctx, w)
    size = _group_size(ctx)
    gr = int(ctx.req.group_round)
    if gr < 1:
        raise OpError(pb.INVALID_ARGUMENT, f"tensor '{p.display}': group_round must be >= 1 "
                                           "(the client counts its calls from 1)")
    assert w.own is not None
    w.own[...] = p.x
    w.step = gr
    members = butterfly_group(ctx.rank, ctx.size, size, gr)
    out = _out(ctx, p, p.nbytes)
    if len(members) == 1:
        out[...] = p.x
        return OpResult(p.nbytes, p.shape)
    key = (p.name, gr)
    failed = windows.group_failures.pop(key, None)
    if failed is not None:
        raise failed
    got = windows.group_results.pop(key, None)
    if got is None:
        fut: asyncio.Future[tuple[np.ndarray, int]] = asyncio.get_running_loop().create_future()
        windows.group_waiters[key] = fut
        leader = members[0]
        try:
            if leader == ctx.rank:
                windows.lead(p.name, gr, size, p.dtype, p.shape)
            else:
                trigger = part(p.name, gr, REQUEST, pb.GROUP_TRIGGER, p.dtype, p.shape, 0,
                               float(size))
                await ctx.transport.send_parts(leader, [trigger], [memoryview(b"")])
            ctx.waiting.add(leader)
            got = await fut
        finally:
            windows.group_waiters.pop(key, None)
    total, staleness = got
    w.max_staleness = max(w.max_staleness, staleness)
    g = len(members)
    if ctx.req.group_rule == pb.GROUP_WITH_SELF:
        # the input first: the output may be the input's own slot (written as it goes)
        weighted_sum(out, p.x, 1.0 / (g + 1), [(total, 1.0 / (g + 1))], p.dtype)
    else:
        weighted_sum(out, total, 1.0 / g, [], p.dtype)
    return OpResult(p.nbytes, p.shape)


async def win_free(ctx: OpContext) -> OpResult:
    """``win_free``: local."""
    p = ctx.parts[0]
    _windows(ctx).free(p.name, p.display)
    return OpResult(0, (0,))


def _no_peers(_ctx: OpContext) -> set[int]:
    """Window ops have no participants to abort: a target holds no op of ours (its daemon
    answered already, or the request never reached it), and an ABORT would hit its own op of
    the same (name, round)."""
    return set()


#: the window ops of the engine (added to decentd.ops.OPS by the server)
WINDOW_OPS: dict[int, OpSpec] = {
    pb.WIN_CREATE: OpSpec(win_create, _no_peers),
    pb.WIN_PUBLISH: OpSpec(win_publish, _no_peers),
    pb.WIN_PUT: OpSpec(win_write, _no_peers, lambda _ctx: {REPLY}),
    pb.WIN_ACCUMULATE: OpSpec(win_write, _no_peers, lambda _ctx: {REPLY}),
    pb.WIN_GET: OpSpec(win_get, _no_peers, lambda _ctx: {REPLY}),
    pb.WIN_UPDATE: OpSpec(win_update, _no_peers),
    pb.WIN_FREE: OpSpec(win_free, _no_peers),
    pb.WIN_EXCHANGE: OpSpec(win_exchange, _no_peers, lambda _ctx: {REPLY}),
    pb.WIN_ADD: OpSpec(win_add, _no_peers),
    pb.GROUP_ALLREDUCE: OpSpec(group_allreduce, _no_peers),
}
