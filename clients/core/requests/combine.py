"""A worker combining its own in-place result (``SubmitRequest.combining``).

For an in-place neighbor average of a large private tensor with a lone in-neighbor, the daemon
receives the neighbor's tensor into the request's output slot and tells the worker how much of
it has landed and with which weights (``Completion.combine``); the worker computes
``self_weight * x + weight * y`` into its own tensor as it lands. That replaces copying the
daemon's result back, with the daemon's own arithmetic (the same bits).
"""

from __future__ import annotations

import ctypes

import numpy as np

from decent_wire import dtypes
from decent_wire.numerics import weighted_sum
from decent_wire.v1 import decent_pb2 as pb


def combine_into(address: int, landed: np.ndarray, dtype: int, lo: int, hi: int,
                 combine: pb.Combine) -> None:
    """Bytes ``[lo, hi)`` of the tensor at host ``address`` (wire ``dtype``) become
    ``combine.self_weight`` times themselves plus ``combine.weight`` times the same bytes of
    ``landed`` (uint8, the in-neighbor's tensor). ``lo`` and ``hi`` are whole elements."""
    storage = dtypes.STORAGE[dtype]
    raw = (ctypes.c_uint8 * (hi - lo)).from_address(address + lo)
    mine, theirs = np.ctypeslib.as_array(raw).view(storage), landed[lo:hi].view(storage)
    weighted_sum(mine, mine, combine.self_weight, [(theirs, combine.weight)], dtype)


def whole_elements(nbytes: int, dtype: int) -> int:
    """``nbytes`` rounded down to whole elements of ``dtype``."""
    return nbytes - nbytes % dtypes.itemsize(dtype)


def combining(completion: pb.Completion | None) -> pb.Combine | None:
    """The weights a (partial) completion asks the worker to combine by, or None: the output
    holds the result."""
    if completion is None or not completion.HasField("combine"):
        return None
    return completion.combine
