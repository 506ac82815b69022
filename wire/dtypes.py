"""The wire dtypes: what each ``decent.v1.DType`` is in memory, and how messages name it.

numpy has no bfloat16: its bytes are viewed as uint16 bit patterns.
"""

from __future__ import annotations

import math

import numpy as np

from decent_wire.v1 import decent_pb2 as pb

#: the numpy dtype each wire dtype's bytes are viewed as
STORAGE: dict[int, np.dtype] = {
    pb.FLOAT16: np.dtype(np.float16),
    pb.BFLOAT16: np.dtype(np.uint16),
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.INT32: np.dtype(np.int32),
    pb.INT64: np.dtype(np.int64),
    pb.UINT8: np.dtype(np.uint8),
    pb.INT8: np.dtype(np.int8),
    pb.INT16: np.dtype(np.int16),
}


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype."""
    return STORAGE[dtype].itemsize


def nbytes(dtype: int, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * itemsize(dtype)


def dtype_name(dtype: int) -> str:
    """Human name of a wire dtype, e.g. ``float32``."""
    return str(pb.DType.Name(dtype)).lower()


def describe(dtype: int, shape: tuple[int, ...] | list[int]) -> str:
    """``float32[4, 3]`` style description used in error messages."""
    return f"{dtype_name(dtype)}[{', '.join(str(int(s)) for s in shape)}]"
