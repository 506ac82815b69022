"""The windows of one daemon (BlueFog's one-sided ops), served without the worker.

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

The worker's own window ops (:mod:`decentd.ops.windows`) use the store through its methods; peers'
requests come from :mod:`decentd.receiver`, which hands every one-sided part here
(:func:`is_one_sided`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.graphs import butterfly_group
from decent_wire.v1 import decent_pb2 as pb
from decentd.links import Links, part
from decentd.mailbox import Arrival, Mailbox
from decentd.names import display_name
from decentd.numerics import weighted_sum
from decentd.tasks import TaskSet, gather_all

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

    def wrote(self, src: int, step: int) -> None:
        """``src`` wrote (or averaged with) this window at its ``step``."""
        self.versions[src] = self.versions.get(src, 0) + 1
        self.steps[src] = step


#: window requests that arrive without a local op to match them
ONE_SIDED = frozenset({pb.WIN_PUT, pb.WIN_ACCUMULATE, pb.WIN_GET, pb.WIN_EXCHANGE,
                       pb.GROUP_TRIGGER, pb.GROUP_RESULT})

#: a group round: (window wire name, the member's k-th call)
GroupKey = tuple[str, int]
#: a group sum and the most steps a member's copy in it lagged the round
GroupSum = tuple[np.ndarray, int]


def is_one_sided(part: pb.Part) -> bool:
    """Whether ``part`` is a window request this daemon serves by itself (not an op's data)."""
    return part.op in ONE_SIDED and part.tag == REQUEST


def _bounded(table: collections.OrderedDict[GroupKey, Any], limit: int) -> None:
    while len(table) > limit:
        table.popitem(last=False)


class WindowStore:
    """Every window of this daemon, and the answers to peers' window messages."""

    def __init__(self, rank: int, size: int, links: Links, mailbox: Mailbox,
                 timeout: float) -> None:
        self.rank = rank
        self.size = size
        self._links = links
        self._mailbox = mailbox
        self.timeout = timeout
        self.windows: dict[str, Window] = {}
        self._freed: dict[str, None] = {}
        self._tasks = TaskSet()
        #: group sums that came before their member asked
        self._group_results: collections.OrderedDict[GroupKey, GroupSum] = (
            collections.OrderedDict())
        self._group_waiters: dict[GroupKey, asyncio.Future[GroupSum]] = {}
        self._led: collections.OrderedDict[GroupKey, None] = collections.OrderedDict()
        #: group rounds whose leader failed, for members that have not asked yet
        self._group_failures: collections.OrderedDict[GroupKey, DecentError] = (
            collections.OrderedDict())
        self._fetches = itertools.count(1)

    # ------------------------------------------------------------------ local worker

    def local(self, name: str, display: str) -> Window:
        """A window the local worker created; NOT_FOUND otherwise."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            raise DecentError(pb.NOT_FOUND, f"window '{display}' does not exist on rank "
                                            f"{self.rank} (call win_create first)")
        return w

    def create(self, name: str, dtype: int, shape: tuple[int, ...], x: np.ndarray,
               zero_init: bool, neighbors: list[int]) -> Window:
        """The local worker's ``win_create``: own copy = ``x``; buffers for ``neighbors`` start
        as a copy of ``x`` (or at zero), next to those peers already wrote."""
        w = self.windows.get(name)
        if w is not None and w.own is not None:
            raise DecentError(pb.INVALID_ARGUMENT, f"window '{w.display}' already exists on "
                                                   f"rank {self.rank} (win_free it first)")
        if w is not None and (w.dtype, w.shape) != (dtype, shape):
            raise DecentError(pb.MISMATCH, f"window '{w.display}': rank {self.rank} creates it "
                              f"as {dtypes.describe(dtype, shape)} but rank(s) "
                              f"{sorted(w.buffers)} already wrote {w.describe()} into it")
        if w is None:
            w = self.windows[name] = Window(name, dtype, shape)
        self._freed.pop(name, None)
        w.own = np.array(x, copy=True)
        w.step = 0
        for j in neighbors:
            if j not in w.buffers:
                buf = w.buffer(j)
                if not zero_init:
                    buf[...] = x
        return w

    def free(self, name: str, display: str) -> None:
        """The local worker's ``win_free``: its group rounds may start from 1 again."""
        self.local(name, display)
        del self.windows[name]
        for table in (self._led, self._group_results, self._group_failures):
            for key in [k for k in table if k[0] == name]:
                del table[key]
        self._freed[name] = None
        while len(self._freed) > FREED_MEMORY:
            self._freed.pop(next(iter(self._freed)))

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
            arrival.release()
            self.lead(name, round_, int(arrival.weight), arrival.dtype, arrival.shape)
            return
        if arrival.op == pb.GROUP_RESULT:
            total = arrival.data.view(dtypes.STORAGE[arrival.dtype]).copy()
            arrival.release()
            self._group_arrived((name, round_), (total, arrival.step))
            return
        try:
            payload = self._apply(src, name, arrival)
        except DecentError as err:
            self._links.send_abort(src, [(name, round_)], err.to_pb())
            return
        finally:
            arrival.release()
        w = self.windows[name]
        data = memoryview(b"") if payload is None else payload.view(np.uint8).data
        reply = part(name, round_, REPLY, pb.WIN_REPLY, w.dtype, w.shape, len(data))
        reply.step = w.step
        self._tasks.spawn(self._reply(src, reply, data))

    async def _reply(self, dst: int, reply: pb.Part, data: memoryview) -> None:
        try:
            await self._links.send_parts(dst, [reply], [data])
        except Exception as exc:  # the requester is gone: its op fails there by itself
            log.info("window reply to rank %d not sent: %s", dst, exc)

    def _apply(self, src: int, name: str, arrival: Arrival) -> np.ndarray | None:
        """Apply a request; the snapshot to answer with (None: an empty answer)."""
        if arrival.op == pb.WIN_GET:
            w, own = self._served(src, name, "reads")
            w.served += 1
            return own.copy()  # a snapshot: the next local write must not tear what is sent
        if arrival.op == pb.WIN_EXCHANGE:
            w, own = self._served(src, name, "averages with")
            self._check(src, w, arrival, "sent")
            # both halves weigh 1/2: (own + x) * 0.5, the same bits on both sides
            weighted_sum(own, own, 0.5, [(arrival.data.view(dtypes.STORAGE[w.dtype]), 0.5)],
                         w.dtype)
            w.wrote(src, arrival.step)
            return own.copy()
        if name in self._freed:
            raise DecentError(pb.NOT_FOUND, f"rank {src} writes window '{display_name(name)}', "
                                            f"which rank {self.rank} has freed")
        # not created here yet: keep the write for win_create to adopt
        target = self.windows.setdefault(name, Window(name, arrival.dtype, arrival.shape))
        self._check(src, target, arrival, "wrote")
        x = arrival.data.view(dtypes.STORAGE[target.dtype])
        buf = target.buffer(src)
        if arrival.op == pb.WIN_PUT:
            weighted_sum(buf, x, arrival.weight, [], target.dtype)
        else:
            weighted_sum(buf, buf, 1.0, [(x, arrival.weight)], target.dtype)
        target.wrote(src, arrival.step)
        return None

    def _served(self, src: int, name: str, verb: str) -> tuple[Window, np.ndarray]:
        """A window created here that ``src`` reads, and its own copy."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            raise DecentError(pb.NOT_FOUND, f"rank {src} {verb} window '{display_name(name)}', "
                                            f"which does not exist on rank {self.rank}")
        return w, w.own

    def _check(self, src: int, w: Window, arrival: Arrival, verb: str) -> None:
        if (arrival.dtype, arrival.shape) != (w.dtype, w.shape):
            raise DecentError(pb.MISMATCH, f"window '{w.display}': rank {src} {verb} "
                              f"{dtypes.describe(arrival.dtype, arrival.shape)} but rank "
                              f"{self.rank} holds {w.describe()}")

    # ------------------------------------------------------------------ WAGMA groups

    def lead(self, name: str, round_: int, group_size: int, dtype: int,
             shape: tuple[int, ...]) -> None:
        """A member of this rank's group at ``round_`` arrived: sum the group once."""
        key = (name, round_)
        if key in self._led:
            return
        self._led[key] = None
        _bounded(self._led, GROUP_MEMORY)
        self._tasks.spawn(self._sum_group(name, round_, group_size, dtype, shape))

    async def _sum_group(self, name: str, round_: int, group_size: int, dtype: int,
                         shape: tuple[int, ...]) -> None:
        members = butterfly_group(self.rank, self.size, group_size, round_)
        others = [m for m in members if m != self.rank]
        fetch = FETCH_BASE + next(self._fetches)
        try:
            total, staleness = await self._group_sum(name, round_, fetch, members, dtype, shape)
            result = part(name, round_, REQUEST, pb.GROUP_RESULT, dtype, shape, total.nbytes)
            result.step = staleness
            self._group_arrived((name, round_), (total, staleness))
            await gather_all(*(self._links.send_parts(m, [result], [total.view(np.uint8).data])
                               for m in others))
        except (DecentError, TimeoutError, ConnectionError) as exc:
            err = exc if isinstance(exc, DecentError) else DecentError(
                pb.TIMEOUT if isinstance(exc, TimeoutError) else pb.PEER_UNAVAILABLE,
                f"group of window '{display_name(name)}' round {round_} (leader rank "
                f"{self.rank}, members {members}): {exc!r}")
            log.warning("%s", err)
            for m in others:
                self._links.send_abort(m, [(name, round_)], err.to_pb(), pb.GROUP_RESULT)
            self.group_failed(name, round_, err.to_pb())
        finally:
            self._mailbox.close([(name, fetch)])

    async def _group_sum(self, name: str, round_: int, fetch: int, members: list[int],
                         dtype: int, shape: tuple[int, ...]) -> GroupSum:
        """Every member's copy as its daemon holds it, summed in rank order."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            raise DecentError(pb.NOT_FOUND, f"window '{display_name(name)}' does not exist on "
                                            f"rank {self.rank}, the leader of group {members}")
        if (w.dtype, w.shape) != (dtype, shape):
            raise DecentError(pb.MISMATCH, f"window '{w.display}': a member of group {members} "
                              f"has {dtypes.describe(dtype, shape)}, its leader rank "
                              f"{self.rank} {w.describe()}")
        others = [m for m in members if m != self.rank]
        copies = {self.rank: (w.own.copy(), w.step)}
        futs = {m: self._mailbox.expect(m, name, fetch, REPLY) for m in others}
        ask = part(name, fetch, REQUEST, pb.WIN_GET, dtype, shape, 0)
        await asyncio.wait_for(gather_all(
            *(self._links.send_parts(m, [ask], [memoryview(b"")]) for m in others)),
            self.timeout)
        for m, fut in futs.items():
            a = await asyncio.wait_for(fut, self.timeout)
            if (a.dtype, a.shape) != (dtype, shape):
                raise DecentError(pb.MISMATCH, f"window '{w.display}': rank {m} holds "
                                  f"{dtypes.describe(a.dtype, a.shape)}, its group leader "
                                  f"rank {self.rank} {w.describe()}")
            copies[m] = (a.data.view(dtypes.STORAGE[dtype]).copy(), a.step)
            a.release()
        ordered = [copies[m][0] for m in members]
        total = np.empty_like(ordered[0])
        weighted_sum(total, ordered[0], 1.0, [(c, 1.0) for c in ordered[1:]], dtype)
        return total, max(round_ - min(round_, step) for _, step in copies.values())

    def group_failed(self, name: str, round_: int, error: pb.Error) -> None:
        """The leader could not sum group round ``round_``: its members' ops fail with why."""
        err = DecentError(error.code or pb.ABORTED, error.message)
        waiter = self._group_waiters.pop((name, round_), None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(err)
            return
        self._group_failures[(name, round_)] = err
        _bounded(self._group_failures, GROUP_MEMORY)

    def _group_arrived(self, key: GroupKey, result: GroupSum) -> None:
        """The group sum of a round: to the member's waiting op, or kept until it asks."""
        fut = self._group_waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(result)
            return
        self._group_results[key] = result
        _bounded(self._group_results, GROUP_MEMORY)

    def group_result(self, key: GroupKey) -> GroupSum | None:
        """The group sum of a round if it is here already (its failure raises)."""
        failed = self._group_failures.pop(key, None)
        if failed is not None:
            raise failed
        return self._group_results.pop(key, None)

    def await_group(self, key: GroupKey) -> asyncio.Future[GroupSum]:
        """A future for the group sum of a round that is not here yet."""
        fut: asyncio.Future[GroupSum] = asyncio.get_running_loop().create_future()
        self._group_waiters[key] = fut
        return fut

    def stop_waiting(self, key: GroupKey) -> None:
        """The member's op ended: a sum that comes later is kept for nobody."""
        self._group_waiters.pop(key, None)
