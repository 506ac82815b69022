"""What a neighbor op does while a lone in-neighbor's tensor arrives (followed in the op's own
task, :mod:`decentd.ops.arriving`): fold it into the result (:class:`FoldIn`), or tell a worker
that copies its result out how much of it landed final (:func:`lands_final`)."""

from __future__ import annotations

import numpy as np

from decent_wire import dtypes
from decent_wire.numerics import weighted_sum
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops.api import OpContext, Outgoing, PartSpec
from decentd.ops.arriving import OnArrival

#: a tensor still arriving is folded in once at least this many more elements are usable (the
#: receiver reports progress in large steps, halving toward the end of a payload)
FOLD_MIN = 1 << 16


class FoldIn:
    """Folds a lone in-neighbor's tensor into the result while it is still arriving (the op
    follows the arrival, :mod:`decentd.ops.arriving`, and calls :meth:`arrived`).

    The result may overwrite the input (one arena slot), so element k is combined only once the
    input's element k has gone out to every out-neighbor; on a link where sending and receiving
    run at the same pace that keeps up with the arrival, and only the tail is left at the end.
    The arriving tensor may be the slice of ``count`` elements from ``base`` of ours.
    """

    def __init__(self, ctx: OpContext, p: PartSpec, self_weight: float, src_weight: float,
                 dsts: list[int], base: int = 0, count: int | None = None) -> None:
        self.ctx, self.p = ctx, p
        self.self_weight, self.src_weight = self_weight, src_weight
        self.itemsize = dtypes.itemsize(p.dtype)
        self.base = base
        self.count = p.x.size if count is None else count
        self.done = 0  # elements combined (of the arriving tensor)
        self.sends: dict[int, list[tuple[Outgoing, int]]] = {d: [] for d in dsts}
        self.finished: set[int] = set()  # destinations whose send returned
        self.off = False

    def sent(self) -> int:
        """Input bytes known to be in the kernel for every destination (and copied in by
        the worker)."""
        low = self.p.input.copied
        for d, items in self.sends.items():
            if d not in self.finished:
                low = min(low, max((i.sent - h for i, h in items), default=0))
        return low

    def arrived(self, buf: np.ndarray, filled: int, weight: float, part: pb.Part) -> None:
        """``buf[:filled]`` of the neighbor's tensor has arrived."""
        p = self.p
        if self.off or not (part.op == self.ctx.op and part.meta.dtype == p.dtype
                            and tuple(part.meta.shape) == p.shape
                            and part.nbytes == self.count * self.itemsize):
            self.off = True  # anything odd: leave it to the checks after the arrival
            return
        upto = min(filled, self.sent() - self.base * self.itemsize) // self.itemsize
        if upto - self.done < FOLD_MIN:
            return
        try:
            self.fold(buf, weight, upto)
        except Exception:  # e.g. an output region too small: the op reports it at the end
            self.off = True
            self.done = 0

    def fold(self, buf: np.ndarray, weight: float, upto: int) -> None:
        """Combine elements ``[done, upto)`` of the arriving tensor."""
        p = self.p
        y = buf[:upto * self.itemsize].view(dtypes.STORAGE[p.dtype])
        out = self.ctx.output(p, p.nbytes)
        lo, b = self.done, self.base
        weighted_sum(out[b + lo:b + upto], p.x[b + lo:b + upto], self.self_weight,
                     [(y[lo:upto], self.src_weight * weight)], p.dtype)
        self.done = upto
        if b == 0:
            p.sink.final(upto * self.itemsize)


def lands_final(p: PartSpec, src_weight: float) -> OnArrival | None:
    """For a worker that copies ``p``'s result out as it becomes final (``Sink.drains``): what
    to do as a tensor received straight into the output arrives: final as it lands, unless it
    is to be scaled. None for any other request."""
    if not p.sink.drains or not len(p.out):
        return None
    start = np.frombuffer(p.out, np.uint8).ctypes.data
    sink = p.sink

    def landed(buf: np.ndarray, filled: int, weight: float, _part: pb.Part) -> None:
        if src_weight * weight == 1.0 and buf.ctypes.data == start:
            sink.final(filled)
    return landed
