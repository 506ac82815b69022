"""A codec for plain numpy arrays (no bfloat16: numpy has none)."""

from __future__ import annotations

import numpy as np

from decent.core.memory.arena import ClientArena
from decent.core.memory.codec import HostCodec
from decent.core.memory.regions import SharedStorage
from decent_wire.v1 import decent_pb2 as pb

_TO_WIRE: dict[np.dtype, int] = {
    np.dtype(np.float16): pb.FLOAT16,
    np.dtype(np.float32): pb.FLOAT32,
    np.dtype(np.float64): pb.FLOAT64,
    np.dtype(np.int32): pb.INT32,
    np.dtype(np.int64): pb.INT64,
    np.dtype(np.uint8): pb.UINT8,
    np.dtype(np.int8): pb.INT8,
    np.dtype(np.int16): pb.INT16,
}
_FROM_WIRE: dict[int, np.dtype] = {v: k for k, v in _TO_WIRE.items()}


class NumpyCodec(HostCodec):
    """Moves ``numpy.ndarray`` in and out of the arena."""

    framework = "numpy"

    def describe(self, tensor: np.ndarray) -> tuple[int, tuple[int, ...]]:
        """Wire dtype and shape."""
        try:
            return _TO_WIRE[tensor.dtype], tuple(tensor.shape)
        except KeyError:
            raise TypeError(f"dtype {tensor.dtype} is not supported "
                            f"(use one of {', '.join(str(d) for d in _TO_WIRE)})") from None

    def write(self, tensor: np.ndarray, dst: memoryview) -> None:
        """Copy the array's bytes into ``dst``."""
        np.frombuffer(dst, tensor.dtype).reshape(tensor.shape)[...] = tensor

    def read(self, src: memoryview, dtype: int, shape: tuple[int, ...],
             like: np.ndarray | None) -> np.ndarray:
        """A new array from ``src``."""
        return np.frombuffer(src, _FROM_WIRE[dtype]).reshape(shape).copy()

    def read_into(self, src: memoryview, into: np.ndarray) -> np.ndarray:
        """Copy the result into ``into`` (same dtype and shape) and return it."""
        into[...] = np.frombuffer(src, into.dtype).reshape(into.shape)
        return into

    def host_bytes(self, tensor: np.ndarray) -> np.ndarray | None:
        """A C-contiguous array's bytes (a view)."""
        return tensor.reshape(-1).view(np.uint8) if tensor.flags.c_contiguous else None

    def address(self, tensor: np.ndarray) -> int | None:
        """Address of a writable C-contiguous array's bytes (a read-only one is only read,
        through a copy: nothing may write into it in place)."""
        flags = tensor.flags
        return int(tensor.ctypes.data) if flags.c_contiguous and flags.writeable else None

    def wrap(self, owner: np.ndarray, dtype: int, shape: tuple[int, ...],
             like: np.ndarray | None = None) -> np.ndarray:
        """An array over ``owner``'s bytes (a view keeps it alive)."""
        return owner.view(_FROM_WIRE[dtype]).reshape(shape)

    def result(self, owner: np.ndarray, dtype: int, shape: tuple[int, ...],
               like: np.ndarray | None) -> np.ndarray:
        """An array over ``owner``."""
        return self.wrap(owner, dtype, shape)

    def take(self, owner: np.ndarray, into: np.ndarray) -> np.ndarray | None:
        """None: an array takes its result by copy (into its own memory)."""
        return None

    def check_call(self) -> None:
        """Every call is allowed."""

    def attach(self, arena: ClientArena) -> None:
        """Nothing to do for host memory."""

    def shared_storage(self, tensor: np.ndarray) -> SharedStorage | None:
        """None: numpy arrays are not registered."""
        return None
