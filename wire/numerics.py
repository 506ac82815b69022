"""The numpy arithmetic done on wire dtypes (the table is ``decent_wire.dtypes``): by the daemon,
and by a worker that combines an in-place result itself (``SubmitRequest.combining``).

numpy has no bfloat16: bfloat16 tensors are stored as uint16 bit patterns and converted to float32
for arithmetic (round-to-nearest-even on the way back).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from decent_wire.dtypes import STORAGE
from decent_wire.v1 import decent_pb2 as pb

#: Dtype weighted sums are accumulated in.
COMPUTE: dict[int, np.dtype] = {
    pb.FLOAT16: np.dtype(np.float32),
    pb.BFLOAT16: np.dtype(np.float32),
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.INT32: np.dtype(np.float64),
    pb.INT64: np.dtype(np.float64),
    pb.UINT8: np.dtype(np.float64),
    pb.INT8: np.dtype(np.float64),
    pb.INT16: np.dtype(np.float64),
}

#: Dtype allreduce sums are accumulated in: wider floats, exact 64-bit integers.
ACCUM: dict[int, np.dtype] = {
    pb.FLOAT16: np.dtype(np.float32),
    pb.BFLOAT16: np.dtype(np.float32),
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.INT32: np.dtype(np.int64),
    pb.INT64: np.dtype(np.int64),
    pb.UINT8: np.dtype(np.int64),
    pb.INT8: np.dtype(np.int64),
    pb.INT16: np.dtype(np.int64),
}

INTEGER = frozenset({pb.INT32, pb.INT64, pb.UINT8, pb.INT8, pb.INT16})





def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bit patterns (uint16) to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bit patterns (nearest even; NaN stays NaN)."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    u = v.view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(v)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def to_compute(storage: np.ndarray, dtype: int) -> np.ndarray:
    """A new array holding ``storage`` in the compute dtype."""
    if dtype == pb.BFLOAT16:
        return bf16_to_f32(storage)
    return storage.astype(COMPUTE[dtype])


def from_compute(values: np.ndarray, dtype: int) -> np.ndarray:
    """Cast computed values back to the storage dtype (integers round to nearest)."""
    if dtype == pb.BFLOAT16:
        return f32_to_bf16(values)
    if dtype in INTEGER:
        return np.rint(values).astype(STORAGE[dtype])
    return values.astype(STORAGE[dtype])


#: how an allreduce (or a reducing alltoall) combines two accumulated tensors, by ``ReduceOp``
#: (an average adds, then divides once; NaN propagates through MIN and MAX)
REDUCERS: dict[int, np.ufunc] = {pb.AVERAGE: np.add, pb.SUM: np.add, pb.MIN: np.minimum,
                                 pb.MAX: np.maximum, pb.PRODUCT: np.multiply}


def reduce_into(acc: np.ndarray, other: np.ndarray, reduce_op: int) -> None:
    """``acc = acc (op) other`` in place, both in the accumulation dtype."""
    REDUCERS[reduce_op](acc, other, out=acc)


def to_accum(storage: np.ndarray, dtype: int) -> np.ndarray:
    """A new array holding ``storage`` in the dtype sums are accumulated in (exact for ints)."""
    if dtype == pb.BFLOAT16:
        return bf16_to_f32(storage)
    return storage.astype(ACCUM[dtype])


def from_accum(values: np.ndarray, dtype: int, divide_by: int = 1) -> np.ndarray:
    """Storage-dtype result of an accumulated sum, divided by ``divide_by`` (an average).

    Integer results are exact: averages round half up (in integer arithmetic), a sum that does
    not fit the dtype wraps, as in torch.
    """
    if dtype in INTEGER:
        if divide_by != 1:
            q, r = np.divmod(values, divide_by)  # no intermediate can overflow
            values = q + (2 * r >= divide_by)
        return values.astype(STORAGE[dtype])
    if divide_by != 1:
        scaled = np.empty_like(values)
        divide(values, divide_by, scaled)
        values = scaled
    return from_compute(values, dtype)


#: elements combined per pass: small enough that the temporaries stay in cache
BLOCK = 1 << 18


@functools.lru_cache(maxsize=256)
def _power_of_two(w: float) -> bool:
    return w > 0.0 and math.frexp(w)[0] == 0.5


def uniform_divisor(weights: list[float]) -> int | None:
    """``k`` when every weight is exactly ``1/k`` (uniform averaging over ``k`` members): the
    sum is then divided once by ``k``, as BlueFog, NCCL and Horovod average, instead of scaling
    every term by ``1/k`` rounded. None otherwise (or for a single term)."""
    if len(weights) < 2 or any(w != weights[0] for w in weights) or weights[0] <= 0.0:
        return None
    k = round(1.0 / weights[0])
    return k if k >= 1 and 1.0 / k == weights[0] else None


def _sum_widened(out: np.ndarray, live: list[tuple[np.ndarray, float]], dtype: int,
                 size: int) -> None:
    """:func:`weighted_sum` for 16-bit floats and integers: accumulated in the compute dtype."""
    divisor = uniform_divisor([w for _, w in live])
    acc = np.empty(min(BLOCK, size), COMPUTE[dtype])
    for start in range(0, size, BLOCK):
        end = min(start + BLOCK, size)
        a = acc[:end - start]
        a[...] = 0
        for v, w in live:
            a += to_compute(v[start:end], dtype) if divisor else to_compute(v[start:end], dtype) * w
        if divisor:
            a /= divisor
        out[start:end] = from_compute(a, dtype)


def weighted_sum(out: np.ndarray, x: np.ndarray, self_weight: float,
                 terms: list[tuple[np.ndarray, float]], dtype: int) -> None:
    """``out = self_weight * x + sum(w * y for y, w in terms)`` in the compute dtype.

    Works block by block into ``out`` (storage dtype): no tensor-sized temporary, and the terms
    are added in the given order, so every run gives the same bits. A weight of 0 drops its term
    (its NaN/Inf too) for every dtype. When every weight is ``1/k`` the terms are summed and the
    sum divided by ``k`` once (exact for a power of two, and correctly rounded otherwise).
    """
    live = [(v, w) for v, w in ((x, self_weight), *terms) if w != 0.0]
    if STORAGE[dtype] != COMPUTE[dtype]:
        _sum_widened(out, live, dtype, x.size)
        return
    if not live:
        out[...] = 0
        return
    divisor = uniform_divisor([w for _, w in live])
    # the first term is the output itself (in place): nothing to copy
    first = live[0][0]
    first_is_out = first is out or (out.size == first.size and np.may_share_memory(out, first)
                                    and out.ctypes.data == first.ctypes.data)
    if x.size <= BLOCK:  # one pass over whole arrays (most tensors): no slices
        _combine(out, live, divisor, first_is_out, None)
        return
    # scaled terms after the first need room for their product
    scaled = not divisor and any(w != 1.0 for _, w in live[1:])
    tmp = np.empty(BLOCK, COMPUTE[dtype]) if scaled else None
    for start in range(0, x.size, BLOCK):
        end = min(start + BLOCK, x.size)
        _combine(out[start:end], [(v[start:end], w) for v, w in live], divisor, first_is_out,
                 None if tmp is None else tmp[:end - start])


def _combine(out: np.ndarray, live: list[tuple[np.ndarray, float]], divisor: int | None,
             first_is_out: bool, tmp: np.ndarray | None) -> None:
    """One pass of :func:`weighted_sum` over same-sized arrays (``tmp``: room for a scaled
    term; None: made when one needs it)."""
    for i, (v, w) in enumerate(live):
        if i == 0:
            if divisor or w == 1.0:
                if not first_is_out:
                    np.copyto(out, v)
            else:
                np.multiply(v, w, out=out)
        elif divisor or w == 1.0:
            np.add(out, v, out=out)
        else:
            np.add(out, np.multiply(v, w, out=tmp), out=out)
    if divisor and divisor != 1:
        divide(out, divisor, out)


def divide(values: np.ndarray, divisor: int, out: np.ndarray) -> None:
    """``out = values / divisor``, correctly rounded (a multiplication when ``1/divisor`` is
    exact: the same bits, faster)."""
    if _power_of_two(1.0 / divisor):
        np.multiply(values, values.dtype.type(1.0 / divisor), out=out)
    else:
        np.divide(values, values.dtype.type(divisor), out=out)
