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


def add_into(acc: np.ndarray, other: np.ndarray, dtype: int) -> None:
    """``acc += other`` for two storage arrays of the same wire dtype (exact for integers)."""
    if dtype == pb.BFLOAT16:
        acc[...] = f32_to_bf16(bf16_to_f32(acc) + bf16_to_f32(other))
    else:
        np.add(acc, other, out=acc)


def scale_into(acc: np.ndarray, factor: float, dtype: int) -> None:
    """``acc *= factor`` in place on a storage array (integers: rounded to nearest)."""
    if dtype == pb.BFLOAT16:
        acc[...] = f32_to_bf16(bf16_to_f32(acc) * np.float32(factor))
    elif dtype in INTEGER:
        acc[...] = np.rint(acc * factor).astype(acc.dtype)
    else:
        acc *= acc.dtype.type(factor)
