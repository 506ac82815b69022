"""The windows of one daemon (BlueFog's one-sided ops), served without the worker.

A window is a named tensor on every rank that creates it. Its daemon holds

* the *own copy*: the tensor as last created, put, accumulated, published or updated by the local
  worker, with the worker's step and its associated p (push-sum weight, 1 at creation); peers'
  ``win_get`` are answered from it at once;
* one *buffer* per rank that wrote into it (``win_put`` replaces it, ``win_accumulate`` adds to
  it, ``win_get`` fetches it), with a version (writes since ``win_update`` last read it), the
  writer's step and the p that came with the writes.

Everything a window holds is changed only on the daemon's event loop, one message at a time, so
no lock exists and none is held across a network round trip: a write from a peer is applied when
its last byte arrives and answered with ``WIN_REPLY`` (or an ABORT naming what was wrong), and
the requester's op completes when every target answered.

Ranks may create windows in any order. A write to a window this rank has not created yet is kept
(within ``memory.window_early_bytes``) and applied as if it came after ``win_create``: an
accumulate adds to the buffer's initial copy. A read (``win_get``, ``win_exchange``) of a window
not created yet waits for it, up to the op timeout. Freed windows refuse both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.numerics import weighted_sum
from decent_wire.v1 import decent_pb2 as pb
from decentd.concurrency import TaskSet
from decentd.keys import display_name, job_of, owner, part
from decentd.mailbox.arrivals import Arrival
from decentd.net.late_rounds import ONE_SIDED
from decentd.net.links import Links

log = logging.getLogger("decentd.windows")

#: message tags of a window exchange: the request, and the target's answer
REQUEST, REPLY = 0, 1
#: names of freed windows remembered (writes to them fail instead of creating a buffer)
FREED_MEMORY = 4096
#: the requests that read a window (they wait for one not created yet)
READS = frozenset({pb.WIN_GET, pb.WIN_EXCHANGE})
#: window requests that carry no tensor (its description names the window's)
EMPTY = frozenset({pb.WIN_GET, pb.GROUP_TRIGGER, pb.WIN_LOCK, pb.WIN_UNLOCK})
#: the most dimensions a window message's shape may have (numpy's)
MAX_DIMS = 64
#: peers' reads of windows not created here yet, kept at once
PARKED_MEMORY = 1024
#: buffers of windows not created here yet, whatever their bytes (empty ones too)
EARLY_BUFFERS = 1 << 14


def is_one_sided(part: pb.Part) -> bool:
    """Whether ``part`` is a window request this daemon serves by itself (not an op's data)."""
    return part.op in ONE_SIDED and part.tag == REQUEST


def check_part(part: pb.Part, size: int) -> None:
    """ValueError unless a window message (a request, or an answer: any other part passes)
    from a peer describes itself exactly: a worker's window, a known dtype, a shape, exactly
    that shape's bytes (none for a request without a tensor, none or all for an answer), a
    lock slot and a group size among the ``size`` ranks."""
    op = part.op
    if op not in ONE_SIDED and op != pb.WIN_REPLY:
        return
    if owner(part.name) is None:
        raise ValueError("a window message for no worker's window")
    dtype, shape = int(part.meta.dtype), part.meta.shape
    if dtype not in dtypes.STORAGE:
        raise ValueError(f"a window message of unknown dtype {dtype}")
    if len(shape) > MAX_DIMS or min(shape, default=0) < 0:
        raise ValueError(f"a window message of {len(shape)} dimensions, the least "
                         f"{min(shape, default=0)}")
    count = math.prod(shape)
    full = count * dtypes.itemsize(dtype)
    allowed = (0,) if op in EMPTY else (0, full) if op == pb.WIN_REPLY else (full,)
    if part.nbytes not in allowed:
        raise ValueError(f"a window message of {count} {dtypes.dtype_name(dtype)} elements in "
                         f"{part.nbytes} bytes")
    if op in (pb.WIN_LOCK, pb.WIN_UNLOCK) and part.step >= size:
        raise ValueError(f"a window lock of slot {part.step} among {size} ranks")
    group = part.weight  # a trigger's group size: a power of two, at most every rank
    if op == pb.GROUP_TRIGGER and not (group.is_integer() and 1 <= group <= size
                                       and (int(group) & (int(group) - 1)) == 0):
        raise ValueError(f"a group trigger for a group of {group} among {size} ranks")


@dataclass
class Window:
    """One window on this rank."""

    name: str  #: wire name (job-qualified)
    dtype: int
    shape: tuple[int, ...]
    own: np.ndarray | None = None  #: storage dtype, flat; None until the local worker creates it
    step: int = 0
    p: float = 1.0  #: the associated p of the own copy
    buffers: dict[int, np.ndarray] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    ps: dict[int, float] = field(default_factory=dict)  #: the associated p of each buffer
    #: writers whose buffer holds only accumulates made before win_create: the initial copy is
    #: added at creation
    without_base: set[int] = field(default_factory=set)
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

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return dtypes.nbytes(self.dtype, self.shape)

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


@dataclass(frozen=True)
class _Parked:
    """A peer's read of a window not created here yet."""

    src: int
    round: int
    arrival: Arrival  #: a copy: its bytes are the store's, not a pooled buffer's


class WindowStore:
    """Every window of this daemon, and the answers to peers' window messages."""

    def __init__(self, size: int, links: Links, timeout: float, early_limit: int) -> None:
        #: workers in the cluster (a window's key names the worker that owns it)
        self.size = size
        self._links = links
        self.timeout = timeout
        self.early_limit = early_limit
        self.windows: dict[str, Window] = {}
        self._freed: dict[str, None] = {}
        self._parked: dict[str, list[_Parked]] = {}
        self._tasks = TaskSet()

    # ------------------------------------------------------------------ local worker

    def local(self, name: str, display: str) -> Window:
        """A window the local worker created; NOT_FOUND otherwise."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            raise DecentError(pb.NOT_FOUND, f"window '{display}' does not exist on rank "
                                            f"{owner(name)} (call win_create first)")
        return w

    def create(self, name: str, dtype: int, shape: tuple[int, ...], x: np.ndarray,
               zero_init: bool, neighbors: list[int]) -> Window:
        """The local worker's ``win_create``: own copy = ``x``; buffers for ``neighbors`` start
        as a copy of ``x`` (or at zero), plus what peers wrote before; waiting reads are served."""
        w = self.windows.get(name)
        if w is not None and w.own is not None:
            raise DecentError(pb.INVALID_ARGUMENT, f"window '{w.display}' already exists on "
                                                   f"rank {owner(name)} (win_free it first)")
        if w is not None and (w.dtype, w.shape) != (dtype, shape):
            raise DecentError(pb.MISMATCH, f"window '{w.display}': rank {owner(name)} creates it "
                              f"as {dtypes.describe(dtype, shape)} but rank(s) "
                              f"{sorted(w.buffers)} already wrote {w.describe()} into it")
        if w is None:
            w = self.windows[name] = Window(name, dtype, shape)
        self._freed.pop(name, None)
        w.own, w.step, w.p = np.array(x, copy=True), 0, 1.0
        for j in neighbors:
            if j not in w.buffers:
                buf = w.buffer(j)
                if not zero_init:
                    buf[...] = x
            elif j in w.without_base and not zero_init:
                weighted_sum(w.buffers[j], w.buffers[j], 1.0, [(x, 1.0)], dtype)
        w.without_base.clear()
        for parked in self._parked.pop(name, []):
            self.on_message(parked.src, name, parked.round, parked.arrival)
        return w

    def free(self, name: str, display: str) -> None:
        """The local worker's ``win_free``."""
        self.local(name, display)
        del self.windows[name]
        self._freed[name] = None
        while len(self._freed) > FREED_MEMORY:
            self._freed.pop(next(iter(self._freed)))

    def info(self, name: str) -> pb.WindowInfo:
        """What the window holds here (``Worker.Window``)."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            return pb.WindowInfo(error=pb.Error(
                code=pb.NOT_FOUND, message=f"window '{display_name(name)}' does not exist on "
                                           f"rank {owner(name)}"))
        return pb.WindowInfo(meta=pb.TensorMeta(dtype=w.dtype, shape=w.shape), step=w.step,
                             versions=w.versions, steps=w.steps, served=w.served,
                             max_staleness=w.max_staleness, p=w.p)

    def staleness(self) -> dict[str, int]:
        """Each window's ``max_staleness`` here, by ``job/name@rank``."""
        return {f"{job_of(w.name)}/{w.display}@{owner(w.name)}": w.max_staleness
                for w in self.windows.values() if w.own is not None}

    @property
    def parked(self) -> int:
        """Peers' reads waiting for a window to be created here."""
        return sum(len(v) for v in self._parked.values())

    @property
    def early_bytes(self) -> int:
        """Bytes of buffers kept for windows not created here yet."""
        return sum(w.nbytes * len(w.buffers) for w in self.windows.values() if w.own is None)

    # ------------------------------------------------------------------ peers

    def admit(self, part: pb.Part) -> DecentError | None:
        """Why a window request announced by RTS may not be cleared to send: more bytes than
        its window holds, or than are kept for writes to a window not created here yet."""
        w = self.windows.get(part.name)
        if w is not None and w.own is not None:
            if part.nbytes <= w.nbytes:
                return None
            return DecentError(pb.MISMATCH, f"window '{w.display}': rank {part.src} sent "
                               f"{dtypes.describe(part.meta.dtype, part.meta.shape)} but rank "
                               f"{owner(w.name)} holds {w.describe()}")
        if part.nbytes <= self.early_limit:
            return None
        return DecentError(pb.RESOURCE_EXHAUSTED, f"rank {part.src} sends window "
                           f"'{display_name(part.name)}' {part.nbytes} bytes before rank "
                           f"{owner(part.name)} created it, past the {self.early_limit} bytes "
                           "kept for such writes (memory.window_early_bytes)")

    def peer_lost(self, gone: Callable[[int, str], bool]) -> None:
        """The ranks ``gone`` tells are unreachable: their parked reads are dropped."""
        for name, waiting in list(self._parked.items()):
            kept = [p for p in waiting if not gone(p.src, name)]
            if kept:
                self._parked[name] = kept
            else:
                del self._parked[name]

    def on_message(self, src: int, name: str, round_: int, arrival: Arrival) -> None:
        """A window request from ``src``: applied or answered now, without the worker (a read
        of a window not created yet waits for it)."""
        if arrival.op in READS and self._park(src, name, round_, arrival):
            return
        try:
            payload = self._apply(src, name, arrival)
        except DecentError as err:
            self._links.outbox.send_abort(src, [(name, round_)], err.to_pb())
            return
        finally:
            arrival.release()
        w = self.windows[name]
        data = memoryview(b"") if payload is None else payload.view(np.uint8).data
        reply = part(name, round_, REPLY, pb.WIN_REPLY, w.dtype, w.shape, len(data))
        reply.step = w.step
        self._tasks.spawn(self._reply(src, reply, data))

    def _park(self, src: int, name: str, round_: int, arrival: Arrival) -> bool:
        """Keep a read of a window not created here yet (True), until the op timeout."""
        w = self.windows.get(name)
        if (w is not None and w.own is not None) or name in self._freed:
            return False
        held = sum(p.arrival.data.nbytes for v in self._parked.values() for p in v)
        if self.parked >= PARKED_MEMORY or held + arrival.data.nbytes > self.early_limit:
            arrival.release()
            self._links.outbox.send_abort(src, [(name, round_)], pb.Error(
                code=pb.RESOURCE_EXHAUSTED, message=f"rank {src} reads window "
                f"'{display_name(name)}', which rank {owner(name)} has not created, past the "
                f"{PARKED_MEMORY} reads or {self.early_limit} bytes kept for such reads"))
            return True
        kept = dataclasses.replace(arrival, data=arrival.data.copy(), message=None)
        arrival.release()
        self._parked.setdefault(name, []).append(_Parked(src, round_, kept))
        self._tasks.spawn(self._expire(src, name, round_, kept))
        return True

    async def _expire(self, src: int, name: str, round_: int, kept: Arrival) -> None:
        await asyncio.sleep(self.timeout)
        waiting = self._parked.get(name, [])
        if any(p.arrival is kept for p in waiting):
            self._parked[name] = [p for p in waiting if p.arrival is not kept]
            err = DecentError(pb.NOT_FOUND, f"rank {src} reads window '{display_name(name)}', "
                              f"which rank {owner(name)} did not create within {self.timeout:g}s")
            self._links.outbox.send_abort(src, [(name, round_)], err.to_pb())

    async def _reply(self, dst: int, reply: pb.Part, data: memoryview) -> None:
        try:
            await self._links.outbox.send_parts(dst, [reply], [data])
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
        self._write(src, name, arrival)
        return None

    def _write(self, src: int, name: str, arrival: Arrival) -> None:
        """A put or accumulate into ``src``'s buffer (kept for win_create when the window does
        not exist here yet)."""
        if name in self._freed:
            raise DecentError(pb.NOT_FOUND, f"rank {src} writes window '{display_name(name)}', "
                                            f"which rank {owner(name)} has freed")
        target = self.windows.get(name)
        if target is None:  # not created here yet
            target = self.windows[name] = Window(name, arrival.dtype, arrival.shape)
        self._check(src, target, arrival, "wrote")
        if target.own is None and src not in target.buffers:
            self._reserve(src, name, target)
        x = arrival.data.view(dtypes.STORAGE[target.dtype])
        buf = target.buffer(src)
        if arrival.op == pb.WIN_PUT:
            weighted_sum(buf, x, arrival.weight, [], target.dtype)
            target.ps[src] = arrival.p
            target.without_base.discard(src)
        else:
            if target.own is None and target.versions[src] == 0:
                target.without_base.add(src)  # the initial copy is added at win_create
            weighted_sum(buf, buf, 1.0, [(x, arrival.weight)], target.dtype)
            target.ps[src] = target.ps.get(src, 0.0) + arrival.p
        target.wrote(src, arrival.step)

    def _reserve(self, src: int, name: str, w: Window) -> None:
        """Room for one more buffer of a window not created here yet (in bytes, and at most
        :data:`EARLY_BUFFERS` such buffers)."""
        buffers = sum(len(x.buffers) for x in self.windows.values() if x.own is None)
        if self.early_bytes + w.nbytes > self.early_limit or buffers >= EARLY_BUFFERS:
            if not w.buffers:
                del self.windows[name]
            raise DecentError(pb.RESOURCE_EXHAUSTED, f"rank {src} writes window "
                              f"'{w.display}' before rank {owner(name)} created it, past the "
                              f"{self.early_limit} bytes kept for such writes "
                              "(memory.window_early_bytes)")

    def _served(self, src: int, name: str, verb: str) -> tuple[Window, np.ndarray]:
        """A window created here that ``src`` reads, and its own copy."""
        w = self.windows.get(name)
        if w is None or w.own is None:
            raise DecentError(pb.NOT_FOUND, f"rank {src} {verb} window '{display_name(name)}', "
                                            f"which does not exist on rank {owner(name)}")
        return w, w.own

    def _check(self, src: int, w: Window, arrival: Arrival, verb: str) -> None:
        if (arrival.dtype, arrival.shape) != (w.dtype, w.shape):
            raise DecentError(pb.MISMATCH, f"window '{w.display}': rank {src} {verb} "
                              f"{dtypes.describe(arrival.dtype, arrival.shape)} but rank "
                              f"{owner(w.name)} holds {w.describe()}")
