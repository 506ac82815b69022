"""The worker combines its own in-place result (``SubmitRequest.combining``).

An in-place neighbor average of a large private tensor costs its worker two copies: the tensor
into the arena (it goes out from there) and the result back. When the op has a lone
in-neighbor, the daemon receives that neighbor's tensor straight into the request's output slot
and leaves the arithmetic to the worker, which computes ``self_weight * x + weight * y`` over
its own tensor while the rest arrives: the copy back disappears, and the daemon's combine moves
to the worker (the same arithmetic, :func:`decent_wire.numerics.weighted_sum`, the same bits).
"""

from __future__ import annotations

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops.api import Arrival, OpContext
from decentd.ops.parts import PartSpec


def hand_off(ctx: OpContext, parts: list[PartSpec], srcs: list[int], self_weight: float,
             recv: dict[int, float]) -> HandOff | None:
    """A hand-off of the op's result to its worker when the worker can combine it itself: it
    asked to, the op has one tensor and a lone in-neighbor, and the sink is a slot of its own
    that payloads may land in (:meth:`Sink.hands_off`). None otherwise (the daemon combines,
    as always)."""
    p = parts[0]
    if len(parts) != 1 or len(srcs) != 1 or not p.sink.hands_off(p.nbytes):
        return None
    return HandOff(ctx, p, srcs[0], self_weight, recv[srcs[0]])


class HandOff:
    """Tells the worker how much of its in-neighbor's tensor has landed in the output (as the
    op follows its arrival), with the weights to combine it by."""

    def __init__(self, ctx: OpContext, p: PartSpec, src: int, self_weight: float,
                 src_weight: float) -> None:
        self.ctx, self.p, self.sink, self.src = ctx, p, p.sink, src
        self.self_weight, self.src_weight = self_weight, src_weight
        self.start = np.frombuffer(p.out, np.uint8).ctypes.data
        self.itemsize = dtypes.itemsize(p.dtype)

    def combine(self, weight: float) -> pb.Combine:
        """The weights for an arrival sent with ``weight`` (the sender's dst weight)."""
        return pb.Combine(self_weight=self.self_weight, weight=self.src_weight * weight)

    def arrived(self, buf: np.ndarray, filled: int, weight: float, _part: pb.Part) -> None:
        """``buf[:filled]`` of the neighbor's tensor has arrived: tell the worker if it
        landed in the output (the mailbox lands only a tensor the op accepts there; one that
        arrived before the op did lies elsewhere)."""
        if buf.ctypes.data == self.start:
            self.sink.final(filled - filled % self.itemsize, self.combine(weight))

    def finish(self, arrival: Arrival | None, self_weight: float) -> pb.Combine:
        """The completion's weights once the neighbor's tensor is all here (copied into the
        output if it arrived elsewhere), or, with ``arrival`` None (the neighbor was lost
        before any of it reached the worker), ``self_weight`` alone."""
        if arrival is None:
            if self.sink.told:
                raise DecentError(pb.PEER_UNAVAILABLE, f"{self.ctx.label}: rank {self.src} was "
                                  "lost while its tensor was being combined; the result cannot "
                                  "be reweighted")
            return pb.Combine(self_weight=self_weight, weight=0.0)
        out = self.ctx.output(self.p, self.p.nbytes).view(np.uint8)
        data = arrival.data.view(np.uint8)
        if data.ctypes.data != out.ctypes.data:
            np.copyto(out, data[:out.size])
        return self.combine(arrival.weight)
