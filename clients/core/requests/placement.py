"""The client's placement layer: where a request's input goes and how its result comes back.

One decision per request, made here and nowhere else (:meth:`Placer.place`):

- the input: already in the arena or registered with the daemon (``resident``: no copy),
  copied into a slot before the request, streamed in after it (a large private tensor the op
  sends while it is copied, ``source``), or left out (a call that never reads it, ``blank``);
- the result: written in place into memory the daemon maps (nothing to do), the input itself
  (``unchanged``), a tensor over the slot the daemon wrote, copied into the caller's tensor at
  the end, copied out as it becomes final (``sink``), or combined by this worker from its lone
  in-neighbor's tensor, which lands in a second slot (``combining``).

The submitter sends what the placement says; the daemon's own placement layer
(:mod:`decentd.engine.placement`) turns the request back into an input and a result sink.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from decent.core.memory.arena import ClientArena
from decent.core.memory.codec import TensorCodec
from decent.core.memory.registrar import Registrar
from decent.core.memory.spill import SpillMemory
from decent.core.requests.calls import OpCall

T = TypeVar("T")

#: a private tensor this large is copied in after its request, in chunks of STREAM_CHUNK bytes,
#: each sent by the daemon as soon as it is in (smaller ones: one copy, then the request); an
#: in-place result this large is copied out as it becomes final
STREAM_MIN_BYTES = 8 << 20
STREAM_CHUNK = 2 << 20

#: copies an input into its slot (the memoryview) chunk by chunk, yielding the bytes in so far
Source = Callable[[memoryview], Iterator[int]]


def host_source(source: np.ndarray) -> Source:
    """A host tensor's bytes, copied in :data:`STREAM_CHUNK` memmoves (they release the GIL)."""

    def copy(dst: memoryview) -> Iterator[int]:
        to = np.frombuffer(dst, np.uint8).ctypes.data
        frm, nbytes = source.ctypes.data, len(dst)
        for lo in range(0, nbytes, STREAM_CHUNK):
            n = min(STREAM_CHUNK, nbytes - lo)
            ctypes.memmove(to + lo, frm + lo, n)
            yield lo + n
    return copy


@dataclass(frozen=True)
class Delivery:
    """How a request's result reaches its caller."""

    #: in place on memory the daemon wrote, or the input unchanged: nothing to copy
    resident: bool = False
    #: in place into host memory at this address, copied out as the result becomes final
    #: (0: read at the end)
    sink: int = 0
    #: the output slot takes the lone in-neighbor's tensor, which this worker combines with
    #: its own into ``sink`` (:mod:`decent.core.requests.combine`)
    combining: bool = False


@dataclass(frozen=True)
class Placement:
    """Where a request's input and result lie (arena or registered offsets), and how each
    gets there."""

    slots: list[tuple[int, int]]  #: arena memory the request holds: (offset, bytes)
    offset: int
    out_offset: int
    out_capacity: int
    delivery: Delivery = field(default_factory=Delivery)
    #: in place on memory the daemon writes directly (the arena or registered memory)
    resident: bool = False
    #: the input, streamed into its slot after the request is sent (host bytes copied, or a
    #: device tensor staged, chunk by chunk)
    source: Source | None = None
    #: the op never reads the input: it is not copied in (TensorRef.blank)
    blank: bool = False


class Placer(Generic[T]):
    """Places requests in the arena (or memory of their own when it is full)."""

    def __init__(self, codec: TensorCodec[T], arena: ClientArena, registrar: Registrar,
                 spill: SpillMemory, reclaim: Callable[[], bool]) -> None:
        """``reclaim``: reads finished results out of a full arena (True when it freed
        something)."""
        self.codec = codec
        self.arena = arena
        self.registrar = registrar
        self.spill = spill
        self._reclaim = reclaim

    def place(self, call: OpCall, tensor: T | None, into: T | None, name: str, nbytes: int,
              out: int, alone: bool, wait: float | None) -> Placement:
        """Place one request: its input (copied in now unless it streams, is resident or is
        left out) and its result (``out`` bytes; ``alone``: it is not fused, so its result
        may be copied out, or combined, as it becomes final)."""
        source = None if call.blank_input else self._streamable(call, tensor, nbytes)
        sink = self._sink(call, into, nbytes) if alone or source is not None else 0
        place = self._place(tensor, name, nbytes, into, out if out != nbytes else None, wait,
                            copy_in=source is None and not call.blank_input,
                            landing=source is not None and sink > 0)
        resident = place.delivery.resident
        unchanged = into is not None and call.result_is_input
        delivery = Delivery(resident or unchanged, 0 if resident else sink,
                            place.delivery.combining)
        return Placement(place.slots, place.offset, place.out_offset, place.out_capacity,
                         delivery, resident, source if place.source is not None else None,
                         call.blank_input)

    def _streamable(self, call: OpCall, tensor: T | None, nbytes: int) -> Source | None:
        """How a tensor large enough to go out while it is copied in (an op the daemon runs
        that way) is copied: a device tensor staged by its codec, host bytes copied; None
        when it is not."""
        if not call.op.streams or tensor is None or nbytes < STREAM_MIN_BYTES:
            return None
        staged = self.codec.stager(tensor)
        if staged is not None:
            return staged
        host = self.codec.host_bytes(tensor)
        return None if host is None else host_source(host)

    def _sink(self, call: OpCall, into: T | None, nbytes: int) -> int:
        """Where an in-place result large enough to be copied out while it arrives goes (the
        host address of ``into``), or 0."""
        if into is None or call.result_is_input or not call.op.streams \
                or nbytes < STREAM_MIN_BYTES:
            return 0
        return self.codec.address(into) or 0

    def _place(self, tensor: T | None, name: str, nbytes: int, into: T | None,
               out_bytes: int | None, wait: float | None = None,
               copy_in: bool = True, landing: bool = False) -> Placement:
        """Where the input and the result (``out_bytes`` of it when it is not the input's
        size) go, and the input copied there if it needs a slot of its own (unless not
        ``copy_in``: the caller streams it in, or the op never reads it). ``landing``: in
        place on a private tensor, the result gets an arena slot of its own if one is free
        now (Delivery.combining); else the call runs in one slot. The placement's ``source``
        is set (to an empty array) when the input is still to be streamed in."""
        # a shared() tensor is already in the arena: no copy in, and in place no copy out
        at = None if tensor is None or not nbytes else self.codec.address(tensor)
        resident = None if at is None else self.arena.offset_of(at, nbytes)
        in_place = tensor is not None and into is tensor and out_bytes is None
        if resident is None and in_place and at is not None:
            resident = self.registrar.offset(tensor, at, nbytes)
        landing = landing and in_place and resident is None
        slots: list[tuple[int, int]] = []
        try:
            if resident is None:
                slots.append((self.alloc(nbytes, f"tensor '{name}'", wait), nbytes))
            spare = self.arena.try_alloc(nbytes, self._reclaim) if landing else None
            if landing := spare is not None:
                slots.append((spare, nbytes))
            # the daemon writes a result over its input once the input is sent, so one slot
            # serves both; a resident tensor gets its own result slot unless the op is in place
            elif out_bytes is not None or (resident is not None and not in_place):
                size = nbytes if out_bytes is None else out_bytes
                slots.append((self.alloc(size, f"tensor '{name}' output", wait), size))
            if tensor is not None and nbytes and resident is None and copy_in:
                self.codec.write(tensor, self.view(slots[0][0], nbytes))
        except BaseException:
            for s in slots:
                self.free_slot(*s)
            raise
        offset = slots[0][0] if resident is None else resident
        if resident is not None and in_place:
            return Placement(slots, offset, offset, nbytes, Delivery(resident=True), True)
        out_offset, out_capacity = slots[-1] if slots else (offset, nbytes)
        unfilled = not copy_in and resident is None and bool(nbytes)
        return Placement(slots, offset, out_offset, out_capacity, Delivery(combining=landing),
                         source=_UNFILLED if unfilled else None)

    def alloc(self, nbytes: int, what: str, wait: float | None = None) -> int:
        """A slot for a request: in the arena (reading finished results out first when it is
        full), else memory of its own that the daemon maps (:mod:`decent.core.memory.spill`),
        else an arena slot once requests in flight free one (waiting at most ``wait`` s)."""
        off = self.arena.try_alloc(nbytes, self._reclaim)
        if off is None and nbytes <= self.arena.nbytes:
            off = self.spill.take(nbytes)
        return off if off is not None else self.arena.alloc(nbytes, what, self._reclaim, wait)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes of a request's slot."""
        if self.spill.owns(offset):
            return self.spill.view(offset, nbytes)
        return self.arena.view(offset, nbytes)

    def free_slot(self, offset: int, nbytes: int) -> None:
        """Let go of a request's slot."""
        if self.spill.owns(offset):
            self.spill.free(offset)
        else:
            self.arena.free(offset, nbytes)

    def stream_in(self, source: Source, offset: int, nbytes: int,
                  copied: Callable[[int], bool]) -> None:
        """Copy a streamed input into its slot chunk by chunk, telling ``copied(bytes in so
        far)`` after each (the daemon sends what is there); it returns False once the
        request's channel is gone. After each chunk the worker yields its core: where workers
        outnumber cores, the daemons then send the first chunks while the copies go on,
        instead of after every worker's whole copy (8 workers on 2 cores: they started 2.8
        instead of 8 ms late)."""
        for done in source(self.view(offset, nbytes)):
            if not copied(done):
                return
            os.sched_yield()


def _unfilled(dst: memoryview) -> Iterator[int]:
    """A marker source: the input is still to be streamed in (the caller has the real one)."""
    yield len(dst)


_UNFILLED: Source = _unfilled
