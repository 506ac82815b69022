"""Wire dtypes and the numpy arithmetic the daemon does on them.

numpy has no bfloat16: bfloat16 tensors are stored as uint16 bit patterns and converted to float32
for arithmetic (round-to-nearest-even on the way back).
"""

from __future__ import annotations

import numpy as np

from decentd.wire import pb

#: Storage dtype of each wire dtype (what the bytes are, viewed by numpy).
STORAGE: dict[int, np.dtype] = {
    pb.FLOAT16: np.dtype(np.float16),
    pb.BFLOAT16: np.dtype(np.uint16),
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.INT32: np.dtype(np.int32),
    pb.INT64: np.dtype(np.int64),
}

#: Dtype weighted sums are accumulated in.
COMPUTE: dict[int, np.dtype] = {
    pb.FLOAT16: np.dtype(np.float32),
    pb.BFLOAT16: np.dtype(np.float32),
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.INT32: np.dtype(np.float64),
    pb.INT64: np.dtype(np.float64),
}

#: Dtype allreduce sums are accumulated in: wider floats, exact 64-bit integers.
ACCUM: dict[int, np.dtype] = {
    pb.FLOAT16: np.dtype(np.float32),
    pb.BFLOAT16: np.dtype(np.float32),
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.INT32: np.dtype(np.int64),
    pb.INT64: np.dtype(np.int64),
}

INTEGER = frozenset({pb.INT32, pb.INT64})


def dtype_name(dtype: int) -> str:
    """Human name of a wire dtype, e.g. ``float32``."""
    return str(pb.DType.Name(dtype)).lower()


def describe(dtype: int, shape: tuple[int, ...] | list[int]) -> str:
    """``float32[4, 3]`` style description used in error messages."""
    return f"{dtype_name(dtype)}[{', '.join(str(int(s)) for s in shape)}]"


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype."""
    return STORAGE[dtype].itemsize


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
        values = values * values.dtype.type(1.0 / divide_by)
    return from_compute(values, dtype)
