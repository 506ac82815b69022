"""One tensor of a running op: its wire key, its input and its result sink.

An op never looks at how its worker placed a tensor. It reads and sends its :class:`Input` and
writes its result through its :class:`Sink`; the engine's placement layer
(:mod:`decentd.engine.placement`) chose both from the request:

- the input is whole in the arena, still being copied in by the worker (``fill``: sends wait
  for it, readers await :meth:`Input.whole`), or left out (``blank``: a call that never reads
  it);
- the sink is the request's output region; a payload may land in it straight from the socket
  (:meth:`Sink.landing`); a worker that copies its in-place result out as it becomes final is
  told how much is (:meth:`Sink.final`); and one that combines its result itself takes the
  in-neighbor's tensor instead (:meth:`Sink.hands_off`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import PeerLost
from decentd.mailbox.arrivals import Arrival
from decentd.workers.staging import Drain, FillGate, FillState

_EMPTY = np.empty(0, np.uint8)
_NO_BYTES = memoryview(b"")


@dataclass(slots=True)
class Input:
    """An op's input tensor, as its worker left it."""

    x: np.ndarray  #: storage-dtype view of the input, flat
    raw: memoryview  #: the input's bytes
    #: the worker is still copying it in (:mod:`decentd.workers.staging`); None: it is whole
    fill: FillState | None = None
    #: the worker did not copy it in (TensorRef.blank): the op must not read it
    blank: bool = False

    @property
    def nbytes(self) -> int:
        """Input bytes."""
        return int(self.x.nbytes)

    @property
    def copied(self) -> int:
        """Bytes of it the worker has copied in so far."""
        return self.nbytes if self.fill is None else self.fill.filled

    def gate(self, base: int = 0) -> FillGate | None:
        """What a send of its bytes from ``base`` waits on while it is copied in."""
        return None if self.fill is None or self.fill.complete else FillGate(self.fill, base)

    async def whole(self) -> None:
        """Wait until the worker has copied all of it in (at once for most inputs)."""
        if self.fill is not None and not self.fill.complete:
            await self.fill.whole()

    def release(self) -> None:
        """Drop the views of the worker's memory; wake what waits for the copy."""
        self.x, self.raw = _EMPTY, _NO_BYTES
        if self.fill is not None:
            self.fill.release()


@dataclass(slots=True)
class Sink:
    """Where an op's result goes, and who hears of it as it becomes final."""

    out: memoryview  #: the output region
    #: payloads may be received straight into ``out``: it lies in the sealed arena (memory a
    #: worker registered may shrink under a receive, which would break the connection)
    landable: bool = True
    #: the output region starts where the input does: the result is written over it
    in_place: bool = False
    #: the worker copies the result out as it becomes final (SubmitRequest.draining)
    drain: Drain | None = None
    #: the worker may combine the result itself (SubmitRequest.combining; with ``drain``)
    combining: bool = False

    def region(self, nbytes: int, label: str, dtype: int) -> np.ndarray:
        """The output region as a flat ``dtype`` array of ``nbytes``; ARENA_ERROR when the
        result does not fit."""
        if nbytes > len(self.out):
            raise DecentError(pb.ARENA_ERROR, f"{label}: result of {nbytes} bytes does not fit "
                                              f"the {len(self.out)}-byte output region")
        return np.frombuffer(self.out, dtypes.STORAGE[dtype], nbytes // dtypes.itemsize(dtype))

    def landing(self, nbytes: int) -> np.ndarray | None:
        """The first ``nbytes`` of the output, for a payload to be received straight into
        (uint8), or None when payloads may not land there (or it is too small: the op's
        :meth:`region` says so later)."""
        if not self.landable or len(self.out) < nbytes:
            return None
        return np.frombuffer(self.out, np.uint8, nbytes)

    def final(self, nbytes: int, combine: pb.Combine | None = None) -> None:
        """The first ``nbytes`` of the result hold their final values (``combine``: they hold
        the in-neighbor's tensor, which the worker combines with its own so); told to a
        worker that copies its result out as it becomes final, nobody otherwise."""
        if self.drain is not None:
            self.drain.final(nbytes, combine)

    @property
    def told(self) -> int:
        """Bytes the worker has been told are final (or have landed for it to combine)."""
        return 0 if self.drain is None else self.drain.told

    @property
    def drains(self) -> bool:
        """Whether the worker copies the result out as it becomes final."""
        return self.drain is not None

    def hands_off(self, nbytes: int) -> bool:
        """Whether the worker may take the in-neighbor's tensor (``nbytes``) in this sink and
        combine its result itself: it asked to, and the sink is a slot of its own that
        payloads may land in."""
        return self.combining and self.drain is not None and self.landable \
            and not self.in_place and len(self.out) >= nbytes

    def release(self) -> None:
        """Drop the view of the worker's memory."""
        self.out = _NO_BYTES


@dataclass(slots=True)
class PartSpec:
    """One tensor of a request (a fused request has several): its wire key, its input and its
    result sink."""

    name: str  #: wire name (job-qualified)
    display: str  #: the user's name
    round: int
    dtype: int
    shape: tuple[int, ...]
    input: Input
    sink: Sink
    #: while a timeline records: when its client took the call, queued it and sent its request
    submitted: tuple[int, int, int] | None = field(default=None)
    #: a collective's description of it, carried in the op's own exchange when the op agrees
    #: in it (``OpContext.agrees_in_exchange``)
    agreement: pb.Agreement | None = None

    @classmethod
    def over(cls, name: str, display: str, round_: int, dtype: int, shape: tuple[int, ...],
             x: np.ndarray, out: memoryview, raw: memoryview) -> PartSpec:
        """A tensor whose input is whole in ``x``/``raw`` and whose result goes to ``out``."""
        return cls(name, display, round_, dtype, shape, Input(x, raw), Sink(out))

    def copy(self, name: str | None = None, agreement: pb.Agreement | None = None) -> PartSpec:
        """A spec of the same tensor (under key ``name`` if given, described by
        ``agreement``) with views of its own, so that dropping them leaves this one's (the
        fill and the drain, the request's, are shared)."""
        return PartSpec(self.name if name is None else name, self.display, self.round,
                        self.dtype, self.shape, dataclasses.replace(self.input),
                        dataclasses.replace(self.sink), self.submitted, agreement)

    def segment(self, name: str, lo: int, hi: int) -> PartSpec:
        """Elements ``lo:hi`` of this (whole, staged) tensor under key ``name`` (the wire part
        keeps the whole tensor's shape)."""
        size = self.x.itemsize
        whole = Input(self.x[lo:hi], self.raw[lo * size:hi * size])
        return PartSpec(name, self.display, self.round, self.dtype, self.shape, whole,
                        Sink(self.out[lo * size:hi * size]), self.submitted)

    @property
    def x(self) -> np.ndarray:
        """The input, a flat storage-dtype array."""
        return self.input.x

    @property
    def raw(self) -> memoryview:
        """The input's bytes."""
        return self.input.raw

    @property
    def out(self) -> memoryview:
        """The output region."""
        return self.sink.out

    @property
    def nbytes(self) -> int:
        """Input bytes."""
        return self.input.nbytes

    def release(self) -> None:
        """Drop the views of the worker's memory (so that it can be unmapped)."""
        self.input.release()
        self.sink.release()

    def output(self, nbytes: int, label: str) -> np.ndarray:
        """The output region as a flat storage-dtype array of ``nbytes``; ARENA_ERROR when the
        result does not fit."""
        return self.sink.region(nbytes, label, self.dtype)


@dataclass(slots=True)
class Expected:
    """Parts of an op the mailbox waits for from ``src`` (``OpContext.expect_parts``)."""

    src: int
    tag: int
    parts: list[PartSpec]
    futs: list[asyncio.Future[Arrival]]
    ack: bool
    sized: bool
    shape: tuple[int, ...] | None
    #: ``src`` was down when the receive began: what awaiting it raises
    lost: PeerLost | None = None

    def drop(self) -> None:
        """Nobody will await these parts (the op failed first): stop waiting for them (an
        error one of them got meanwhile counts as seen)."""
        for f in self.futs:
            if not f.done():
                f.cancel()
            elif not f.cancelled():
                f.exception()  # retrieved: a failure the op no longer cares about
