"""Turning op calls into requests: arena slots, rounds, fusion, and reading results back.

A request: place the tensor (in an arena slot, or memory the daemon maps already), give it its
name's next round, send a small ``SubmitRequest`` without waiting; the caller gets a ``Handle``.
Small requests may go together (fusion). Completions wake the handles (reader thread);
``Handle.wait()`` takes the result (over its slot, or copied out) and frees what it does not keep.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import numpy as np

from decent.core.memory.arena import ClientArena
from decent.core.memory.codec import TensorCodec
from decent.core.memory.registrar import Registrar
from decent.core.memory.results import ResultMemory
from decent.core.memory.spill import SpillMemory
from decent.core.requests.calls import OpCall
from decent.core.requests.combine import combine_into, combining, whole_elements
from decent.core.requests.fusion import Fusion
from decent.core.requests.handles import FREED, Handle, Latch, Pending, State
from decent.core.requests.placement import Placer
from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.ops import Result, result_nbytes
from decent_wire.v1 import decent_pb2 as pb

T = TypeVar("T")
#: blocks until a request's latch is set or the timeout passed (the connection's
#: ``await_event``, which reads the completions on the waiting thread); whether it is set
AwaitEvent = Callable[[Latch, float | None], bool]

@dataclass(frozen=True)
class Queued:
    """A request waiting in a fusion bucket."""

    call: OpCall
    tensor: pb.TensorRef
    timeout: float
    pending: Pending
    #: when the op was called and when its tensor was placed and queued (``time.monotonic_ns``,
    #: for the daemon's timeline)
    stamps: tuple[int, int] = (0, 0)


class Submitter(Generic[T]):
    """Requests of one client: their slots, rounds and completions. Thread-safe."""

    def __init__(self, codec: TensorCodec[T], arena: ClientArena, registrar: Registrar,
                 send: Callable[[pb.SubmitRequest], None], fusion_threshold: int,
                 cycle_time: float, arena_wait: float = 60.0,
                 await_event: AwaitEvent | None = None) -> None:
        """``arena_wait`` (the daemon's default op timeout): how long, beyond its own
        timeout, a request waits for room in a full arena before it fails (ARENA_ERROR).
        ``await_event``: how a caller waits for a request (the connection's, which reads the
        completions on the waiting thread); None: on the request's latch."""
        self.codec = codec
        self.arena_wait = arena_wait
        self.arena = arena
        self.registrar = registrar
        self.spill = SpillMemory(registrar)
        self.results = ResultMemory[T](arena, self.spill, self.free_shared)
        #: where each request's input and result go (the placement layer)
        self.placer = Placer(codec, arena, registrar, self.spill, self._reclaim)
        self._send_request = send
        self._await_event = await_event
        # reentrant: a Handle finalizer (which takes it) may run during GC while it is held
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._rounds: dict[str, int] = {}
        self._in_flight: dict[int, list[Pending]] = {}
        self._unread: dict[int, Pending] = {}  #: DONE: result still in the arena
        self._fusion: Fusion[Queued] = Fusion(fusion_threshold, cycle_time, self._send_bucket)
        self.closed = False
        self.lost: DecentError | None = None
        #: the highest membership epoch a completion carried (a change: ranks came or went)
        self.view_epoch = 0
        #: seconds callers spent blocked in ``wait()``/``join()`` on unfinished ops
        self.blocked_seconds = 0.0

    # ------------------------------------------------------------------ submission

    def submit(self, call: OpCall, tensor: T | None, name: str | None, timeout: float | None,
               into: T | None = None, fuse: bool = False, fuse_limit: int | None = None,
               sources: int = 1, rows: list[int] | None = None) -> Handle[T]:
        """Place ``tensor``, spend the next round of ``name`` and send (or bucket) the request.
        ``into``: an in-place op's target; the result's size follows the op's table entry
        (``sources`` stacked inputs, or ``rows`` rows in all: ``decent_wire.ops.result_nbytes``);
        ``fuse``: the request may wait in a bucket of compatible ones (at most ``fuse_limit``
        bytes)."""
        called = time.monotonic_ns()
        self.check_open()
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        name = name or f"{call.field}.unnamed"
        dtype, shape = self.describe(tensor, name)
        nbytes = dtypes.nbytes(dtype, shape)
        out = nbytes if call.op.result is Result.NONE else \
            result_nbytes(call.op.result, dtype, shape, sources, rows)  # none: the input's
        fused = fuse and self._fusion.enabled
        # the ops holding the arena end within their timeouts: wait that long, and this one's
        place = self.placer.place(call, tensor, into, name, nbytes, out, not fused,
                                  self.arena_wait + (timeout or 0.0))
        # from here on nothing can fail before the request is sent: the round is spent only now,
        # so a refused argument above does not put this name's rounds out of step with the peers
        round_ = self.next_round(name)
        ref = pb.TensorRef(name=name, round=round_, meta=pb.TensorMeta(dtype=dtype, shape=shape),
                           offset=place.offset, nbytes=nbytes, out_offset=place.out_offset,
                           out_capacity=place.out_capacity, blank=place.blank)
        self.results.unchanged += into is not None and call.result_is_input and \
            not place.resident
        p = Pending(next(self._ids), (call.field, name, round_), place.slots, dtype,
                    shape, nbytes, place.out_offset, tensor, into, place.delivery)
        stamps = (called, time.monotonic_ns())
        if place.source is not None:
            with p.lock:  # from before the request: what it is told waits for the copy in
                self._send(call, [ref], timeout or 0.0, [p], [stamps], filling=True)
                if p.state is State.SENT:  # else it could not be sent: its slot is free already
                    self.placer.stream_in(place.source, place.offset, nbytes,
                                          partial(self._filled, p.request_id))
        elif fused:
            p.state = State.QUEUED
            key = (call.field, call.args.SerializeToString(deterministic=True), round_, timeout)
            self._fusion.add(key, Queued(call, ref, timeout or 0.0, p, stamps), nbytes,
                             fuse_limit)
        else:
            self._send(call, [ref], timeout or 0.0, [p], [stamps])
        return Handle(self, p)

    def check_open(self) -> None:
        """DecentError once the client is closed or the daemon is gone."""
        if self.closed:
            raise DecentError(pb.SHUTTING_DOWN, "client is closed")
        if self.lost is not None:
            raise self.lost

    def describe(self, tensor: T | None, name: str) -> tuple[int, tuple[int, ...]]:
        """(wire dtype, shape) of ``tensor`` (an op without one: an empty float32)."""
        if tensor is None:
            return pb.FLOAT32, (0,)
        try:
            return self.codec.describe(tensor)
        except TypeError as exc:
            raise TypeError(f"tensor '{name}': {exc}") from None

    def next_round(self, name: str) -> int:
        """The round the next call of ``name`` gets (and count it)."""
        with self._lock:
            r = self._rounds.get(name, 0)
            self._rounds[name] = r + 1
            return r

    def round_of(self, name: str) -> int:
        """The round the next call of ``name`` will get."""
        with self._lock:
            return self._rounds.get(name, 0)

    def _drain(self, p: Pending, upto: int, combine: pb.Combine | None = None) -> int:
        """Copy ``p``'s result out into its sink up to byte ``upto``, or with ``combine``
        combine the in-neighbor's tensor that far into it (caller holds ``p.lock``); the bytes
        done now."""
        upto, done, sink = whole_elements(min(upto, p.nbytes), p.dtype), p.drained, \
            p.delivery.sink
        if upto > done:
            src = np.frombuffer(self.placer.view(p.out_offset, p.nbytes), np.uint8)
            if combine is None:
                ctypes.memmove(sink + done, src.ctypes.data + done, upto - done)
            else:
                combine_into(sink, src, p.dtype, done, upto, combine)
            p.drained = upto
        return max(0, upto - done)

    def _filled(self, request_id: int, nbytes: int) -> bool:
        """Tell the daemon the first ``nbytes`` of a streamed input are in (False once the
        channel is gone: the request fails with it)."""
        try:
            self._send_request(pb.SubmitRequest(request_id=request_id,
                                                fill=pb.Fill(bytes=nbytes)))
        except DecentError:
            return False
        return True

    def _send(self, call: OpCall, tensors: list[pb.TensorRef], timeout: float,
              members: list[Pending], stamps: list[tuple[int, int]],
              filling: bool = False) -> None:
        """Send one request of ``tensors`` (``stamps``: call and queueing times; ``filling``:
        its one tensor is copied in after it, :meth:`Placer.stream_in`)."""
        req = pb.SubmitRequest(request_id=members[0].request_id if len(members) == 1
                               else next(self._ids), tensors=tensors, timeout_s=timeout,
                               queued_ns=[q for q, _ in stamps], fused_ns=[f for _, f in stamps],
                               filling=filling,
                               draining=len(members) == 1 and members[0].delivery.sink > 0,
                               combining=len(members) == 1 and members[0].delivery.combining)
        getattr(req, call.field).CopyFrom(call.args)
        with self._lock:
            self._in_flight[req.request_id] = members
        for p in members:
            p.state = State.SENT
        req.sent_ns = time.monotonic_ns()
        try:
            self._send_request(req)
        except DecentError as error:
            with self._lock:
                self._in_flight.pop(req.request_id, None)
            for p in members:
                self._settle(p, None, error)

    def _send_bucket(self, members: list[Queued]) -> None:
        """Send a closed fusion bucket: one request whose tensors are the members'."""
        if len(members) > 1:
            for m in members:
                m.pending.own_shape = True
        first = members[0]
        self._send(first.call, [m.tensor for m in members], first.timeout,
                   [m.pending for m in members], [m.stamps for m in members])

    def flush(self) -> None:
        """Send every request still waiting in a fusion bucket now."""
        self._fusion.flush()

    def fused(self) -> AbstractContextManager[None]:
        """See :meth:`decent.core.Client.fused`."""
        return self._fusion.held()

    # ------------------------------------------------------------------ completions

    def finish(self, completion: pb.Completion) -> None:
        """A completion arrived (on the connection's reader thread)."""
        if completion.partial:
            self._partial(completion)
            return
        with self._lock:
            members = self._in_flight.pop(completion.request_id, None)
        if members is None:
            return
        self.view_epoch = max(self.view_epoch, int(completion.view_epoch))
        error = None if completion.error.code == pb.OK else DecentError.from_pb(completion.error)
        for p in members:
            self._settle(p, completion, error)

    def _partial(self, completion: pb.Completion) -> None:
        """Part of a draining request's result is final: copy it out now."""
        with self._lock:
            members = self._in_flight.get(completion.request_id)
        if members is None or len(members) != 1 or not members[0].delivery.sink:
            return
        p = members[0]
        with p.lock:
            if p.state is State.SENT:
                self.results.drained_early += self._drain(
                    p, int(completion.final_bytes), combining(completion))

    def connection_lost(self, error: DecentError) -> None:
        """The data channel ended: every request still in flight fails with ``error``."""
        with self._lock:
            self.lost = error
            members = [p for group in self._in_flight.values() for p in group]
            self._in_flight.clear()
        for p in members:
            self._settle(p, None, error)

    def _settle(self, p: Pending, completion: pb.Completion | None,
                error: DecentError | None) -> None:
        with p.lock:
            p.completion, p.error = completion, error
            if error is not None:
                self._free(p, State.FAILED)
            elif p.state is State.ABANDONED:
                self._free(p, State.RELEASED)
            else:
                p.state = State.DONE
                with self._lock:
                    self._unread[p.request_id] = p
        p.event.set()
        with p.lock:
            callbacks, p.done_callbacks = p.done_callbacks, []
        for fn in callbacks:
            fn()
        self.arena.notify()

    def abandon(self, p: Pending) -> None:
        """``p``'s handle is gone: its slots are freed once it finished."""
        with p.lock:
            if p.state in (State.QUEUED, State.SENT):
                p.state = State.ABANDONED
            elif p.state is State.DONE:
                self._free(p, State.RELEASED)

    def await_done(self, p: Pending, timeout: float | None) -> bool:
        """Block until ``p`` finished (at most ``timeout`` s); whether it did."""
        if self._await_event is None:
            return p.event.wait(timeout)
        return self._await_event(p.event, timeout)

    def blocked(self, seconds: float) -> None:
        """Add ``seconds`` a caller was blocked on an unfinished op to :attr:`blocked_seconds`."""
        with self._lock:
            self.blocked_seconds += seconds

    def collect(self, p: Pending) -> None:
        """Read ``p``'s result out of the arena (once) and free its slots."""
        with p.lock:
            if p.state is not State.DONE:
                return
            if self.closed:  # the arena may be gone
                p.error = DecentError(pb.SHUTTING_DOWN, f"{p.label}: the client was closed "
                                                        "before its result was read")
                self._free(p, State.FAILED)
                return
            p.result = self._read(p)
            self._free(p, State.READ, after_read=True)

    def _read(self, p: Pending) -> Any:
        if p.delivery.resident:
            return p.into
        nbytes, shape = p.result_layout()
        into = p.into
        if into is not None and p.delivery.sink:
            combine = combining(p.completion)
            self._drain(p, nbytes, combine)
            self.results.combined += combine is not None
            return into
        if into is not None:
            taken = self._adopted(p, nbytes, lambda owner: self.codec.take(owner, into))
            return taken if taken is not None else \
                self.codec.read_into(self.placer.view(p.out_offset, nbytes), into)
        result = self._adopted(p, nbytes, lambda o: self.codec.result(o, p.dtype, shape, p.like))
        if result is not None:
            return result
        self.results.copied += 1
        return self.codec.read(self.placer.view(p.out_offset, nbytes), p.dtype, shape, p.like)

    def _adopted(self, p: Pending, nbytes: int, make: Callable[[np.ndarray], T | None]) -> Any:
        """``p``'s result as ``make`` builds it over its own slot (which it then owns), or None."""
        slot = next((s for s in p.slots if s[0] == p.out_offset), None)
        if not nbytes or slot is None:
            return None
        result = self.results.adopt(slot, nbytes, make)
        if result is not None:
            p.slots.remove(slot)
        return result

    def _free(self, p: Pending, state: State, after_read: bool = False) -> None:
        """Move ``p`` to a state whose slots are free (caller holds ``p.lock``); ``after_read``:
        once the codec's copy of the result out of them is done (a device copy may still run)."""
        assert state in FREED
        p.state = state
        p.like = None
        with self._lock:
            self._unread.pop(p.request_id, None)
        slots, p.slots = p.slots, []
        if not slots or self.closed:
            return
        if after_read:
            self.codec.release_after_read(lambda: self._free_slots(slots))
        else:
            self._free_slots(slots)

    def _free_slots(self, slots: list[tuple[int, int]]) -> None:
        if not self.closed:
            for off, n in slots:
                self.placer.free_slot(off, n)

    def _reclaim(self) -> bool:
        """Arena full: read finished-but-unread results out to free their slots."""
        if self.lost is not None:
            raise self.lost
        with self._lock:
            unread = list(self._unread.values())
        for p in unread:
            self.collect(p)
        return bool(unread)

    # ------------------------------------------------------------------ shared tensors

    def shared(self, tensor: T) -> T:
        """A copy of ``tensor`` in the arena, freed when the last tensor using it is gone."""
        dtype, shape = self.codec.describe(tensor)
        nbytes = dtypes.nbytes(dtype, shape)
        return self._shared_at(self.arena.alloc(nbytes, "shared tensor", self._reclaim),
                               tensor, dtype, shape)

    def shared_if_room(self, tensor: T) -> T | None:
        """:meth:`shared`, or None when that would leave less than half of the arena free
        (the room requests need; nothing waits)."""
        dtype, shape = self.codec.describe(tensor)
        nbytes = dtypes.nbytes(dtype, shape)
        if self.arena.free_bytes - nbytes < self.arena.nbytes // 2:
            return None
        offset = self.arena.try_alloc(nbytes)
        return None if offset is None else self._shared_at(offset, tensor, dtype, shape)

    def _shared_at(self, offset: int, tensor: T, dtype: int, shape: tuple[int, ...]) -> T:
        """``tensor`` copied to arena ``offset``, as a tensor that owns the slot."""
        nbytes = dtypes.nbytes(dtype, shape)
        owner = np.frombuffer(self.arena.buf, np.uint8, count=nbytes, offset=offset)
        # the slot lives as long as the buffer the tensor wraps
        weakref.finalize(owner, self.free_shared, offset, nbytes)
        out = self.codec.wrap(owner, dtype, shape, tensor)
        if nbytes:
            self.codec.write(tensor, self.arena.view(offset, nbytes))
        return out

    def free_shared(self, offset: int, nbytes: int) -> None:
        """A shared tensor's buffer is gone: its slot is free."""
        if not self.closed:
            self.arena.free(offset, nbytes)

    def close(self) -> None:
        """Send what waits in buckets, then refuse new requests (the arena is unmapped by the
        client after this)."""
        self._fusion.close()
        self.closed = True
        self.spill.close()

