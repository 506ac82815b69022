"""One tensor of a running op: its wire key and views of the worker's memory."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

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
class PartSpec:
    """One tensor of a request (a fused request has several): its wire key and arena views."""

    name: str  #: wire name (job-qualified)
    display: str  #: the user's name
    round: int
    dtype: int
    shape: tuple[int, ...]
    x: np.ndarray  #: storage-dtype view of the input, flat
    out: memoryview  #: this tensor's output region
    raw: memoryview  #: the input's bytes
    #: payloads may be received straight into ``out``: it lies in the sealed arena (memory a
    #: worker registered may shrink under a receive, which would break the connection)
    landable: bool = True
    #: while a timeline records: when its client took the call, queued it and sent its request
    submitted: tuple[int, int, int] | None = None
    #: the worker is still copying the input in (:mod:`decentd.workers.staging`); None: it is whole
    fill: FillState | None = None
    #: the worker did not copy the input in (TensorRef.blank): the op must not read ``x``
    blank: bool = False
    #: the worker copies the result out as it becomes final (SubmitRequest.draining)
    drain: Drain | None = None
    #: the output region starts where the input does: the result is written over it
    in_place: bool = False
    #: the worker may combine the result itself (SubmitRequest.combining; with ``drain``)
    combining: bool = False

    @property
    def nbytes(self) -> int:
        """Input bytes."""
        return int(self.x.nbytes)

    def release(self) -> None:
        """Drop the views of the worker's memory (so that it can be unmapped)."""
        self.x, self.out, self.raw = _EMPTY, _NO_BYTES, _NO_BYTES
        if self.fill is not None:
            self.fill.release()

    def gate(self, base: int = 0) -> FillGate | None:
        """What a send of the input's bytes from ``base`` waits on while it is copied in."""
        return None if self.fill is None or self.fill.complete else FillGate(self.fill, base)

    def output(self, nbytes: int, label: str) -> np.ndarray:
        """The output region as a flat storage-dtype array of ``nbytes``; ARENA_ERROR when the
        result does not fit."""
        if nbytes > len(self.out):
            raise DecentError(pb.ARENA_ERROR, f"{label}: result of {nbytes} bytes does not fit "
                                              f"the {len(self.out)}-byte output region")
        return np.frombuffer(self.out, dtypes.STORAGE[self.dtype],
                             nbytes // dtypes.itemsize(self.dtype))


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
